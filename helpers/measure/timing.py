"""Time a training step by phase, and split communication into total and exposed.

    timer = StepTimer(device, comm=recorder)      # recorder: a helpers.comm.CommRecorder
    for x, y in batches:
        timer.start()
        x, y = x.to(device), y.to(device);  timer.mark("data")
        loss = loss_fn(model(x), y);        timer.mark("forward")
        loss.backward();                    timer.mark("backward")
        opt.step(); opt.zero_grad();        timer.mark("optimizer")
        timer.stop()
    timer.records                                  # one dict per step

A phase is the time since the previous mark. On a GPU every mark records a CUDA event and the
step synchronises before reading them (a GPU call returns before its work is done; a clock that
does not wait measures the launch, not the work). Communication: ``comm_s`` is the wall time
during which any bucket was being all-reduced; ``exposed_comm_s`` is the part of it after the
last bucket became ready, when backward had nothing left to compute: the communication that
overlapping could not hide. Always exposed ≤ comm. ``overlap_fraction`` is the part that was
hidden: 1 − exposed / comm. Each record also keeps its phases' host-clock ``spans`` and the
``buckets``' (start, end), for ``plots.overlap``. Introduced in lab 01.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

PHASES = ("data", "forward", "backward", "optimizer")


def union_length(intervals, lo: float = float("-inf"), hi: float = float("inf")) -> float:
    """Length of the union of (start, end) intervals, clipped to [lo, hi]."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


class StepTimer:
    def __init__(self, device=None, comm=None):
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.comm = comm
        # Set by the launcher (or init_rank under torchrun): this rank shares its cores.
        self.oversubscribed = os.environ.get("HELPERS_OVERSUBSCRIBED") == "1"
        self.records: list[dict] = []
        self._marks: list[tuple[str, float, object]] = []

    def _now(self):
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return time.perf_counter(), event

    def start(self) -> None:
        """Begin a step."""
        if self.comm is not None:
            self.comm.start_step()
        self._marks = [("start", *self._now())]

    def mark(self, phase: str) -> None:
        """End ``phase`` now (the time since the previous mark goes to it)."""
        if not self._marks:
            raise RuntimeError(
                "StepTimer.mark() before start(): call timer.start() at the top of the step"
            )
        if self.cuda and phase == "backward" and self.comm is not None:
            torch.cuda.synchronize()  # the host clock of 'backward' must include the all-reduces
        self._marks.append((phase, *self._now()))

    def stop(self) -> dict:
        """End the step; returns (and keeps) its record."""
        if self.cuda:
            torch.cuda.synchronize()
        rec = {"step": len(self.records), "spans": []}
        for (_, t0, e0), (name, t1, e1) in zip(self._marks, self._marks[1:], strict=False):
            seconds = e0.elapsed_time(e1) / 1e3 if self.cuda else t1 - t0
            rec[name] = rec.get(name, 0.0) + seconds
            # Host-clock (start, end) of each phase, on the same clock as the comm intervals,
            # so backward and the buckets' all-reduces can be drawn on one time axis.
            rec["spans"].append((name, t0, t1))
        first, last = self._marks[0], self._marks[-1]
        rec["total"] = first[2].elapsed_time(last[2]) / 1e3 if self.cuda else last[1] - first[1]
        rec["comm_s"] = rec["exposed_comm_s"] = 0.0
        if self.comm is not None:
            intervals = self.comm.intervals(self.comm.step)
            bwd_end = next((t for name, t, _ in self._marks if name == "backward"), last[1])
            rec["buckets"] = sorted(intervals)
            if intervals:
                last_ready = max(s for s, _ in intervals)
                rec["comm_s"] = union_length(intervals)
                rec["exposed_comm_s"] = union_length(intervals, last_ready, bwd_end)
            steps = [s for s in self.comm.per_step() if s["step"] == self.comm.step]
            rec["comm_bytes"] = steps[0]["sent_bytes"] if steps else 0
        rec["compute"] = rec["total"] - rec.get("data", 0.0) - rec["exposed_comm_s"]
        rec["oversubscribed"] = self.oversubscribed
        self.records.append(rec)
        self._marks = []
        return rec


def _numeric(records: list[dict]) -> list[str]:
    return [
        k
        for k, v in records[0].items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    ]


def mean_step(records: list[dict], skip: int = 1) -> dict:
    """Mean of each field over the steps, skipping the first ``skip`` (warm-up) steps."""
    use = records[skip:] or records
    return {k: statistics.fmean(r[k] for r in use if k in r) for k in _numeric(use)}


def median_step(records: list[dict], skip: int = 1) -> dict:
    """Median of each field over the steps after ``skip`` warm-up steps: one slow step (a
    context switch on a shared machine) moves a mean, not a median."""
    use = records[skip:] or records
    return {k: statistics.median(r[k] for r in use if k in r) for k in _numeric(use)}


def overlap_fraction(records: list[dict], skip: int = 1) -> float:
    """Share of communication time hidden behind backward, over the steps after ``skip``."""
    use = records[skip:] or records
    comm = sum(r["comm_s"] for r in use)
    return 1.0 - sum(r["exposed_comm_s"] for r in use) / comm if comm else 0.0


def spread(values) -> dict:
    """{'median', 'min', 'max', 'n'} of repeated measurements: what a table and an error bar show."""
    values = list(values)
    if not values:
        raise ValueError("spread() of no measurements: run the configuration at least once")
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def summarize(per_rank: list[list[dict]], skip: int = 1) -> list[dict]:
    """Across ranks, per field: mean, max, and which rank was slowest (from launch's results)."""
    means = [mean_step(records, skip) for records in per_rank]
    out = []
    for key in means[0]:
        values = [m[key] for m in means]
        slowest = max(range(len(values)), key=values.__getitem__)
        out.append(
            {
                "field": key,
                "mean": statistics.fmean(values),
                "max": values[slowest],
                "slowest_rank": slowest,
            }
        )
    return out
