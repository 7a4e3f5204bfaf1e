"""What DDP sends: a communication hook that records bytes, calls and time per bucket and step.

    recorder = CommRecorder()                     # or CommRecorder(wrap=fp16_compress_hook)
    model = DDP(net); recorder.register(model)
    ... recorder.start_step(); loss.backward() ...
    recorder.records                              # one dict per bucket per step

``grad_bytes`` is the bucket's gradient (what DDP hands the hook); ``sent_bytes`` counts the
tensors the hook actually all-reduced (smaller under fp16/bf16 compression or PowerSGD), seen
through helpers.watch. ``wire_bytes`` is what each rank sends in a ring all-reduce of those,
2(n−1)/n × sent_bytes. Introduced in lab 01.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from helpers.measure.bandwidth import ring_allreduce_wire_bytes


class CommRecorder:
    """A DDP comm hook that measures; ``wrap`` is the hook that really communicates."""

    def __init__(self, wrap=None, state=None):
        self.wrap, self.state = wrap, state
        self.records: list[dict] = []
        self.step = -1
        self._lock = threading.Lock()
        self._counting: list[dict] = []  # the record whose all_reduce calls are being counted

    def register(self, ddp_model) -> CommRecorder:
        """Install on a DistributedDataParallel model (once per model)."""
        from helpers.launcher import watch

        watch.install()
        watch.STATE.listeners.append(self._on_call)
        ddp_model.register_comm_hook(self.state, self._hook)
        return self

    def close(self) -> None:
        """Stop listening to torch.distributed calls."""
        from helpers.launcher import watch

        if self._on_call in watch.STATE.listeners:
            watch.STATE.listeners.remove(self._on_call)

    def start_step(self) -> None:
        """Call before each backward so records are grouped by step."""
        self.step += 1

    def _on_call(self, call) -> None:
        if call.op == "all_reduce" and self._counting:
            rec = self._counting[-1]
            rec["sent_bytes"] += call.nbytes
            rec["calls"] += 1

    def _hook(self, state, bucket):
        buffer = bucket.buffer()
        n = dist.get_world_size(state if state is not None else None)
        rec = {
            "step": self.step,
            "bucket": bucket.index(),
            "grad_bytes": buffer.numel() * buffer.element_size(),
            "sent_bytes": 0,
            "calls": 0,
            "world_size": n,
            "start": time.perf_counter(),
            "end": None,
        }
        hook = self.wrap or default_hooks.allreduce_hook
        with self._lock:
            self._counting.append(rec)
            try:
                fut = hook(state, bucket)
            finally:
                self._counting.pop()
            self.records.append(rec)

        def done(f):
            rec["end"] = time.perf_counter()  # runs when the all-reduce has completed
            return f.value()

        return fut.then(done)

    def per_step(self) -> list[dict]:
        """Totals per step: bytes, calls, buckets, communication seconds (sum over buckets)."""
        steps: dict[int, dict] = {}
        for r in self.records:
            s = steps.setdefault(
                r["step"],
                {
                    "step": r["step"],
                    "buckets": 0,
                    "grad_bytes": 0,
                    "sent_bytes": 0,
                    "calls": 0,
                    "comm_s": 0.0,
                },
            )
            s["buckets"] += 1
            s["grad_bytes"] += r["grad_bytes"]
            s["sent_bytes"] += r["sent_bytes"]
            s["calls"] += r["calls"]
            s["comm_s"] += (r["end"] or r["start"]) - r["start"]
            s["wire_bytes"] = ring_allreduce_wire_bytes(s["sent_bytes"], r["world_size"])
        return [steps[k] for k in sorted(steps)]

    def intervals(self, step: int) -> list[tuple[float, float]]:
        """(start, end) perf_counter times of each bucket's communication in ``step``."""
        return [(r["start"], r["end"]) for r in self.records if r["step"] == step and r["end"]]


def gradient_bytes(model) -> int:
    """Bytes of the trainable parameters' gradients: what DDP must all-reduce each step."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
