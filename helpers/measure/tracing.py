"""Record every torch.distributed call a rank makes, to see waiting, overlap and deadlock.

    def work():
        with helpers.trace() as tr:
            dist.all_reduce(x); dist.barrier()
        return tr.records
    rows = helpers.trace.collect(helpers.launch(work, world_size=4))   # one table, all ranks
    helpers.plots.timeline(rows)                                        # one row per rank

Times are wall-clock seconds (comparable across the ranks of one machine). A non-blocking call
(async_op=True) is recorded from call to return, not to completion; isend and irecv are not
recorded (batch_isend_irecv and send/recv are).
"""

from __future__ import annotations


class trace:  # noqa: N801 - used as a context manager, like a function
    """Context manager: ``records`` holds one dict per call made inside it on this rank."""

    def __init__(self):
        self.records: list[dict] = []

    def __enter__(self) -> trace:
        from helpers.launcher import watch

        watch.install()
        watch.STATE.listeners.append(self._on_call)
        return self

    def __exit__(self, *exc) -> None:
        from helpers.launcher import watch

        watch.STATE.listeners.remove(self._on_call)

    def _on_call(self, call) -> None:
        from helpers.launcher.world import rank

        self.records.append(
            {
                "rank": rank(),
                "op": call.op,
                "tensors": call.tensors,
                "bytes": call.nbytes,
                "group": call.group,
                "peer": call.peer,
                "seq": call.seq,
                "start": call.start,
                "end": call.end,
            }
        )

    @staticmethod
    def collect(per_rank: list[list[dict]]) -> list[dict]:
        """Merge the ranks' records into one table sorted by start, times relative to the first."""
        rows = [dict(r) for records in per_rank for r in records]
        if not rows:
            return []
        t0 = min(r["start"] for r in rows)
        for r in rows:
            r["start"] -= t0
            r["end"] -= t0
            r["seconds"] = r["end"] - r["start"]
        return sorted(rows, key=lambda r: (r["start"], r["rank"]))
