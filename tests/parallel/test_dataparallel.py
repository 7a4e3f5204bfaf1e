"""helpers.dataparallel: thread-devices, the bytes theory of DP and of DDP's comm hooks (checked
against real DDP on 2 gloo ranks), and DDP's broadcasts counted."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import helpers
from helpers.parallel.dataparallel import ThreadDevices, dp_bytes, hook_bytes


def test_thread_devices_run_each_function_on_its_own_thread_and_record_spans():
    import threading

    with ThreadDevices(3) as devs:
        names = devs.run("who", [threading.current_thread for _ in range(3)])
        assert [t.name for t in names] == ["device 0", "device 1", "device 2"]
        with devs.main("wait"):
            time.sleep(0.01)
    rows = {(s["row"], s["phase"]) for s in devs.spans}
    assert rows == {("device 0", "who"), ("device 1", "who"), ("device 2", "who"), ("main", "wait")}
    wait = next(s for s in devs.spans if s["phase"] == "wait")
    assert wait["end"] - wait["start"] >= 0.01 and wait["cpu_s"] < 0.01  # sleeping is not CPU time


def test_thread_devices_run_in_parallel_and_raise_a_devices_error():
    with ThreadDevices(2) as devs:
        t0 = time.perf_counter()
        devs.run("sleep", [lambda: time.sleep(0.2)] * 2)
        assert time.perf_counter() - t0 < 0.35  # both slept at once
        with pytest.raises(ZeroDivisionError):
            devs.run("fail", [lambda: 1, lambda: 1 / 0])
        with pytest.raises(ValueError, match="one function per device"):
            devs.run("few", [lambda: 1])


def test_copies_are_real_and_counted_only_between_devices():
    with ThreadDevices(2) as devs:
        t = torch.ones(10)
        same, moved = devs.copy(t, 0, 0, "scatter"), devs.copy(t, 0, 1, "scatter")
        moved += 1
        assert devs.bytes == {"scatter": 40} and t.sum() == 10 and same.data_ptr() != t.data_ptr()
        devs.reset()
        assert devs.bytes == {} and devs.spans == []


def test_dp_bytes_theory():
    got = dp_bytes(param_bytes=1000, input_bytes=400, output_bytes=80, n=4)
    assert got == {
        "replicate": 3000,
        "scatter": 300,
        "gather": 60,
        "scatter grad": 60,
        "reduce grads": 3000,
    }
    assert sum(dp_bytes(1000, 400, 80, 1).values()) == 0


def test_hook_bytes_rules_by_hand():
    model = nn.Sequential(nn.Linear(64, 512), nn.Linear(512, 10), nn.Conv2d(1, 32, 3))
    numel = sum(p.numel() for p in model.parameters())
    assert hook_bytes(model) == 4 * numel and hook_bytes(model, "bf16") == 2 * numel
    # (512, 64) r=1: 576; (10, 512) r=1: 522; conv (32, 1·3·3) r=1: 41; biases whole: 512 + 10 + 32
    assert hook_bytes(model, "powersgd", rank=1) == 4 * (576 + 522 + 41 + 512 + 10 + 32)
    # (32, 9) at r=4: 4·41 = 164, not less than half of 288: sent whole
    assert hook_bytes(model, "powersgd", rank=4) == 4 * (4 * 576 + 4 * 522 + 288 + 554)
    model[0].weight.requires_grad_(False)  # frozen: DDP does not all-reduce it
    assert hook_bytes(model) == 4 * (numel - 512 * 64)
    with pytest.raises(ValueError):
        hook_bytes(model, "int8")


def _hook_bytes_measured(hook, rank_r):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.Flatten(),
        nn.Linear(512, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )
    model = DDP(net, bucket_cap_mb=100)  # one bucket (PowerSGD on gloo with several can race)
    if hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            None, matrix_approximation_rank=rank_r, start_powerSGD_iter=2
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        fn = {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook}[hook]
        model.register_comm_hook(None, fn)
    torch.manual_seed(dist.get_rank())
    per_step = []
    for _ in range(4):
        with helpers.trace() as tr:
            model(torch.randn(16, 1, 8, 8)).sum().backward()
        per_step.append(sum(c["bytes"] for c in tr.records if c["op"] == "all_reduce"))
    return per_step[2:], hook_bytes(net, hook, rank=rank_r)


@pytest.mark.parametrize(
    "hook,rank_r", [("none", 1), ("fp16", 1), ("powersgd", 1), ("powersgd", 2)]
)
def test_hook_bytes_equal_what_ddp_all_reduces(hook, rank_r):
    for measured, theory in helpers.launch(
        _hook_bytes_measured, hook, rank_r, world_size=2, output="none"
    ):
        assert measured == [theory, theory]


def _broadcasts():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from helpers.parallel.dataparallel import count_broadcasts

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    with count_broadcasts() as calls:
        model = DDP(net)
        for _ in range(2):
            model(torch.randn(8, 4) + dist.get_rank()).sum().backward()
    return [c["bytes"] for c in calls]


def test_count_broadcasts_sees_the_constructor_and_each_forwards_buffers():
    params, buffers = 4 * (24 + 6 + 6 + 6), 4 * 12 + 8  # BatchNorm: 2 floats × 6, one int64
    for calls in helpers.launch(_broadcasts, world_size=2, output="none"):
        assert calls == [params + buffers, buffers, buffers]


def test_plot_spans_one_row_per_thread_and_one_colour_per_phase():
    import matplotlib

    matplotlib.use("Agg")
    from helpers.parallel.dataparallel import PHASE_COLORS, plot_spans

    rows = [
        {"row": "main", "phase": "scatter", "start": 0.0, "end": 0.001},
        {"row": "device 0", "phase": "forward", "start": 0.001, "end": 0.003},
        {"row": "device 1", "phase": "forward", "start": 0.001, "end": 0.004},
        {"row": "device 1", "phase": "something else", "start": 0.004, "end": 0.005},
    ]
    ax = plot_spans(rows, title="t")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["main", "device 0", "device 1"]
    legend = {t.get_text() for t in ax.get_legend().get_texts()}
    assert legend == {"scatter", "forward", "something else"}
    assert "forward" in PHASE_COLORS


def _async_and_blocking():
    import torch.distributed as dist

    from helpers.parallel.dataparallel import AsyncRecorder

    rank = dist.get_rank()
    with AsyncRecorder() as rec:
        rec.start_step()
        big = torch.ones(2**20)  # 4 MiB: long enough that launch and completion differ
        work = dist.all_reduce(big, async_op=True)
        launched = time.perf_counter()
        work.wait()
        waited = time.perf_counter()
        rec.start_step()
        small = torch.full((3,), float(rank))
        dist.all_reduce(small)  # blocking, op passed by position below
        dist.all_reduce(small, dist.ReduceOp.SUM, None, True).wait()
    after = dist.all_reduce is not rec._all_reduce  # put back on exit
    return {
        "records": rec.records,
        "per_step": rec.per_step(),
        "intervals": rec.intervals(0),
        "launched": launched,
        "waited": waited,
        "values": (big[0].item(), small.tolist()),
        "restored": after,
    }


def test_async_recorder_times_each_all_reduce_from_launch_to_completion():
    for r in helpers.launch(_async_and_blocking, world_size=2, output="none"):
        first, blocking, positional = r["records"]
        assert r["values"] == (2.0, [2.0, 2.0, 2.0])  # the real all-reduces ran
        assert first["async"] and first["bytes"] == 4 * 2**20 and first["step"] == 0
        assert first["start"] <= r["launched"] <= first["end"] <= r["waited"] + 0.05
        assert r["launched"] <= first["waited"] <= r["waited"]  # when wait() was called
        assert not blocking["async"] and blocking["bytes"] == 12 and blocking["end"] is not None
        assert positional["async"]  # async_op given by position is still seen
        assert r["per_step"] == [
            {
                "step": 0,
                "calls": 1,
                "sent_bytes": 4 * 2**20,
                "comm_s": pytest.approx(first["end"] - first["start"]),
            },
            {
                "step": 1,
                "calls": 2,
                "sent_bytes": 24,
                "comm_s": pytest.approx(
                    blocking["end"] - blocking["start"] + positional["end"] - positional["start"]
                ),
            },
        ]
        assert r["intervals"] == [(first["start"], first["end"])] and r["restored"]
