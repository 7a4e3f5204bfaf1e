"""Lab 02's harness: what its cells run around the student's code, kept out of the notebook.

Each runner takes the student's piece as an argument (``ScratchDDP``, ``dp_step``,
``accumulation_step``: classes and functions of the notebook travel to the ranks by value) and
runs it on ranks launched by ``helpers.launch``, as the lab's test and timing cells need. What a
runner returns is data: the graded checks judge it against references of their own
(``helpers.labs.lab02``), never against anything computed here, in the student's kernel.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from helpers.labs import lab02
from helpers.launcher import world
from helpers.launcher.launch import launch
from helpers.measure import timing
from helpers.measure.comm import CommRecorder
from helpers.measure.scaling import step_seconds
from helpers.measure.timing import StepTimer
from helpers.measure.tracing import trace
from helpers.parallel.dataparallel import AsyncRecorder, ThreadDevices, hook_bytes
from helpers.workloads import data
from helpers.workloads.models import n_params

loss_fn = nn.CrossEntropyLoss()


def _launch(fn, *args, world_size: int, backend: str = "gloo", timeout: float | None = 120):
    """``fn`` on ``world_size`` ranks, quietly: every rank's result (plain data)."""
    return launch(fn, *args, world_size=world_size, backend=backend, output="none", timeout=timeout)


# -- part 2: ScratchDDP against torch DDP (test_scratch_ddp) -------------------------------------


def _ready_times(params: list) -> dict:
    """{parameter: when its gradient was final}, filled by hooks that run after the student's."""
    ready = {}

    def note(p):  # a post-accumulate hook must return None
        ready.setdefault(p, time.perf_counter())

    for p in params:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(note)
    return ready


def _scratch_step(model, recorder, ready, params, k, x, y) -> dict:
    """One step of ``model`` (a ScratchDDP): each all_reduce it made (bytes, async_op, launched
    and first waited for, seconds from the step's start), when each gradient was final, and
    when backward returned."""
    recorder.start_step()
    ready.clear()
    t0 = time.perf_counter()
    loss_fn(model(x), y).backward()
    backward_done = time.perf_counter() - t0
    model.finish()
    calls = [
        (r["bytes"], r["async"], r["start"] - t0, r["waited"] - t0 if "waited" in r else None)
        for r in recorder.records
        if r["step"] == k
    ]
    ready_s = [ready[p] - t0 if p in ready else None for p in params]
    return {"calls": calls, "ready": ready_s, "backward done": backward_done}


def scratch_ddp_run(scratch_ddp, kind, steps=3, batch=16, cap_mb=0.005, start=100) -> dict:
    """On every rank: ``scratch_ddp`` (the student's ScratchDDP class) trained from a start of
    this rank's own (seed start + rank), on this rank's share of each global batch. What it did:
    its parameters after the steps, which .grad are None, its buffers after construction, and
    per step what ``_scratch_step`` saw."""
    rank, n = dist.get_rank(), dist.get_world_size()
    module = lab02.ddp_model(kind, start + rank)  # a different start on every rank
    recorder = AsyncRecorder()
    model = scratch_ddp(module, bucket_cap_mb=cap_mb)
    buffers = [b.clone() for b in module.buffers()]
    params = list(module.parameters())
    opt = lab02.sgd(params)
    ready = _ready_times(params)
    seen = []
    for k in range(steps):
        x, y = lab02.rank_share(lab02.global_batch(k, batch * n), rank, n, params[0].dtype)
        opt.zero_grad()
        seen.append(_scratch_step(model, recorder, ready, params, k, x, y))
        opt.step()
    recorder.close()
    return {
        "parameters": [p.detach().clone() for p in params],
        "grad is None": [p.grad is None for p in params],
        "buffers after construction": buffers,
        "steps": seen,
    }


def scratch_ddp_runs(scratch_ddp, kind, world_size, steps, batch, cap_mb, start) -> list[dict]:
    """``scratch_ddp_run`` on every rank (plain data, rank order)."""
    return _launch(
        scratch_ddp_run, scratch_ddp, kind, steps, batch, cap_mb, start, world_size=world_size
    )


# -- part 2: the timing of both DDPs and of the student's DataParallel ----------------------------


def timed_run(scratch_ddp, impl, steps, warmup, batch_size, cap_mb, lr, hidden, depth) -> list:
    """On every rank: ``steps`` timed steps (after ``warmup``) of torch DDP or ``scratch_ddp``
    on this rank's chunk of each global batch; the step timer's records."""
    rank, n = dist.get_rank(), dist.get_world_size()
    module = lab02.make_model(0, hidden, depth)
    if impl == "torch DDP":
        model = DDP(module, bucket_cap_mb=cap_mb)
        recorder = CommRecorder().register(model)
    else:
        recorder = AsyncRecorder()
        model = scratch_ddp(module, bucket_cap_mb=cap_mb)
    timer = StepTimer(comm=recorder)
    opt = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)
    for k in range(warmup + steps):
        x, y = lab02.rank_share(lab02.global_batch(k, n * batch_size), rank, n)
        timer.start()
        loss = loss_fn(model(x), y)
        timer.mark("forward")
        opt.zero_grad()
        loss.backward()
        if impl == "ScratchDDP":
            model.finish()
        timer.mark("backward")
        opt.step()
        timer.mark("optimizer")
        timer.stop()
    recorder.close()
    return timer.records[warmup:]


def dp_timed(dp_step, devices, steps, warmup, batch_size, lr, hidden, depth) -> list[float]:
    """The student's DataParallel (``dp_step``): one process driving ``devices`` thread-devices;
    seconds per step, after ``warmup``."""
    model = lab02.make_model(0, hidden, depth)
    opt, seconds = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), []
    with ThreadDevices(devices) as devs:
        for k in range(warmup + steps):
            x, y = lab02.global_batch(k, devices * batch_size)
            t0 = time.perf_counter()
            opt.zero_grad()
            dp_step(model, x, y, devs)
            opt.step()
            seconds.append(time.perf_counter() - t0)
    return seconds[warmup:]


IMPLS = ("torch DDP", "ScratchDDP", "your DataParallel")


def run_impl(impl, scratch_ddp, dp_step, world_size, backend, **setting):
    """One repeat of ``impl`` (one of IMPLS): DDP on ``world_size`` ranks, or DataParallel in
    one process with ``world_size`` cores. ``setting``: steps, warmup, batch_size, cap_mb, lr,
    hidden, depth."""
    s = setting
    if impl == "your DataParallel":
        args = (dp_step, world_size, s["steps"], s["warmup"], s["batch_size"], s["lr"])
        return launch(dp_timed, *args, s["hidden"], s["depth"], world_size=1,
                      threads=world_size, backend=backend, output="none")  # fmt: skip
    args = (scratch_ddp, impl, s["steps"], s["warmup"], s["batch_size"], s["cap_mb"], s["lr"])
    return _launch(timed_run, *args, s["hidden"], s["depth"], world_size=world_size,
                   backend=backend, timeout=None)  # fmt: skip


def timing_rows(runs: dict, world_size: int) -> tuple[list[dict], dict]:
    """From ``helpers.scaling.interleave``'s runs of IMPLS: a row per implementation (median,
    min, max step in ms; the share of communication hidden behind backward) and every repeat's
    step in ms, by implementation."""
    rows, repeats_ms = [], {}
    for impl in IMPLS:
        dp = impl == "your DataParallel"
        per_repeat = [statistics.median(r[0]) if dp else step_seconds(r) for r in runs[impl]]
        repeats_ms[impl] = [1e3 * t for t in per_repeat]
        s = timing.spread(per_repeat)
        hidden = None if dp else timing.overlap_fraction(runs[impl][0][0], skip=0)
        rows.append({"implementation": impl, "step (ms)": 1e3 * s["median"],
                     "min (ms)": 1e3 * s["min"], "max (ms)": 1e3 * s["max"],
                     "hidden behind backward": hidden,
                     "oversubscribed": world.oversubscribed(world_size)})  # fmt: skip
    return rows, repeats_ms


# -- part 3: bytes per phase of a real DDP epoch (test_epoch_bytes) -------------------------------


def counted_epoch(batch_size, lr=0.05) -> dict:
    """One DDP epoch on this rank's shard of the digits (a 64×2 MLP), counting what each phase
    moves: inputs to the device, loss values back, gradients all-reduced."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x_all, y_all = lab02._digits()
    model = DDP(lab02.make_model(0, hidden=64, depth=2))
    recorder = CommRecorder().register(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sampler = DistributedSampler(range(len(y_all)), num_replicas=n, rank=rank, shuffle=False)
    mine = torch.tensor(list(sampler))
    counted = {"forward": 0, "backward": 0}
    for batch in mine.split(batch_size):
        x, y = x_all[batch], y_all[batch]  # on a GPU: x.to(device) moves these bytes
        counted["forward"] += x.numel() * x.element_size()
        recorder.start_step()
        loss = loss_fn(model(x), y)
        counted["backward"] += loss.numel() * loss.element_size()
        opt.zero_grad()
        loss.backward()
        opt.step()
    recorder.close()
    counted["all-reduce"] = sum(r["grad_bytes"] for r in recorder.records)
    steps = len(mine.split(batch_size))
    return {"counted": counted, "samples": len(mine), "steps": steps, "n_params": n_params(model)}


# -- part 4: gradient accumulation (test_accumulation_step) ---------------------------------------


def _order_hooks(model, order: list) -> None:
    """Note in ``order[-1]`` each forward of ``model`` and each backward (when its output's
    gradient arrives, as the backward starts), with its number of rows."""

    def note_backward(module, args, out):
        if out.requires_grad:
            out.register_hook(lambda grad: order[-1].append(("backward", len(grad))))

    model.register_forward_pre_hook(
        lambda module, args: order[-1].append(("forward", len(args[0])))
    )
    model.register_forward_hook(note_backward)


def accumulation_run(accumulation_step, k, micro, steps=2) -> dict:
    """``accumulation_step`` (the student's) under DDP on this rank, on its share of each global
    batch: the parameters after the steps, the gradient bytes DDP all-reduced per step, and per
    step the DDP model's forwards and backwards in the order they ran, with their sizes."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = DDP(lab02.accumulation_model())
    recorder = CommRecorder().register(model)
    order = []  # per step: ("forward", rows), ("backward", rows), ...
    _order_hooks(model, order)
    opt = lab02.sgd(model.parameters())
    for step in range(steps):
        x, y = lab02.global_batch(step, n * k * micro)
        mine = slice(rank * k * micro, (rank + 1) * k * micro)
        recorder.start_step()
        order.append([])
        accumulation_step(
            model, opt, list(zip(x[mine].split(micro), y[mine].split(micro), strict=True))
        )
    recorder.close()
    return {
        "parameters": [p.detach().clone() for p in model.module.parameters()],
        "all-reduced per step": [s["grad_bytes"] for s in recorder.per_step()],
        "order": order,
    }


def accumulation_runs(accumulation_step, k, micro, world_size=2, steps=2) -> list[dict]:
    """``accumulation_run`` on every rank (plain data, rank order)."""
    return _launch(accumulation_run, accumulation_step, k, micro, steps, world_size=world_size)


# -- part 5: compression hooks ----------------------------------------------------------------------


def _with_hook(model, hook: str, r: int, seed: int, start: int):
    """``model`` (DDP) with the communication hook named: fp16, bf16, powersgd of rank ``r``
    (from step ``start``) or DDP's own all-reduce, through Python, where the tracer sees it."""
    if hook in ("fp16", "bf16"):
        model.register_comm_hook(None, getattr(default_hooks, f"{hook}_compress_hook"))
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                            start_powerSGD_iter=start, random_seed=seed)  # fmt: skip
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    return model


def train_with_hook(hook, r, seed, epochs, lr, hidden, depth, per_rank_batch=32, start=10) -> dict:
    """The lab's MLP (seed ``seed``) trained ``epochs`` epochs under DDP with a compression hook:
    the distinct bytes all-reduced per step after step ``start``, test accuracy, final loss."""
    from helpers.launcher.world import device

    rank, n = dist.get_rank(), dist.get_world_size()
    (x_all, y_all), (xt, yt) = lab02._digits(), data.load("digits", train=False).tensors
    dev = device()  # a GPU node's GPU: PowerSGD synchronises CUDA whenever CUDA exists
    module = lab02.make_model(seed, hidden, depth).to(dev)
    model = _with_hook(DDP(module, bucket_cap_mb=100), hook, r, seed, start)  # one bucket
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sampler = DistributedSampler(range(len(y_all)), num_replicas=n, rank=rank, seed=seed)
    sent, step = [], 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in torch.tensor(list(sampler)).split(per_rank_batch):
            with trace() as tr:
                loss = loss_fn(model(x_all[batch].to(dev)), y_all[batch].to(dev))
                opt.zero_grad()
                loss.backward()
            opt.step()
            if step >= start:
                sent.append(sum(c["bytes"] for c in tr.records if c["op"] == "all_reduce"))
            step += 1
    with torch.no_grad():
        accuracy = (model.module(xt.to(dev)).argmax(1) == yt.to(dev)).float().mean().item()
    return {"bytes/step": sorted(set(sent)), "accuracy": accuracy, "loss": loss.item()}


# the settings part 5 compares: (hook, PowerSGD's rank): fp32, fp16, bf16, PowerSGD at three ranks
SETTINGS = [
    ("none", 0),
    ("fp16", 0),
    ("bf16", 0),
    ("powersgd", 1),
    ("powersgd", 2),
    ("powersgd", 4),
]


def compression_runs(seeds, epochs, lr, hidden, depth, world_size, backend) -> list[dict]:
    """Part 5: the lab's MLP trained under DDP with each of SETTINGS' hooks, from each seed
    (``train_with_hook`` on ``world_size`` ranks), its bytes per step checked against
    ``hook_bytes``: a row per run (hook, seed, bytes/step, test accuracy, final loss)."""
    rows = []
    for hook, r in SETTINGS:
        want = hook_bytes(lab02.make_model(0, hidden, depth), hook, rank=max(r, 1))
        for seed in seeds:
            res = launch(train_with_hook, hook, r, seed, epochs, lr, hidden, depth,
                         world_size=world_size, backend=backend, output="none")[0]  # fmt: skip
            assert res["bytes/step"] == [want], (hook, r, res["bytes/step"], want)
            rows.append({"hook": hook + (f" r={r}" if r else ""), "seed": seed, "bytes/step": want,
                         "test accuracy": res["accuracy"], "final loss": res["loss"]})  # fmt: skip
    return rows


# -- part 1: against nn.DataParallel, where there are GPUs ------------------------------------------


def _median_forward_backward_ms(model, x, y, steps: int = 20, skip: int = 5) -> float:
    """Median milliseconds of a forward and backward on CUDA, after ``skip`` warm-up steps."""
    seconds = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss_fn(model(x), y).backward()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(seconds[skip:])


def against_nn_dataparallel(dp_step, world_size: int, hidden: int, depth: int) -> None:
    """On a node with 2 or more GPUs: the student's DataParallel (``dp_step`` on thread-devices)
    against ``nn.DataParallel`` on up to ``world_size`` GPUs, the same outputs and gradients,
    and nn.DataParallel's time against one GPU's. Elsewhere says why there is nothing to run."""
    if torch.cuda.device_count() < 2:
        print(f"{torch.cuda.device_count()} GPU(s): nn.DataParallel needs 2 or more to split "
              "anything; on a CPU its primitives refuse CPU tensors (lecture 02)")  # fmt: skip
        return
    gpus = list(range(min(world_size, torch.cuda.device_count())))
    x, y = lab02.global_batch(0, 64 * len(gpus))
    mine = lab02.make_model(0, hidden, depth)  # the student's, on thread-devices (CPU)
    with ThreadDevices(len(gpus)) as devs:
        dp_step(mine, x, y, devs)
    theirs = nn.DataParallel(lab02.make_model(0, hidden, depth).cuda(), device_ids=gpus)
    out = theirs(x.cuda())  # scattered, replicated, gathered on cuda:0
    torch.testing.assert_close(
        out.cpu(), lab02.make_model(0, hidden, depth)(x), rtol=1e-4, atol=1e-5
    )
    loss_fn(out, y.cuda()).backward()
    for p, q in zip(mine.parameters(), theirs.module.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad.cpu(), rtol=1e-4, atol=1e-5)
    print(f"nn.DataParallel on {len(gpus)} GPUs: the same outputs and gradients as yours")
    one = lab02.make_model(0, hidden, depth).cuda()
    for name, m in [("one GPU", one), (f"nn.DataParallel, {len(gpus)} GPUs", theirs)]:
        ms = _median_forward_backward_ms(m, x.cuda(), y.cuda())
        print(f"{name}: median forward + backward {ms:.2f} ms")
