"""The verdict: each test's check, run on its probe's plain data, apart from any student code.

``course grade`` starts ``python -m course.grading.verdict`` once per submission
(``Checker``, from course.grading.runner): a fresh interpreter of the grader's own, never the
submission's kernel or a child of it. For each test cell it reads one JSON line
{"pieces": [[code, hidden], ...], "data": what the probe published, "names": what the check
reads} on stdin, rebuilds the probe's values with course.grading.plain (exact built-in types,
tensors from raw bytes), runs the check's pieces in order in a namespace holding only those
values, and answers one JSON line: passed, value (the last expression, a number: partial
credit), error, outputs. Hidden pieces come only from the solution notebook and never reach the
sandbox; what they print is dropped, and their failure reads "a hidden test failed".
Trusts: the check's code (the instructor's, from the solution notebook). Does not trust: the
probe's data (the submission's kernel published it: decoded as plain data, or refused), nor the
check's own behaviour (one that hangs or crashes fails its test, and the next starts anew).
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import ctypes
import io
import json
import linecache
import math
import os
import select
import signal
import subprocess
import sys
import time
import traceback

from course.grading import plain

OUTPUT_LIMIT = 100_000  # characters of a check's own output kept for the feedback


def _output(name: str, text: str) -> dict:
    return {"output_type": "stream", "name": name, "text": text[:OUTPUT_LIMIT]}


def _error(ename: str, evalue: str, tb: list[str]) -> dict:
    return {"output_type": "error", "ename": ename, "evalue": evalue, "traceback": tb}


def seeds_env() -> str:
    from course.grading.seeds import ENV

    return ENV


def out_of_memory(exc: BaseException) -> bool:
    """The checker's memory limit (RLIMIT_DATA) reached: Python's MemoryError, or torch's
    allocator refusing ("can't allocate memory")."""
    return isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
    )


def _failed(exc, hidden: bool, filename: str, outputs: list, out, err) -> dict:
    """The verdict of a check piece that raised: a hidden piece says only that it failed (its
    code, message and output stay with the grader); a released one shows its traceback, cut to
    the check's own frames, and what it printed. A check that ran out of the checker's memory
    on the probe's data says so (data built to blow a check up scores 0, with this reason)."""
    if out_of_memory(exc):
        why = "the check ran out of the checker's memory limit on the data your code gave it"
        failure, outputs = _error("CheckLimit", why, []), []
    elif hidden:
        failure = _error(type(exc).__name__, "a hidden test failed", [])
    else:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
        tb = "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
        tb += "".join(traceback.format_exception_only(exc))
        failure = _error(type(exc).__name__, str(exc)[:2000], [tb[-5000:]])
        outputs = outputs + [
            _output(n, s.getvalue()) for n, s in (("stdout", out), ("stderr", err))
        ]
    return {
        "passed": False,
        "value": None,
        "error": f"{failure['ename']}: {failure['evalue']}",
        "outputs": [o for o in outputs if o.get("text", True)] + [failure],
    }


def run_check(pieces: list, data, label: str = "check", names: list | None = None) -> dict:
    """Run a check's pieces on the probe's published ``data``; the verdict as a dict.

    ``names``: what the check reads (course.grading.cells.exports); anything else sent is
    ignored.
    """
    try:
        namespace = plain.decode_probe(data)
        if names is not None:
            missing = sorted(set(names) - set(namespace))
            if missing:
                raise plain.NotPlain(f"the probe did not assign {', '.join(missing)}")
            namespace = {name: namespace[name] for name in names}
    except plain.NotPlain as exc:
        message = f"the probe's values were refused: {exc}"
        return {
            "passed": False,
            "value": None,
            "error": f"NotPlain: {message}",
            "outputs": [_error("NotPlain", message, [])],
        }
    namespace.update(__name__="__check__", __builtins__=builtins)
    outputs, value = [], None
    for k, (code, hidden) in enumerate(pieces):
        filename = f"<{label}, {'hidden' if hidden else 'part'} {k + 1}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        tree = ast.parse(code, filename)
        last = None
        if k == len(pieces) - 1 and tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                exec(compile(tree, filename, "exec"), namespace)
                if last is not None:
                    value = eval(compile(last, filename, "eval"), namespace)
        except (Exception, SystemExit) as exc:
            return _failed(exc, hidden, filename, outputs, out, err)
        finally:
            linecache.cache.pop(filename, None)
        if not hidden:
            outputs += [_output(n, s.getvalue()) for n, s in (("stdout", out), ("stderr", err))]
    if any(hidden for _, hidden in pieces):
        outputs.append(_output("stdout", "[hidden tests passed]\n"))
    number, wrong = credit(value)
    if wrong:
        return {"passed": False, "value": None, "error": wrong, "outputs": outputs}
    return {
        "passed": True,
        "value": number,
        "error": None,
        "outputs": [o for o in outputs if o.get("text", True)],
    }


def credit(value) -> tuple[float | None, str | None]:
    """(partial credit, None) from a check's last expression, or (None, why it fails).

    A number (int, float, a numpy scalar, a one-element tensor or array) is partial credit; it
    must be finite (NaN would pass every comparison the clamp makes). False fails. Anything
    else, None included, means the check ran to its end: full points."""
    if (
        hasattr(value, "item")
        and getattr(value, "size", None) in (1, ())
        or (hasattr(value, "numel") and callable(value.numel) and value.numel() == 1)
    ):
        value = value.item()
    if isinstance(value, bool):
        return (None, None) if value else (None, "the check ended with False")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            return None, f"the check's partial credit is {value}: not a finite number"
        return float(value), None
    return None, None


def limit(limits: dict) -> None:
    """This process's limits, set before it reads any request: its memory (the data segment,
    what allocations grow: a list or a tensor built from crafted data), file size, CPU seconds
    (SIGXCPU at the soft limit ends it) and cores."""
    import resource

    def lower(which: int, soft: int, hard: int) -> None:
        """Never above what this process already has (raising a hard limit needs root)."""
        _, now = resource.getrlimit(which)
        if now != resource.RLIM_INFINITY:
            soft, hard = min(soft, now), min(hard, now)
        resource.setrlimit(which, (soft, hard))

    if limits.get("memory"):
        lower(resource.RLIMIT_DATA, limits["memory"], limits["memory"])
    if limits.get("file_size"):
        lower(resource.RLIMIT_FSIZE, limits["file_size"], limits["file_size"])
    if limits.get("cpu_seconds"):
        lower(resource.RLIMIT_CPU, limits["cpu_seconds"], limits["cpu_seconds"] + 1)
    if limits.get("cpus"):
        os.sched_setaffinity(0, limits["cpus"])


def main() -> None:
    """Answer check requests from stdin until it closes (``python -m course.grading.verdict
    [LIMITS_JSON]``)."""
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: not even the same uid may ptrace
    limit(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr  # only answers go to the grader
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = run_check(
                request["pieces"], request["data"], request.get("label", "check"), request["names"]
            )
        except Exception as exc:  # a broken check is the author's bug: a failed test, said so
            error = f"check error: {exc!r}"[:500]
            if out_of_memory(exc):  # decoding the probe's data took it past the limit
                error = (
                    "the check ran out of the checker's memory limit on the data your code gave it"
                )
            answer = {"passed": False, "value": None, "error": error}
            answer["outputs"] = [_error(type(exc).__name__, answer["error"], [])]
        answers.write(json.dumps(answer) + "\n")


class Checker:
    """The grader's side: a fresh ``python -m course.grading.verdict`` per submission, started
    lazily."""

    def __init__(
        self,
        cwd: str,
        timeout: float,
        log=None,
        env: dict | None = None,
        limits: dict | None = None,
        deadline: float | None = None,
        sandbox: tuple[list[str], int] | None = None,
    ):
        self.cwd, self.timeout, self.log, self.proc, self.buf = cwd, timeout, log, None, b""
        self.env = {**os.environ, **(env or {})}  # the hidden seed, for checks that draw cases
        # {"memory": bytes, "cpus": [cores], "file_size": bytes}: the checker runs the probe's
        # data, which the submission chose, so it runs under limits as the kernel did
        self.limits = limits or {}
        # time.monotonic() after which no check runs: the submission's budget (or the grace
        # the runner gives the checks of a run that used all of it); every checker started for
        # this submission gets only the CPU seconds left before it
        self.deadline = deadline
        # (bubblewrap's argv, uid): the checker in the file view the kernel had, as the slot's
        # uid (every process of the submission's is gone by then), without a network
        self.sandbox = sandbox

    def _left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.monotonic()

    def _limits(self) -> dict:
        # CPU seconds count every thread: the wall-clock seconds left times the slot's cores
        # (torch uses them all), and 10 s to start bubblewrap, Python and torch
        cores = len(self.limits.get("cpus") or os.sched_getaffinity(0))
        cpu = None if self.deadline is None else math.ceil(max(1, self._left()) * cores) + 10
        return {**self.limits, "cpu_seconds": cpu}

    def _argv(self) -> list[str]:
        # -P: not the job folder on sys.path. The limits as its argument: the checker applies
        # them to itself before it reads any data (a preexec_fn would fork-and-run Python in a
        # threaded grader)
        limits = json.dumps(self._limits())
        if self.sandbox is None:
            return [sys.executable, "-P", "-m", "course.grading.verdict", limits]
        prefix, uid = self.sandbox
        keep = {k: self.env[k] for k in ("PATH", "LANG", seeds_env()) if k in self.env}
        env = [x for k, v in keep.items() for x in ("--setenv", k, v)]
        drop = (
            f"import os, runpy, sys; os.setgroups([]); os.setgid({uid}); os.setuid({uid}); "
            "sys.argv = ['verdict', sys.argv[1]]; "
            "runpy.run_module('course.grading.verdict', run_name='__main__', alter_sys=True)"
        )
        return [*prefix, "--unshare-net", *env, sys.executable, "-P", "-c", drop, limits]

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            self._argv(),
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log or subprocess.DEVNULL,
        )
        self.buf = b""

    def check(self, pieces: list, data, label: str, names: list | None = None) -> dict:
        """The verdict of one test; a check that hangs or crashes fails, and the next starts anew."""
        if self._left() <= 0:
            return self._failed("the checks ran past the submission's time budget")
        if self.proc is None:
            self._start()
        request = {"pieces": pieces, "data": data, "label": label, "names": names}
        request = json.dumps(request) + "\n"
        try:
            self.proc.stdin.write(request.encode())
            self.proc.stdin.flush()
        except OSError:
            return self._failed("the checker stopped")
        deadline = time.monotonic() + min(self.timeout, self._left())
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            ready = select.select([self.proc.stdout], [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                if self._left() <= 0:
                    return self._failed("the checks ran past the submission's time budget")
                return self._failed(f"the check took over {self.timeout:g} s")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
            if not chunk:
                try:
                    code = self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    code = None
                if code in (-signal.SIGXCPU, 128 + signal.SIGXCPU):  # bwrap: 128 + its signal
                    return self._failed("the checks used up the CPU time left in the budget")
                return self._failed("the checker stopped")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def _failed(self, why: str) -> dict:
        self.close()
        return {
            "passed": False,
            "value": None,
            "error": f"CheckError: {why}",
            "outputs": [_error("CheckError", why, [])],
        }

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                with contextlib.suppress(OSError):
                    f.close()
            self.proc = None


if __name__ == "__main__":
    main()
