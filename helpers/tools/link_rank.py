"""What each rank runs in the interconnect experiment (lecture 07, section 5).

    helpers.launch(link_rank.measure, plan, world_size=2)       # two ranks on one node
    python -m helpers.run helpers.tools.link_rank:measure ...   # one rank on each node

``measure(plan)`` runs the same measurements on any world of 2, so the numbers within one node
and across the link come from one code path: for each link rate of the plan (``None``: the link
as it is) every rank first shapes its own end of the link (``tc`` with a token bucket, ``tbf``:
the rate applies to what a node *sends*, as a NIC's line rate does), then

- all-reduce of float32 buffers of ``sizes`` bytes, ``iters`` back to back per size, the whole
  sweep ``repeats`` times: seconds per all-reduce;
- DDP on lab 01's MLP (512 x 4) at ``batch`` per rank for ``steps`` timed steps (after
  ``warmup``), in three set-ups: buckets of 1 MB, one bucket of 25 MB, and PowerSGD (rank 1) on
  the one bucket: seconds per step.

Once, before the rates: the same steps on the bare model with no DDP, the step time of one
device alone (the baseline of scaling efficiency). Rank 0's clock is what is returned.
"""

from __future__ import annotations

import os
import subprocess
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

# DDP set-ups: bucket size in MB and the gradient compression (PowerSGD's rank, None for none)
SETUPS = {
    "buckets of 1 MB": (1.0, None),
    "one bucket of 25 MB": (25.0, None),
    # one bucket: with several, gloo may get PowerSGD's chained all-reduces (each issued when the
    # one before it finishes) in a different order on each rank, and a rank aborts
    "PowerSGD rank 1, one bucket": (25.0, 1),
}
# the token bucket: a node may send this much at once after an idle spell. At least two jumbo
# frames (tbf needs one), and at fast rates BURST_MS of traffic: tbf sends only while the bucket
# holds tokens and waits for a timer while it refills, and a bucket of two frames at 1 Gbit/s is
# empty again after 147 µs, shorter than a timer that fires late on a busy machine, so the link
# would idle below its rate (tc-tbf(8): the burst must be at least rate/HZ). The burst lowers the
# time of a message longer than it by burst / rate, the intercept of t = α + S/β, and leaves the
# slope 1/β alone: message sizes (``sizes``, from 4 ms on the wire) start at twice BURST_MS
MIN_BURST = 18 * 1024  # bytes (18 KiB): two jumbo frames
BURST_MS = 2.0
QUEUE = "50ms"  # packets wait at most this long in the bucket's queue before being dropped


def burst(rate_mbit: float) -> int:
    """The token bucket's size in bytes at ``rate_mbit``: BURST_MS of traffic, MIN_BURST at least."""
    return max(MIN_BURST, int(rate_mbit * 1e6 / 8 * BURST_MS / 1e3))


def shape_command(dev: str, rate_mbit: float | None) -> list[str]:
    """The ``tc`` command that sets (or, with ``rate_mbit`` None, removes) ``dev``'s rate."""
    if rate_mbit is None:
        return ["tc", "qdisc", "del", "dev", dev, "root"]
    rate = f"{rate_mbit:g}mbit"
    return ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst(rate_mbit)),
            "latency", QUEUE]  # fmt: skip


def shape(dev: str, rate_mbit: float | None) -> None:
    """Set this node's send rate on ``dev`` (None: the link as it is); raise with tc's words."""
    proc = subprocess.run(shape_command(dev, rate_mbit), capture_output=True, text=True)
    if proc.returncode and rate_mbit is not None:  # deleting what is not there is fine
        raise RuntimeError(f"`{' '.join(shape_command(dev, rate_mbit))}`: {proc.stderr.strip()}")


def sizes(rate_mbit: float, wire_ms) -> list[int]:
    """Message sizes (bytes, whole float32s) that take ``wire_ms`` milliseconds at the rate."""
    return [int(rate_mbit * 1e6 / 8 * ms / 1e3) // 4 * 4 for ms in wire_ms]


def allreduce_sweep(sizes, iters: int) -> list[float]:
    """Seconds per all-reduce for each size in ``sizes`` (bytes), ``iters`` timed back to back
    after one untimed (the connection's buffers and the allocator warm)."""
    out = []
    for size in sizes:
        buf = torch.ones(max(1, size // 4))
        dist.all_reduce(buf)
        dist.barrier()  # both ranks start together: the clock measures the link, not a late peer
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        out.append((time.perf_counter() - start) / iters)
    return out


def _model_and_batches(batch: int, count: int):
    from helpers.workloads import data, models

    torch.manual_seed(0)
    x, y = data.load("digits-shifted").tensors
    model = models.mlp(hidden=512, depth=4)
    return model, [
        (x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]) for i in range(count)
    ]


def _timed_steps(model, batches, warmup: int) -> list[float]:
    """Seconds of each step after ``warmup``: forward, backward (DDP's all-reduces), SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    times = []
    for i, (x, y) in enumerate(batches):
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def ddp_steps(setup: str, batch: int, steps: int, warmup: int) -> list[float]:
    """Step times of DDP in ``setup`` (a key of ``SETUPS``) on this world."""
    bucket_mb, rank = SETUPS[setup]
    model, batches = _model_and_batches(batch, warmup + steps)
    ddp = DDP(model, bucket_cap_mb=bucket_mb)
    if rank is not None:
        # PowerSGD starts after 2 plain all-reduces (torch's minimum with error feedback); the
        # warm-up steps cover them, so every timed step is compressed
        state = psgd.PowerSGDState(
            dist.group.WORLD, matrix_approximation_rank=rank, start_powerSGD_iter=2
        )
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    dist.barrier()
    return _timed_steps(ddp, batches, warmup)


def measure(plan: dict) -> dict:
    """The whole plan on this rank (see the module's docstring); rank 0's numbers matter.

    ``plan``: rates (Mbit/s or None), wire_ms (the sizes, as milliseconds on the wire at each
    rate; within one node, at the fastest rate), repeats, iters, batch, steps, warmup, setups
    (the keys of ``SETUPS`` to run; default all), and
    shape: whether each rank shapes its end of the link, the device gloo talks through
    (``GLOO_SOCKET_IFNAME``: each node's end of the pair); within one node nothing is shaped.
    """
    model, batches = _model_and_batches(plan["batch"], plan["warmup"] + plan["steps"])
    out = {"one device": _timed_steps(model, batches, plan["warmup"]), "rates": {}}
    dev = os.environ["GLOO_SOCKET_IFNAME"] if plan.get("shape") else None
    try:
        for rate in plan["rates"]:
            if dev is not None:
                shape(dev, rate)
            dist.barrier()  # both ends shaped before either measures
            nbytes = sizes(rate or plan["fastest"], plan["wire_ms"])
            sweeps = [allreduce_sweep(nbytes, plan["iters"]) for _ in range(plan["repeats"])]
            chosen = plan.get("setups", list(SETUPS))
            ddp = {s: ddp_steps(s, plan["batch"], plan["steps"], plan["warmup"]) for s in chosen}
            out["rates"][rate] = {"sizes": nbytes, "allreduce": sweeps, "ddp": ddp}
    finally:
        if dev is not None:
            shape(dev, None)  # the link as it was, whatever happened
    out["node"] = os.uname().nodename
    return out
