"""Data parallelism seen from the inside (lecture 02).

- ``ThreadDevices(n)``: n emulated devices for a DataParallel-style step on a CPU. Each device is
  one worker thread of this process with its own torch intra-op budget (1 thread), as DataParallel
  drives each GPU from a thread of one Python process. ``run(phase, fns)`` runs ``fns[i]`` on
  device i and waits for all of them (the GPU analogue: launch on every device, then
  synchronize); ``main(phase)`` times work done by the driving thread, which plays device 0's
  host side; ``copy(t, src, dst)`` is a device-to-device copy (a real copy here, counted in
  bytes when src != dst). Every phase becomes a span: its wall time and the CPU time its thread
  got, so waiting for the GIL or a core shows as wall time without CPU time.
- theory of the bytes each scheme moves per step: ``dp_bytes`` (DataParallel, all through
  device 0), ``hook_bytes`` (what DDP all-reduces under no hook, fp16/bf16, or PowerSGD rank r).
- ``count_broadcasts()``: DDP's own parameter and buffer broadcasts (``dist._broadcast_coalesced``,
  which the collective tracer does not see), counted on a rank.
- ``plot_spans(rows)``: one row per thread or rank, one box per phase, on one time axis.
- ``AsyncRecorder()``: every all_reduce a rank makes, from launch to completion, for DDP written
  by hand (no comm hook to record through); plugs into ``helpers.StepTimer(comm=...)``.

This is machinery, not DataParallel itself: the lecture composes the step from it, phase by
phase, and Lab 02 asks you to write your own.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import torch
import torch.distributed as dist


class ThreadDevices:
    """``n`` emulated devices: one persistent worker thread each, ``threads`` torch threads each."""

    def __init__(self, n: int, threads: int = 1):
        if n < 1:
            raise ValueError(f"n must be at least 1 device, not {n!r}")
        self.n, self.threads = n, threads
        self.spans: list[dict] = []
        self.bytes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._inbox = [queue.Queue() for _ in range(n)]
        self._workers = [
            threading.Thread(target=self._serve, args=(i,), daemon=True, name=f"device {i}")
            for i in range(n)
        ]
        for w in self._workers:
            w.start()

    def _serve(self, i: int) -> None:
        torch.set_num_threads(self.threads)  # this thread's intra-op budget: one core's worth
        while True:
            job = self._inbox[i].get()
            if job is None:
                return
            phase, fn, box, done = job
            try:
                box["value"] = self._timed(f"device {i}", phase, fn)
            except BaseException as exc:  # handed to the caller of run()
                box["error"] = exc
            done.set()

    def _timed(self, row: str, phase: str, fn):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn()
        finally:
            t1, c1 = time.perf_counter(), time.thread_time()
            with self._lock:
                self.spans.append(
                    {"row": row, "phase": phase, "start": t0, "end": t1, "cpu_s": c1 - c0}
                )

    def run(self, phase: str, fns) -> list:
        """``[fns[i]() on device i for i in range(n)]``, in parallel; returns when all are done."""
        fns = list(fns)
        if len(fns) != self.n:
            raise ValueError(f"one function per device: {self.n} devices, {len(fns)} functions")
        jobs = [({}, threading.Event()) for _ in fns]
        for i, (fn, (box, done)) in enumerate(zip(fns, jobs, strict=True)):
            self._inbox[i].put((phase, fn, box, done))
        results = []
        for box, done in jobs:
            done.wait()
            if "error" in box:
                raise box["error"]
            results.append(box["value"])
        return results

    @contextlib.contextmanager
    def main(self, phase: str):
        """Time a phase done by the driving thread (device 0's host side: scatter, gather, ...)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            t1, c1 = time.perf_counter(), time.thread_time()
            with self._lock:
                self.spans.append(
                    {"row": "main", "phase": phase, "start": t0, "end": t1, "cpu_s": c1 - c0}
                )

    def copy(self, tensor, src: int, dst: int, phase: str):
        """``tensor`` copied from device ``src`` to ``dst`` (a real copy; bytes counted if moved)."""
        out = tensor.detach().clone()
        if src != dst:
            with self._lock:
                self.bytes[phase] = (
                    self.bytes.get(phase, 0) + tensor.numel() * tensor.element_size()
                )
        return out

    def reset(self) -> None:
        """Forget spans and byte counts (e.g. after warm-up steps)."""
        with self._lock:
            self.spans, self.bytes = [], {}

    def close(self) -> None:
        """Stop the worker threads."""
        for box in self._inbox:
            box.put(None)
        for w in self._workers:
            w.join()

    def __enter__(self) -> ThreadDevices:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def dp_bytes(param_bytes: int, input_bytes: int, output_bytes: int, n: int) -> dict:
    """Bytes DataParallel moves per step between device 0 and the other n−1 devices, by phase.

    replicate: the parameters (and buffers) to every other device, (n−1)·P; scatter: the
    inputs, (n−1)/n of the batch; gather: the outputs back, (n−1)/n; backward: the gradient of
    the outputs scattered again, (n−1)/n; reduce: every other device's gradients to device 0,
    (n−1)·P. All of it passes through device 0's link. (For equal chunks: the batch divides by n.)
    """
    share = (n - 1) / n
    return {
        "replicate": (n - 1) * param_bytes,
        "scatter": share * input_bytes,
        "gather": share * output_bytes,
        "scatter grad": share * output_bytes,
        "reduce grads": (n - 1) * param_bytes,
    }


def _powersgd_numel(shape, rank: int, min_compression_rate: float = 2.0) -> int:
    """Numbers PowerSGD all-reduces for one gradient of ``shape`` (torch's rule, layer by layer)."""
    import math

    rows = shape[0]
    cols = math.prod(shape) // rows if rows else 0  # the tensor viewed as (shape[0], -1)
    r = min(rows, cols, rank)
    if (rows + cols) * r * min_compression_rate < rows * cols:
        return r * (rows + cols)  # P (rows × r) and Q (cols × r)
    return rows * cols  # not worth compressing: sent as it is


def hook_bytes(model, hook: str = "none", rank: int = 1, min_compression_rate: float = 2.0) -> int:
    """Bytes DDP all-reduces per step (fp32 gradients) under a comm hook, from theory.

    "none": every gradient, 4 bytes a number; "fp16"/"bf16": 2 bytes a number; "powersgd": an
    m×n gradient (anything viewed as (shape[0], −1)) becomes P (m×r) and Q (n×r), r(m+n) numbers
    instead of mn, when that is less than half (torch's min_compression_rate=2); 1-D tensors
    and matrices not worth it go uncompressed. Valid once PowerSGD has started
    (start_powerSGD_iter); before that it all-reduces like "none".
    """
    grads = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in grads)
    if hook == "none":
        return 4 * numel
    if hook in ("fp16", "bf16"):
        return 2 * numel
    if hook == "powersgd":
        return 4 * sum(_powersgd_numel(tuple(p.shape), rank, min_compression_rate) for p in grads)
    raise ValueError(f"hook must be 'none', 'fp16', 'bf16' or 'powersgd', not {hook!r}")


@contextlib.contextmanager
def count_broadcasts():
    """Count DDP's broadcasts on this rank: yields a list that gets {'tensors', 'bytes'} per call.

    DDP sends rank 0's parameters and buffers once, in its constructor, and (broadcast_buffers=
    True, the default) the buffers again before every forward, through the private
    ``dist._broadcast_coalesced``; gradients go through the reducer (or a comm hook) instead.
    """
    calls: list[dict] = []
    original = dist._broadcast_coalesced

    def counted(group, tensors, buffer_size, src=0):
        tensors = list(tensors)
        calls.append(
            {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors)}
        )
        return original(group, tensors, buffer_size, src)

    dist._broadcast_coalesced = counted
    try:
        yield calls
    finally:
        dist._broadcast_coalesced = original


# The same phase has the same colour in every plot (DP's threads and DDP's ranks side by side).
PHASE_COLORS = {
    "forward": "#1f77b4",
    "backward": "#aec7e8",
    "optimizer": "#9467bd",
    "all-reduce (bucket)": "#d62728",
    "scatter": "#ff7f0e",
    "replicate": "#ffbb78",
    "gather": "#2ca02c",
    "loss": "#98df8a",
    "scatter grad": "#8c564b",
    "reduce grads": "#e377c2",
}


def plot_spans(rows: list[dict], ax=None, title: str = "", t0: float | None = None):
    """One row per thread (or rank), one box per phase; x in ms from ``t0`` (default: first start).

    ``rows``: dicts with 'row', 'phase', 'start', 'end' (seconds on one clock), as
    ``ThreadDevices.spans`` or a DDP rank's StepTimer spans and bucket intervals.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.6 + 0.45 * len({r["row"] for r in rows})))
    t0 = min(r["start"] for r in rows) if t0 is None else t0
    names = list(dict.fromkeys(r["row"] for r in rows))
    phases = list(dict.fromkeys(r["phase"] for r in rows))
    others = iter(c for c in plt.cm.tab20.colors if c not in PHASE_COLORS.values())
    colors = {p: PHASE_COLORS.get(p) or next(others) for p in phases}
    for r in rows:
        y = names.index(r["row"])
        ax.broken_barh(
            [(1e3 * (r["start"] - t0), max(1e3 * (r["end"] - r["start"]), 1e-3))],
            (y - 0.4, 0.8),
            facecolors=colors[r["phase"]],
            edgecolor="k",
            linewidth=0.3,
        )
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in phases]
    ax.legend(handles, phases, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return ax


class _WatchedWork:
    """A collective's work handle that notes in its record when ``wait()`` was first called."""

    def __init__(self, work, rec: dict):
        self._work, self._rec = work, rec

    def wait(self, *args, **kwargs):
        self._rec.setdefault("waited", time.perf_counter())
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):  # is_completed, get_future, ...: the real handle's
        return getattr(self._work, name)


class AsyncRecorder:
    """Every ``dist.all_reduce`` this rank makes, with when it was launched and when it finished.

    For data parallelism written by hand (Lab 02), where there is no DDP comm hook to record
    through. While open it wraps ``torch.distributed.all_reduce``: each call gets a record
    {'step', 'bytes', 'async', 'start', 'end'}; an asynchronous call (async_op=True) ends when
    its work completes (a callback on the work's future, run by the backend's thread), a
    blocking one when it returns; the handle it returns also notes when ``wait()`` was first
    called ('waited'). Same interface as ``helpers.CommRecorder`` for
    ``helpers.StepTimer(comm=...)``: ``start_step()``, ``step``, ``intervals(step)``,
    ``per_step()``, ``close()``.
    """

    def __init__(self):
        self.records: list[dict] = []
        self.step = -1
        self._lock = threading.Lock()
        self._dist, self._original = dist, dist.all_reduce
        dist.all_reduce = self._all_reduce

    def _all_reduce(self, tensor, *args, **kwargs):
        asynchronous = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
        rec = {
            "step": self.step,
            "bytes": tensor.numel() * tensor.element_size(),
            "async": asynchronous,
            "start": time.perf_counter(),
            "end": None,
        }
        with self._lock:
            self.records.append(rec)
        work = self._original(tensor, *args, **kwargs)
        if work is None:  # blocking: done when it returns
            rec["end"] = time.perf_counter()
            return work

        def done(fut):
            rec["end"] = time.perf_counter()
            return fut.value()

        work.get_future().then(done)
        return _WatchedWork(work, rec)

    def start_step(self) -> None:
        """Call before each step's forward so records are grouped by step."""
        self.step += 1

    def intervals(self, step: int) -> list[tuple[float, float]]:
        """(launch, completion) perf_counter times of the all-reduces of ``step``."""
        return [(r["start"], r["end"]) for r in self.records if r["step"] == step and r["end"]]

    def per_step(self) -> list[dict]:
        """Totals per step: {'step', 'calls', 'sent_bytes', 'comm_s'}."""
        steps: dict[int, dict] = {}
        for r in self.records:
            s = steps.setdefault(
                r["step"], {"step": r["step"], "calls": 0, "sent_bytes": 0, "comm_s": 0.0}
            )
            s["calls"] += 1
            s["sent_bytes"] += r["bytes"]
            s["comm_s"] += (r["end"] or r["start"]) - r["start"]
        return [steps[k] for k in sorted(steps)]

    def close(self) -> None:
        """Put ``dist.all_reduce`` back (records stay)."""
        if self._dist.all_reduce == self._all_reduce:
            self._dist.all_reduce = self._original

    def __enter__(self) -> AsyncRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
