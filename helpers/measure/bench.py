"""Collective benchmark: time each op over a sweep of sizes, report algbw and busbw.

``sweep`` runs inside the ranks (it is what ``launch`` ships); ``benchmark_collectives`` runs
it for several world sizes from the notebook. Sizes are S, the nccl-tests buffer size (see
helpers.bandwidth); times are the mean per op over the iterations, averaged over ranks, as
nccl-tests does. ``memcpy_bandwidth`` measures the copy bandwidth of one device the same way:
on one host, no collective can beat memory.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from helpers.measure.bandwidth import algbw, bus_factor

OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_to_all",
    "send_recv",
)
ELEMENT = 4  # float32


def default_sizes(max_bytes: int = 16 * 2**20, min_bytes: int = 2**10, step: int = 4) -> list[int]:
    """1 KiB, 4 KiB, ... up to ``max_bytes`` (powers of ``step``)."""
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= step
    return sizes


def _op_call(op: str, nbytes: int, device):
    """A zero-argument function doing one ``op`` on a buffer of S = ``nbytes`` (float32)."""
    n, r = dist.get_world_size(), dist.get_rank()
    full = max(n, nbytes // ELEMENT // n * n)  # elements of S, divisible by n
    piece = full // n
    if op == "all_reduce":
        x = torch.ones(full, device=device)
        return lambda: dist.all_reduce(x)
    if op == "all_gather":
        out, inp = torch.empty(full, device=device), torch.ones(piece, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, inp)
    if op == "reduce_scatter":
        out, inp = torch.empty(piece, device=device), torch.ones(full, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, inp)
    if op == "all_to_all":
        out, inp = torch.empty(full, device=device), torch.ones(full, device=device)
        return lambda: dist.all_to_all_single(out, inp)
    if op == "broadcast":
        x = torch.ones(full, device=device)
        return lambda: dist.broadcast(x, src=0)
    if op == "reduce":
        x = torch.ones(full, device=device)
        return lambda: dist.reduce(x, dst=0)
    if op == "send_recv":  # every rank sends S to the next and receives S from the previous
        out, inp = torch.empty(full, device=device), torch.ones(full, device=device)

        def shift():
            ops = [
                dist.P2POp(dist.isend, inp, (r + 1) % n),
                dist.P2POp(dist.irecv, out, (r - 1) % n),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return shift
    raise ValueError(f"unknown op {op!r}: choose from {', '.join(OPS)}")


def _time_per_op(call, iters: int, device) -> float:
    """Mean seconds per call on this rank, averaged over ranks (every rank gets the same)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dist.barrier()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    sync()  # a GPU op returns before it is done: the clock must wait for it
    t = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def sweep(
    ops=OPS, sizes=None, target_s: float = 0.05, max_iters: int = 200, budget_s: float = 60.0
) -> list[dict]:
    """Run inside every rank: each op at each size; returns records (the same on every rank).

    Iterations adapt so each point takes about ``target_s``; an op stops growing its size once
    its points have used ``budget_s / len(ops)`` seconds (every rank decides alike, from the
    rank-averaged times, so no rank is left waiting in a collective).
    """
    from helpers.launcher.world import device as this_device
    from helpers.launcher.world import uses_nccl

    # Under "cpu:gloo,cuda:nccl" (auto on a GPU node) measure NCCL, on the rank's GPU.
    device = this_device() if uses_nccl(dist.get_backend()) else _cpu()
    n = dist.get_world_size()
    records = []
    for op in ops:
        spent = 0.0
        for nbytes in sizes or default_sizes():
            call = _op_call(op, nbytes, device)
            first = _time_per_op(call, 1, device)  # also the warm-up
            iters = int(min(max_iters, max(3, target_s / max(first, 1e-9))))
            seconds = _time_per_op(call, iters, device)
            size = max(n, nbytes // ELEMENT // n * n) * ELEMENT
            records.append(
                {
                    "op": op,
                    "world_size": n,
                    "bytes": size,
                    "seconds": seconds,
                    "algbw_GBps": algbw(size, seconds),
                    "busbw_GBps": algbw(size, seconds) * bus_factor(op, n),
                    "iters": iters,
                    "backend": dist.get_backend(),
                }
            )
            spent += seconds * (iters + 1)
            if spent > budget_s / len(ops):
                break
    return records


def _cpu():
    return torch.device("cpu")


def memcpy_bandwidth(sizes=None, device=None, target_s: float = 0.05) -> list[dict]:
    """Copy bandwidth of one device (dst.copy_(src)), reported as S / t in GB/s like algbw."""
    device = torch.device(device or "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    records = []
    for nbytes in sizes or default_sizes():
        src = torch.ones(nbytes // ELEMENT, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        first = time.perf_counter() - start
        iters = int(min(1000, max(3, target_s / max(first, 1e-9))))
        start = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        sync()
        seconds = (time.perf_counter() - start) / iters
        records.append(
            {
                "op": "memcpy",
                "world_size": 1,
                "bytes": nbytes,
                "seconds": seconds,
                "algbw_GBps": algbw(nbytes, seconds),
                "busbw_GBps": algbw(nbytes, seconds),
                "iters": iters,
                "backend": device.type,
            }
        )
    return records


def benchmark_collectives(
    ops=OPS, sizes=None, world_sizes=(2, 4), backend: str = "auto", **kwargs
) -> list[dict]:
    """From the notebook: ``sweep`` at every world size; one record per (op, world size, size)."""
    from helpers.launcher.launch import launch

    records = []
    for n in world_sizes:
        records += launch(
            sweep, ops, sizes, world_size=n, backend=backend, output="none", **kwargs
        )[0]
    return records


def _time_calls(call, calls: int, device) -> list[float]:
    """Seconds of each of ``calls`` single calls, each the slowest rank's (a barrier before each)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(calls):
        dist.barrier()  # everyone starts together: the time is the op's, not the last arrival's
        sync()
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a collective is done when its slowest rank is
    return t.tolist()


def spread_sweep(op: str = "all_reduce", sizes=None, repeats: int = 3, target_s: float = 0.03):
    """Run inside every rank: ``repeats`` rounds over all sizes (interleaved), single calls timed.

    In each round every size gets about ``target_s`` of single calls (at least 15, at most 80);
    a round's figure for a size is the median of its calls. Returns per size the round medians
    and every call's time, so a table can show the median with its min–max and the mean beside.
    """
    import statistics

    from helpers.launcher.world import device as this_device
    from helpers.launcher.world import uses_nccl

    device = this_device() if uses_nccl(dist.get_backend()) else _cpu()
    n = dist.get_world_size()
    sizes = sizes or default_sizes()
    calls_for, rounds = {}, {s: [] for s in sizes}
    every = {s: [] for s in sizes}
    for s in sizes:  # warm-up (excluded), and how many calls fill target_s
        call = _op_call(op, s, device)
        first = statistics.median(_time_calls(call, 2, device))
        calls_for[s] = int(min(80, max(15, target_s / max(first, 1e-9))))
    for _ in range(repeats):
        for s in sizes:  # interleaved: a slow moment of the machine hits every size alike
            times = _time_calls(_op_call(op, s, device), calls_for[s], device)
            rounds[s].append(statistics.median(times))
            every[s] += times
    return [
        {
            "op": op,
            "world_size": n,
            "bytes": max(n, s // ELEMENT // n * n) * ELEMENT,
            "round_medians": rounds[s],
            "call_seconds": every[s],
            "backend": dist.get_backend(),
        }
        for s in sizes
    ]


def benchmark_spread(
    op: str = "all_reduce",
    sizes=None,
    world_sizes=(2, 4),
    repeats: int = 3,
    target_s: float = 0.03,
    backend: str = "auto",
    threads: int | None = None,
) -> list[dict]:
    """From the notebook: time ``op`` at each size and world size with ``repeats`` rounds.

    One record per (world size, size): 'seconds' is the median of every call of every round,
    'min_s' / 'max_s' the range of the round medians (how much a repeat moves it),
    'mean_call_s' the plain mean of every call (outliers and all, what nccl-tests would
    report), algbw / busbw (GB/s) from the median, and 'oversubscribed' when the world needs more
    cores than this machine has (helpers.world.oversubscribed): those ranks take turns on the
    cores, so the point is not a measurement of n devices. Introduced in lecture 01.
    """
    import statistics

    from helpers.launcher.launch import launch
    from helpers.launcher.world import oversubscribed, thread_budget

    out = []
    for n in world_sizes:
        over = oversubscribed(n, thread_budget(n, threads))
        rows = launch(
            spread_sweep,
            op,
            sizes,
            repeats,
            target_s,
            world_size=n,
            backend=backend,
            threads=threads,
            output="none",
        )[0]
        for r in rows:
            med = statistics.median(r["call_seconds"])
            out.append(
                {
                    "op": op,
                    "world_size": n,
                    "bytes": r["bytes"],
                    "seconds": med,
                    "min_s": min(r["round_medians"]),
                    "max_s": max(r["round_medians"]),
                    "mean_call_s": statistics.fmean(r["call_seconds"]),
                    "calls": len(r["call_seconds"]),
                    "repeats": repeats,
                    "algbw_GBps": algbw(r["bytes"], med),
                    "busbw_GBps": algbw(r["bytes"], med) * bus_factor(op, n),
                    "oversubscribed": over,
                    "backend": r["backend"],
                }
            )
    return out


def spread_rows(records: list[dict]) -> list[dict]:
    """``benchmark_spread`` records as table rows: ms for times, GB/s, oversubscribed named."""
    return [
        {
            "n": f"{r['world_size']}" + (" (oversubscribed)" if r.get("oversubscribed") else ""),
            "S (bytes)": r["bytes"],
            "median (ms)": round(r["seconds"] * 1e3, 3),
            "min–max of rounds (ms)": f"{r['min_s'] * 1e3:.3f}–{r['max_s'] * 1e3:.3f}",
            "mean of all calls (ms)": round(r["mean_call_s"] * 1e3, 3),
            "calls": r["calls"],
            "algbw (GB/s)": round(r["algbw_GBps"], 4),
            "busbw (GB/s)": round(r["busbw_GBps"], 4),
        }
        for r in records
    ]
