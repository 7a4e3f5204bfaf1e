"""The course's GPU paths, on a real GPU: CUDA-event timing, the allocator's memory figures,
the launcher's backends on one GPU, a model zoo step on the GPU.

Skipped where there is no GPU (CI, laptops); `scripts/gpu_check.sh` runs them on a GPU node.
Each test compares against theory or the CPU's answer, as the CPU tests do.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import helpers
from helpers.measure.bench import memcpy_bandwidth
from helpers.measure.memory import memory_limit
from helpers.measure.timing import StepTimer

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh on a GPU node)"
)
MiB = 2**20


def test_step_timer_times_the_gpu_work_not_the_launch():
    # One matmul in 'forward', three in 'backward': CUDA events must see ~3x, where a host clock
    # that did not wait would see two kernel launches of about the same few microseconds.
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev)
    timer = StepTimer(dev)
    for _ in range(4):
        timer.start()
        a @ a
        timer.mark("forward")
        for _ in range(3):
            a @ a
        timer.mark("backward")
        timer.stop()
    for rec in timer.records[1:]:
        ratio = rec["backward"] / rec["forward"]
        assert 2.4 < ratio < 3.6, (ratio, rec)
        assert rec["total"] == pytest.approx(rec["forward"] + rec["backward"], rel=0.02)
        # the host clock of 'forward' (no sync) measured the launch only
        host = dict((name, t1 - t0) for name, t0, t1 in rec["spans"])
        assert host["forward"] < rec["forward"], (host, rec)


def test_memcpy_bandwidth_is_device_memory_speed():
    # 64 MiB copies: far past launch overhead. HBM moves TB/s; a clock that measured launches
    # (or a copy left on the host) would report nonsense either way. S/t counts bytes once.
    (rec,) = memcpy_bandwidth([64 * MiB], device="cuda")
    assert 100 < rec["algbw_GBps"] < 5000, rec


def test_memory_limit_reads_the_allocators_peak():
    model = torch.nn.Linear(1024, 1024).cuda()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(4096, 1024, device="cuda")  # 16 MiB, allocated before the budget opens
    model(x).sum().backward()  # a warm-up step: cuBLAS's workspace is allocated once, here
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with memory_limit("256MB", model) as m:
        y = model(x)  # 16 MiB more
        y.sum().backward()  # the gradients (params' bytes) and a 16 MiB gradient of y
    grown = m.peak["total"] - before
    assert 16 * MiB + params <= grown <= 2 * 16 * MiB + params + 4 * MiB, (grown, m.peak)


def test_memory_limit_raises_cudas_out_of_memory_past_the_budget():
    model = torch.nn.Linear(16, 16).cuda()
    with pytest.raises(torch.OutOfMemoryError):
        with memory_limit("32MB", model):
            torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
    # the budget is lifted afterwards: the same request now fits
    torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")


def _cuda_all_reduce():
    c = torch.full((4,), float(dist.get_rank() + 1), device=helpers.device())
    dist.all_reduce(c)
    return dist.get_backend(), str(c.device), c.tolist()


def test_one_rank_per_gpu_goes_through_nccl():
    n = torch.cuda.device_count()
    got = helpers.launch(_cuda_all_reduce, world_size=n)
    want = float(n * (n + 1) / 2)
    for r, (backend, device, values) in enumerate(got):
        assert "nccl" in backend and device == f"cuda:{r}" and values == [want] * 4, got


def _gloo_on_a_shared_gpu():
    # More ranks than GPUs: auto chose gloo, and every rank's device() is a CUDA device it
    # shares. gloo copies CUDA tensors through the host for these collectives.
    r, n = dist.get_rank(), dist.get_world_size()
    dev = helpers.device()
    t = torch.full((8,), float(r + 1), device=dev)
    dist.all_reduce(t)
    b = torch.full((8,), float(r), device=dev)
    dist.broadcast(b, src=0)
    parts = [torch.empty(8, device=dev) for _ in range(n)]
    dist.all_gather(parts, torch.full((8,), float(r), device=dev))
    return dist.get_backend(), str(dev), t[0].item(), b[0].item(), [p[0].item() for p in parts]


def test_more_ranks_than_gpus_share_a_gpu_through_gloo():
    n = torch.cuda.device_count() + 1
    got = helpers.launch(_gloo_on_a_shared_gpu, world_size=n)
    for backend, device, total, bcast, gathered in got:
        assert backend == "gloo" and device.startswith("cuda"), got
        assert total == n * (n + 1) / 2 and bcast == 0.0 and gathered == list(range(n)), got


def test_nccl_asked_with_more_ranks_than_gpus_is_a_clear_error():
    n = torch.cuda.device_count() + 1
    with pytest.raises(helpers.LaunchError, match="backend='nccl' needs one CUDA GPU per rank"):
        helpers.launch(_cuda_all_reduce, world_size=n, backend="nccl")


def test_zoo_profile_on_the_gpu_matches_the_parameter_count():
    from helpers.measure import zoo

    got = helpers.launch(zoo.profile, "resnet18", world_size=torch.cuda.device_count())
    for res in got:
        recs = res["records"]
        assert recs and all(rec["total"] > 0 for rec in recs), res
        assert res["params"] == sum(p.numel() for p in zoo.build("resnet18").parameters())


def _powersgd_steps():
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = helpers.device()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(32, 32).to(dev))
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    for _ in range(4):  # two plain all-reduces, then two compressed steps
        model(torch.randn(8, 32, device=dev)).sum().backward()
    return str(dev), model.module.weight.grad.isfinite().all().item()


def test_powersgd_runs_on_the_ranks_gpu_one_each_or_shared():
    # Lecture 02 and lab 02 run PowerSGD on helpers.device(): its hook synchronises CUDA whenever
    # CUDA exists, so a CPU model on a GPU node failed in it (an H200 node, torch 2.11).
    for n in (torch.cuda.device_count(), torch.cuda.device_count() + 1):
        got = helpers.launch(_powersgd_steps, world_size=n)
        assert all(dev.startswith("cuda") and finite for dev, finite in got), (n, got)


def _shard_a_cpu_model():
    from helpers.parallel.sharding import shard_fully

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    shard_fully(model)
    model(torch.randn(4, 16)).sum().backward()
    return sorted({p.device.type for p in model.parameters()})


def test_shard_fully_keeps_a_cpu_model_on_the_cpu_of_a_gpu_node():
    # fully_shard's default mesh is CUDA's: it moved a CPU model to the GPU, and with more ranks
    # than GPUs asked for GPU number LOCAL_RANK ("invalid device ordinal"). Lab 03, lecture 03.
    for n in (1, torch.cuda.device_count() + 1):
        assert helpers.launch(_shard_a_cpu_model, world_size=n) == [["cpu"]] * n
