"""A warm world of N ranks and the one run of a task on it (``launch`` keeps up to three).

``Pool`` asks the rank server for N rank processes, hands them the process group's address,
then for each task: sends the pickled call to every rank, streams each rank's output into the
cell (``Printer``: live, rank 0 only, grouped or none) and waits for the N replies, the first
failure (with the others' reports), a death, the timeout or an interrupt. What it raises says
which rank and why; the caller retires a pool whose ranks are in no known state.
"""

from __future__ import annotations

import math
import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection

from helpers.launcher import _rankserver, diagnose
from helpers.launcher._worker import end_marker
from helpers.launcher.errors import (
    LaunchError,
    LaunchTimeout,
    RankDied,
    describe_exit,
    format_frames,
    rank_error,
)

START_TIMEOUT = float(os.environ.get("HELPERS_START_TIMEOUT", "300"))
FAIL_GRACE = 0.5  # after the first failure, how long the others may still report theirs
WAIT_NOTICE_S = 10  # a launch whose timeout is at least twice this says "still waiting" halfway


class Lines:
    """Assemble each rank's byte stream into whole lines; spot the end-of-task marker."""

    def __init__(self):
        self.buf: dict = {}

    def feed(self, key, data: bytes, marker: bytes | None):
        """Return (complete lines, whether the marker was seen)."""
        buf = self.buf.setdefault(key, bytearray())
        buf += data
        seen = False
        if marker is not None and marker in buf:
            i = buf.index(marker)
            head, tail = bytes(buf[:i]), bytes(buf[i + len(marker) :])
            lines = head.splitlines()
            buf[:] = tail
            seen = True
        else:
            *lines, rest = bytes(buf).split(b"\n")
            buf[:] = rest
        return [line.decode("utf-8", "replace").rstrip("\r") for line in lines], seen

    def rest(self, key) -> list[str]:
        buf = self.buf.pop(key, b"")
        return [line.decode("utf-8", "replace") for line in bytes(buf).splitlines()]


class Printer:
    """Where rank lines go: live with a prefix, rank 0 only, grouped after the run, or nowhere."""

    def __init__(self, mode: str):
        self.mode, self.held = mode, []
        self.tail: dict = {}  # rank -> last stderr lines, for death reports

    def lines(self, rank: int, stream: str, lines: list[str]) -> None:
        if stream == "stderr":
            self.tail[rank] = (self.tail.get(rank, []) + lines)[-30:]
        if self.mode == "none" or (self.mode == "rank0" and rank != 0) or not lines:
            return
        if self.mode == "grouped":
            self.held.extend((rank, stream, line) for line in lines)
            return
        out = sys.stdout if stream == "stdout" else sys.stderr
        out.write("".join(f"[rank {rank}] {line}\n" for line in lines))
        out.flush()

    def finish(self) -> None:
        """Grouped mode: rank 0's lines, then rank 1's, ... (each rank's own order kept)."""
        for stream, out in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            text = "".join(
                f"[rank {r}] {line}\n"
                for r, s, line in sorted(self.held, key=lambda x: x[0])
                if s == stream
            )
            if text:
                out.write(text)
                out.flush()
        self.held = []


class Task:
    """One task in flight on the ranks: their replies, their output lines and end markers."""

    def __init__(self, task_id: int, output: str):
        self.task_id, self.marker = task_id, end_marker(task_id)
        self.printer, self.lines = Printer(output), Lines()
        self.replies: dict[int, tuple] = {}
        self.ended: set = set()  # (rank, stream) whose end marker arrived

    def done(self, world_size: int) -> bool:
        return len(self.replies) == world_size and len(self.ended) == 2 * world_size

    def read(self, sel, key) -> None:
        """Print what one rank's stdout or stderr (``key`` of ``sel``) holds now, and note this
        task's end marker on it; at the stream's end, stop watching it."""
        kind, rank = key.data
        data = os.read(key.fd, 65536)
        if not data:
            sel.unregister(key.fd)
            return
        got, seen = self.lines.feed((rank, kind), data, self.marker)
        self.printer.lines(rank, kind, got)
        if seen:
            self.ended.add((rank, kind))


class Pool:
    """N warm ranks sharing one process group, owned by the process that started them."""

    def __init__(self, world_size: int, backend: str, threads: int, server: _rankserver.Server):
        self.key = (world_size, backend, threads)
        self.world_size, self.backend, self.threads = world_size, backend, threads
        self.server = server
        self.owner = os.getpid()
        self.procs: list[_rankserver.RankProcess] = []
        self.tasks: list[Connection] = []
        self.diags: list[Connection] = []
        self.task_id = 0
        self.dirty = False

    # -- life cycle -------------------------------------------------------------------------

    def _spawn(self, rank: int) -> None:
        task_parent, task_child = socket.socketpair()
        diag_parent, diag_child = socket.socketpair()
        cfg = {
            "rank": rank,
            "world_size": self.world_size,
            "backend": self.backend,
            "threads": self.threads,
            "task_fd": task_child.fileno(),
            "diag_fd": diag_child.fileno(),
            "start_timeout": START_TIMEOUT,
        }
        env = dict(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.world_size),
            HELPERS_LAUNCH_RANK=str(rank),
            OMP_NUM_THREADS=str(self.threads),
            MKL_NUM_THREADS=str(self.threads),
        )
        try:
            proc = self.server.spawn(cfg, env)
        finally:
            task_child.close()
            diag_child.close()
        self.procs.append(proc)
        self.tasks.append(Connection(task_parent.detach()))
        self.diags.append(Connection(diag_parent.detach()))

    def start(self) -> None:
        """Start the ranks and wait until all joined the process group."""
        try:
            for rank in range(self.world_size):
                self._spawn(rank)
            self._handshake()
        except BaseException:
            self.kill()
            raise

    def _handshake(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        ready: dict[int, dict] = {}
        log: dict[int, list[str]] = {}
        lines = Lines()
        sel = self._selector()
        try:
            while len(ready) < self.world_size:
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"the {self.world_size} ranks did not start within {START_TIMEOUT:g} s "
                        "(set HELPERS_START_TIMEOUT to wait longer on a slow machine)"
                    )
                for key, _ in sel.select(0.1):
                    kind, rank = key.data
                    if kind == "task":
                        msg = self._recv(rank)
                        if msg is None:
                            continue
                        if msg[0] == "port":
                            for conn in self.tasks[1:]:
                                conn.send(("port", msg[1]))
                        elif msg[0] == "ready":
                            ready[rank] = msg[1]
                        elif msg[0] == "setup_error":
                            err = msg[1]
                            raise LaunchError(
                                f"could not start {self.world_size} ranks "
                                f"(backend={self.backend!r}): {err['message']}"
                            )
                    elif kind in ("stdout", "stderr"):
                        data = os.read(key.fd, 65536)
                        if data:
                            got, _ = lines.feed((rank, kind), data, None)
                            log.setdefault(rank, []).extend(got)
                        else:
                            sel.unregister(key.fd)
                for rank, proc in enumerate(self.procs):
                    if proc.poll() is not None and rank not in ready:
                        time.sleep(0.2)
                        tail = "\n".join(log.get(rank, [])[-20:] + lines.rest((rank, "stderr")))
                        raise LaunchError(
                            f"rank {rank} exited while starting ({describe_exit(proc.returncode)})"
                            + (f"; its last output:\n{tail}" if tail else "")
                        )
        finally:
            sel.close()

    def alive(self) -> bool:
        return len(self.procs) == self.world_size and all(p.poll() is None for p in self.procs)

    def kill(self) -> None:
        """SIGKILL every rank's process group (ranks stuck in C++ included), reap, close fds."""
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            for f in (proc.stdout, proc.stderr):
                if f:
                    f.close()
        for conn in self.tasks + self.diags:
            conn.close()
        self.procs, self.tasks, self.diags = [], [], []

    # -- one launch -------------------------------------------------------------------------

    def _selector(self) -> selectors.BaseSelector:
        sel = selectors.DefaultSelector()
        for rank, (proc, conn) in enumerate(zip(self.procs, self.tasks, strict=True)):
            sel.register(conn.fileno(), selectors.EVENT_READ, ("task", rank))
            sel.register(proc.stdout.fileno(), selectors.EVENT_READ, ("stdout", rank))
            sel.register(proc.stderr.fileno(), selectors.EVENT_READ, ("stderr", rank))
        return sel

    def _recv(self, rank: int):
        try:
            return self.tasks[rank].recv()
        except (EOFError, OSError):
            return None

    def run(self, payload: bytes, opts: dict, timeout: float, output: str) -> list:
        """Run one task on every rank; return each rank's result, in rank order. Raises what
        the first failure says: a rank's error, a death, or the timeout's diagnosis."""
        task = self._send(payload, opts, output)
        sel = self._selector()
        try:
            failed = self._wait(sel, task, timeout)
            dead = self._lost(task)
            if dead or failed:
                self._drain(sel, task)
        finally:
            sel.close()
        task.printer.finish()
        if dead:
            raise self._rank_died(dead[0], task, output)
        errors = {r: m for r, m in task.replies.items() if m[0] == "error"}
        if errors:
            raise self._rank_error(errors)
        self.dirty = any(m[-1] for m in task.replies.values())
        return [pickle.loads(task.replies[r][2]) for r in range(self.world_size)]

    def _send(self, payload: bytes, opts: dict, output: str) -> Task:
        """Hand the next task to every rank; its state, to be pumped until every rank ends it."""
        self.task_id += 1
        for conn in self.tasks:
            conn.send(("task", self.task_id, payload, opts))
        return Task(self.task_id, output)

    def _pump(self, sel, task: Task, wait: float) -> list[int]:
        """Wait up to ``wait`` s (0.1 at most) for the ranks: print the lines that arrived, keep
        the replies to ``task`` (never a stale one). Returns the ranks whose reply arrived."""
        arrived = []
        for key, _ in sel.select(min(0.1, max(0.0, wait))):
            kind, rank = key.data
            if kind == "task":
                msg = self._recv(rank)
                if msg is None:
                    sel.unregister(key.fd)
                elif msg[1] == task.task_id:
                    task.replies[rank] = msg
                    arrived.append(rank)
            else:
                task.read(sel, key)
        return arrived

    def _lost(self, task: Task) -> list[int]:
        """The ranks that exited without answering ``task``."""
        procs = enumerate(self.procs)
        return [r for r, p in procs if r not in task.replies and p.poll() is not None]

    def _wait(self, sel, task: Task, timeout: float) -> bool:
        """Pump until every rank answered and ended its output, or until FAIL_GRACE after the
        first failure (an error or a death: True then). Raises the diagnosis at ``timeout``."""
        start = time.monotonic()
        deadline = start + timeout if math.isfinite(timeout) else math.inf
        # Halfway to the timeout, say so once: a student waiting on a silent cell learns that
        # the ranks may be stuck, and that the diagnosis comes at the deadline.
        notice = start + timeout / 2 if timeout >= 2 * WAIT_NOTICE_S else math.inf
        first_failure = None
        while not task.done(self.world_size):
            now = time.monotonic()
            if now > notice:
                notice = math.inf
                self._still_waiting(task, now - start, timeout)
            if first_failure is not None and now - first_failure > FAIL_GRACE:
                break
            if now > deadline:
                task.printer.finish()
                raise self._timeout(timeout, task.replies, task.printer)
            arrived = self._pump(sel, task, deadline - now)
            errors = any(task.replies[r][0] == "error" for r in arrived)
            if first_failure is None and (errors or self._lost(task)):
                first_failure = time.monotonic()
        return first_failure is not None

    def _still_waiting(self, task: Task, waited: float, timeout: float) -> None:
        waiting = [r for r in range(self.world_size) if r not in task.replies]
        print(
            f"[launch] still waiting for rank{'s' if len(waiting) > 1 else ''} "
            f"{', '.join(map(str, waiting))} after {waited:.0f} s of the "
            f"{timeout:g} s timeout; if they are stuck, the launcher says where "
            "each one waits when it ends",
            file=sys.stderr,
            flush=True,
        )

    def _rank_died(self, rank: int, task: Task, output: str) -> RankDied:
        """A rank that died without answering: how, who raised after it, its last stderr lines
        (when the cell did not show them already)."""
        shown = output in ("live", "grouped") or (output == "rank0" and rank == 0)
        tail = "" if shown else "\n".join(task.printer.tail.get(rank, [])[-20:])
        others = [r for r, m in task.replies.items() if m[0] == "error"]
        code = self.procs[rank].returncode
        return RankDied(
            f"rank {rank} of {self.world_size} died ({describe_exit(code)})"
            " without returning or raising"
            + (f"; {diagnose._ranks(others)} then raised (likely because of it)" if others else "")
            + ". All ranks were stopped."
            + (f"\nIts last stderr lines:\n{tail}" if tail else ""),
            rank,
            code,
        )

    def _drain(self, sel, task: Task) -> None:
        """Read what the ranks already wrote (a dying rank's last words) without waiting long."""
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            events = sel.select(0.05)
            if not events:
                break
            for key, _ in events:
                if key.data[0] != "task":  # the replies: _pump's, and no longer wanted here
                    task.read(sel, key)
        for rank, kind in list(task.lines.buf):
            task.printer.lines(rank, kind, task.lines.rest((rank, kind)))

    def _rank_error(self, errors: dict) -> Exception:
        import cloudpickle

        # The first rank to fail by rank order among those with the same message is the
        # representative; the others are listed as "raised the same error".
        rank = min(errors)
        err = errors[rank][2]
        same = [
            r
            for r, m in errors.items()
            if r != rank and (m[2]["type"], m[2]["message"]) == (err["type"], err["message"])
        ]
        try:
            cls = cloudpickle.loads(err["cls"]) if err["cls"] else None
        except Exception:
            cls = None
        tb = format_frames(err["frames"]) + f"{err['type']}: {err['message']}"
        if err["chained"]:
            tb = err["chained"] + "\nThe above exception was the direct cause of:\n\n" + tb
        different = sorted(set(errors) - {rank} - set(same))
        if different:
            tb += "".join(
                f"\n\nrank {r} raised {errors[r][2]['type']}: {errors[r][2]['message']}"
                for r in different
            )
        return rank_error(rank, self.world_size, cls, err["type"], err["message"], tb, same)

    def _timeout(self, timeout: float, replies: dict, printer: Printer) -> LaunchTimeout:
        """Ask every unfinished rank where it is, explain, and build the exception."""
        infos = {r: {"finished": r in replies} for r in range(self.world_size)}
        asked = list(range(self.world_size))  # finished ranks too: their last call tells
        for r in asked:
            try:
                self.diags[r].send("snapshot")
            except OSError:
                pass
        end = time.monotonic() + 2.0
        for r in asked:
            try:
                if self.diags[r].poll(max(0.0, end - time.monotonic())):
                    infos[r]["snapshot"] = self.diags[r].recv()
            except (EOFError, OSError):
                pass
        for r in asked:
            if "snapshot" not in infos[r] and r not in replies and self.procs[r].poll() is None:
                os.kill(self.procs[r].pid, signal.SIGUSR1)  # faulthandler dumps its stacks
                time.sleep(0.3)
                infos[r]["dump"] = "\n".join(printer.tail.get(r, [])[-30:])
        return LaunchTimeout(diagnose.explain(infos, timeout, self.world_size), infos)
