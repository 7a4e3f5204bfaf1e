"""A warm world whose ranks outlive each call: the pool behind ``helpers.interactive``.

``WorldPool`` is a launcher ``Pool`` (same rank server, handshake, ``[rank k]`` printer and
hang diagnosis, output pump) whose ``call`` treats a rank's error (raised, or returned as
``{"error": info}``) as an answer, not an end: the ranks keep their state for the next call. It
raises ``Broken`` only when the ranks are in no known state (one blocked in a collective another
will never join, a death, a timeout, an interrupt a rank in C++ cannot hear); the owner then
replaces them. Introduced in lecture 01.
"""

from __future__ import annotations

import math
import os
import pickle
import signal
import time

from helpers.launcher.errors import RankDied, describe_exit
from helpers.launcher.pool import Pool, Task

FAIL_GRACE = 1.0  # after a rank raised, how long another may sit in a collective before "stuck"
INTERRUPT_GRACE = 3.0  # how long the ranks have to stop after the interrupt is forwarded
RESTARTED = (
    "\nThe world was restarted: {n} fresh ranks, and every rank's variables are gone "
    "(gloo cannot abandon a collective). Run again the cells that set them."
)


class Broken(Exception):
    """Raised by ``WorldPool.call``: ranks are in no known state; carries what to raise."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class WorldPool(Pool):
    """A launcher pool whose calls leave the ranks alive: an error is an answer, not an end."""

    def call(self, payload: bytes, opts: dict, timeout: float, output: str) -> dict:
        """Send one call to every rank; return {rank: result}. Raises Broken when the ranks
        are in no known state (stuck, dead, hung, or deaf to an interrupt)."""
        __tracebackhide__ = True  # IPython shows the rank's traceback, not the machinery's
        task = self._send(payload, opts, output)
        interrupts = []
        # Our own SIGINT handler while we wait: an interrupt must not land inside a half-read
        # message, and it is forwarded to the ranks rather than ending the wait.
        previous = signal.signal(signal.SIGINT, lambda *_: interrupts.append(time.monotonic()))
        sel = self._selector()
        try:
            interrupted = self._watch(sel, task, timeout, interrupts)
        finally:
            sel.close()
            signal.signal(signal.SIGINT, previous)
            task.printer.finish()
        if interrupted:
            raise KeyboardInterrupt(
                "interrupted on every rank; the world kept its variables"
            ) from None
        if any(_failed(m) for m in task.replies.values()):
            raise self._error(task.replies)
        return {r: m[2] for r, m in task.replies.items()}

    def _watch(self, sel, task: Task, timeout: float, interrupts: list) -> bool:
        """Pump until every rank answered the call and ended its output; True if it was
        interrupted (and every rank stopped). Raises Broken as ``call`` says."""
        deadline = time.monotonic() + timeout if math.isfinite(timeout) else math.inf
        failed_at = interrupted_at = None
        while not task.done(self.world_size):
            now = time.monotonic()
            if interrupts and interrupted_at is None:
                interrupted_at = now
                self._forward_interrupt(task.replies)
            if interrupted_at is not None and (
                now - interrupted_at > INTERRUPT_GRACE or len(interrupts) > 1
            ):
                raise Broken(self._deaf(task.replies))
            if now > deadline:
                task.printer.finish()
                raise Broken(self._timeout(timeout, task.replies, task.printer))
            if failed_at is not None and interrupted_at is None and now - failed_at > FAIL_GRACE:
                failed_at = now
                stuck = self._stuck(task.replies)
                if stuck:
                    raise Broken(self._error(task.replies, stuck))
            for rank in self._pump(sel, task, deadline - now):
                kind, tid, data = task.replies[rank][:3]
                if kind == "ok":  # a value returned, maybe {"error": info}: _failed reads it
                    task.replies[rank] = ("ok", tid, _load(data))
            if failed_at is None and any(_failed(m) for m in task.replies.values()):
                failed_at = time.monotonic()
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead:
                self._drain(sel, task)
                raise Broken(self._died(dead[0], task.replies))
        return interrupted_at is not None

    def _snapshots(self, ranks) -> dict:
        """Where each of ``ranks`` is (its diag thread answers even inside C++)."""
        for r in ranks:
            self.diags[r].send("snapshot")
        snaps, end = {}, time.monotonic() + 2.0
        for r in ranks:
            try:
                if self.diags[r].poll(max(0.0, end - time.monotonic())):
                    snaps[r] = self.diags[r].recv()
            except (EOFError, OSError):
                pass
        return snaps

    def _stuck(self, replies) -> dict:
        """The unanswered ranks blocked in a torch.distributed call, after another failed."""
        waiting = [r for r in range(self.world_size) if r not in replies]
        return {r: s for r, s in self._snapshots(waiting).items() if s.get("call")}

    def _forward_interrupt(self, replies) -> None:
        for r, proc in enumerate(self.procs):
            if r not in replies:
                try:
                    os.kill(proc.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass

    def _deaf(self, replies) -> KeyboardInterrupt:
        deaf = [r for r in range(self.world_size) if r not in replies]
        snaps = self._snapshots(deaf)
        where = "; ".join(
            f"rank {r} in {snaps[r]['call']}" if snaps.get(r, {}).get("call") else f"rank {r}"
            for r in deaf
        )
        return KeyboardInterrupt(
            f"interrupted, but {where} did not stop (a rank blocked inside a collective cannot "
            "be interrupted)." + RESTARTED.format(n=self.world_size)
        )

    def _died(self, rank: int, replies) -> RankDied:
        code = self.procs[rank].returncode
        return RankDied(
            f"rank {rank} of {self.world_size} died ({describe_exit(code)}) while running the cell."
            + RESTARTED.format(n=self.world_size),
            rank,
            code,
        )

    def _error(self, replies: dict, stuck: dict | None = None) -> Exception:
        errors = {
            r: ("error", m[1], m[2]["error"] if m[0] == "ok" else m[2])
            for r, m in replies.items()
            if _failed(m)
        }
        err = self._rank_error(errors)
        if stuck:
            where = "; ".join(f"rank {r} in {s['call']}" for r, s in sorted(stuck.items()))
            err.message += (
                f"\n\nMeanwhile {where}, waiting for the rank that raised: it never will."
                + RESTARTED.format(n=self.world_size)
            )
            err.args = (err.message,)
        return err


def _load(data: bytes):
    return pickle.loads(data)


def _failed(msg: tuple) -> bool:
    return msg[0] == "error" or (isinstance(msg[2], dict) and "error" in msg[2])
