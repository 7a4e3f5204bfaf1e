"""torch.profiler on a DDP run (lecture 07): a Chrome/Perfetto trace per rank, a summary table, and
the spans of forward, backward, optimizer and every gloo all-reduce on one time axis.

    out = helpers.launch(profiling.profile_ddp, steps=2, trace_dir="build/traces", world_size=2)
    out[0]["table"]     # the ops with the most self CPU time on rank 0
    out[0]["spans"]     # (lane, name, start_s, end_s) for plots.profile_timeline
    out[0]["overlap"]   # the share of all-reduce time that ran while backward was running

The trace files open in https://ui.perfetto.dev or chrome://tracing. The spans come from the
profiler's own events (``prof.events()``), not from parsing the files: on a CPU run the trace
has no GPU kernels, which is what trace-analysis libraries such as Holistic Trace Analysis read.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

BACKWARD = "autograd::engine::evaluate_function: "
LANES = {"DistributedDataParallel.forward": "forward", "Optimizer.step": "optimizer"}


def _lane(name: str) -> str | None:
    if name.startswith("gloo:") or name.startswith("nccl:"):
        return "communication"
    if name.startswith(BACKWARD):
        return "backward"
    for prefix, lane in LANES.items():
        if name.startswith(prefix):
            return lane
    return None


def spans(events) -> list[tuple]:
    """(lane, name, start_s, end_s) of the events worth drawing, from a profiler's events.

    Backward is one span per step, from its first autograd function to its last (they follow
    each other on the main thread); forward, optimizer and each communication call are their own.
    """
    rows, backward = [], []
    for e in events:
        lane = _lane(e.name)
        if lane is None:
            continue
        start, end = e.time_range.start / 1e6, e.time_range.end / 1e6
        if lane == "backward":
            backward.append((start, end))
        else:
            rows.append((lane, e.name, start, end))
    # backward ops between two forwards belong to one step
    forwards = sorted(s for lane, _, s, _ in rows if lane == "forward") + [float("inf")]
    for lo, hi in zip(forwards, forwards[1:], strict=False):
        mine = [(s, e) for s, e in backward if lo <= s < hi]
        if mine:
            rows.append(("backward", "backward", min(s for s, _ in mine), max(e for _, e in mine)))
    # the barrier before profiling can still be finishing on gloo's thread: not part of a step
    rows = [r for r in rows if r[0] != "communication" or r[2] >= forwards[0]]
    t0 = min((r[2] for r in rows), default=0.0)
    return sorted((lane, name, s - t0, e - t0) for lane, name, s, e in rows)


def overlap(rows: list[tuple]) -> float:
    """Share of the communication time that ran while a backward span was running."""
    from helpers.measure.timing import union_length

    comm = [(s, e) for lane, _, s, e in rows if lane == "communication"]
    total = union_length(comm)
    if total == 0:
        return 0.0
    inside = sum(union_length(comm, s, e) for lane, _, s, e in rows if lane == "backward")
    return inside / total


def profile_ddp(
    steps: int = 2,
    warmup: int = 2,
    hidden: int = 512,
    depth: int = 4,
    batch: int = 256,
    bucket_cap_mb: float = 1.0,
    trace_dir: str | None = None,
    top: int = 10,
) -> dict:
    """Train the MLP of lab 01 under DDP on this rank, the last ``steps`` steps profiled."""
    from helpers.workloads import models

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(models.mlp(hidden=hidden, depth=depth), bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 1, 8, 8, generator=gen), torch.randint(10, (batch,), generator=gen)

    def step():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(warmup):  # DDP rebuilds its buckets in step 2, caches warm: not profiled
        step()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    trace = None
    if trace_dir is not None:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        trace = str(Path(trace_dir) / f"trace_rank{rank}.json")
        prof.export_chrome_trace(trace)
    table = [
        {
            "op": a.key,
            "calls": a.count,
            "self CPU ms": a.self_cpu_time_total / 1e3,
            "CPU total ms": a.cpu_time_total / 1e3,
        }
        for a in sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:top]
    ]
    events = prof.events()
    rows = spans(events)
    issued = sum(1 for e in events if e.name == "c10d::allreduce_")  # DDP hands gloo a bucket
    return {
        "rank": rank,
        "table": table,
        "spans": rows,
        "overlap": overlap(rows),
        "allreduces": issued,
        "trace": trace,
    }
