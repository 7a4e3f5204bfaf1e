"""Run notebooks without Jupyter: each code cell exec'd in order in one `__main__` namespace.

For a GPU node whose Python has torch but no Jupyter stack (scripts/gpu_check.sh): the cells run
as a kernel would run them (functions defined in a cell are pickled by value by the launcher,
as from a notebook), printing what they print; rich displays print as text. Not a substitute for
`course run` (no outputs are saved, no parameters injected: each notebook runs its defaults).

    python scripts/run_plain.py lectures/01_collectives.ipynb solutions/lab01_ddp_scaling.ipynb
    python scripts/run_plain.py --logs OUT --timeout 300 [--workers P] NB...   # side by side

Cell tags:
  raises-exception  the cell must raise (lecture 01's deadlock, shown): its traceback is printed
                    and the run goes on; a cell so tagged that raises nothing fails the notebook,
                    as under nbval (`course check`)
  needs-jupyter     the cell needs a Jupyter kernel (a papermill sweep starts `multigpu-course`),
                    which a node's plain Python lacks: skipped with a note

Side by side (--logs): P workers (default: a worker per CORES_PER_NOTEBOOK cores), each with its
own disjoint slice of this process's cores, each running every P-th notebook in turn, one process
per notebook, its output in LOGS/<notebook>.log; a line per notebook on stdout.

--timeout bounds each notebook (PLAIN_CELL_TIMEOUT, in the environment, each cell): when its
time is nearly up, the cell running prints every thread's stack and the notebook exits (a hang
says where it hung); side by side, it is killed at the limit.
Side by side, what a failed notebook leaves behind (processes it forked, such as Lightning's
ddp_notebook ranks) prints its stacks too, then is killed.

Exit status: the number of notebooks that failed.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.machinery
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import types
from pathlib import Path
from typing import TextIO


def _stub_ipython() -> None:
    """IPython.display for a Python without IPython: display() prints the object's text."""
    import builtins

    if importlib.util.find_spec("IPython") is not None:
        from IPython.display import display

        builtins.display = display  # a kernel's builtin
        return

    class _Text:
        def __init__(self, data="", *args, **kwargs):
            self.data = data

        def __str__(self):
            return str(self.data)

    def display(*objs, **kwargs):
        for obj in objs:
            print(obj)

    mod, sub = types.ModuleType("IPython"), types.ModuleType("IPython.display")
    sub.display, sub.Markdown, sub.HTML, sub.Image, sub.Latex = display, _Text, _Text, _Text, _Text
    mod.display, mod.get_ipython = sub, lambda: None  # matplotlib asks: not interactive
    mod.version_info = (8, 0, 0)
    sys.modules["IPython"], sys.modules["IPython.display"] = mod, sub
    builtins.display = display


class _Widget:
    """ipywidgets for a Python without it: widgets build and show nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Widget()

    def __getattr__(self, name):
        return _Widget()


def _widget_class(name: str):
    if name.startswith("__"):  # __file__, __path__...: what a module without them answers
        raise AttributeError(name)
    return _Widget


def _widgets_stub() -> types.ModuleType:
    mod = types.ModuleType("ipywidgets")
    mod.__getattr__ = _widget_class
    # importlib.util.find_spec("ipywidgets") reads the __spec__ of a module already imported
    # and raises ValueError on None (Lightning asks it at import)
    mod.__spec__ = importlib.machinery.ModuleSpec("ipywidgets", None)
    return mod


def _stub_ipywidgets() -> None:
    if importlib.util.find_spec("ipywidgets") is None:
        sys.modules["ipywidgets"] = _widgets_stub()


CELL_TIMEOUT = float(os.environ.get("PLAIN_CELL_TIMEOUT", "0"))  # s per cell; 0: none
MAGIC = re.compile(r"^\s*[%!]")
RAISES, NEEDS_JUPYTER = "raises-exception", "needs-jupyter"


def _tags(cell: dict) -> list:
    return cell.get("metadata", {}).get("tags", [])


def _run_cell(source: str, name: str, namespace: dict) -> BaseException | None:
    """Exec one cell's code; what it raised, or None."""
    source = "\n".join("pass" if MAGIC.match(line) else line for line in source.splitlines())
    try:
        exec(compile(source, name, "exec"), namespace)
    except BaseException as exc:
        return exc
    return None


def _alarm(deadline: float | None) -> None:
    """Arm the hang alarm for the next cell: every thread's stack, then exit, when the cell
    outlives PLAIN_CELL_TIMEOUT or the notebook's deadline, whichever comes first."""
    limits = [CELL_TIMEOUT] if CELL_TIMEOUT else []
    if deadline is not None:
        limits.append(max(deadline - time.monotonic(), 0.1))
    if limits:
        faulthandler.dump_traceback_later(min(limits), exit=True)


def run(path: str, timeout: float | None = None) -> bool:
    cells = [c for c in json.loads(Path(path).read_text())["cells"] if c["cell_type"] == "code"]
    namespace = {"__name__": "__main__"}
    start, skipped = time.perf_counter(), 0
    deadline = time.monotonic() + timeout if timeout else None
    print(f"=== {path}: {len(cells)} code cells", flush=True)
    for i, cell in enumerate(cells, 1):
        tags = _tags(cell)
        if NEEDS_JUPYTER in tags:
            print(
                f"--- cell {i} skipped: tagged {NEEDS_JUPYTER} (no Jupyter kernel here)", flush=True
            )
            skipped += 1
            continue
        t0 = time.perf_counter()
        _alarm(deadline)
        try:
            error = _run_cell("".join(cell["source"]), f"{path}#cell{i}", namespace)
        finally:
            faulthandler.cancel_dump_traceback_later()
        took = time.perf_counter() - t0
        if RAISES in tags and isinstance(error, Exception):  # raised, as it is meant to
            traceback.print_exception(error, file=sys.stdout)
            print(f"--- cell {i} raised, as tagged {RAISES} ({took:.1f} s)", flush=True)
            continue
        if error is not None or RAISES in tags:
            print(f"--- {path} cell {i} FAILED after {took:.1f} s:", flush=True)
            if error is None:
                print(f"tagged {RAISES} but raised nothing", flush=True)
            else:
                traceback.print_exception(error, file=sys.stdout)
            print(f"=== {path}: FAILED at cell {i}/{len(cells)}", flush=True)
            return False
        print(f"--- cell {i} ok ({took:.1f} s)", flush=True)
    note = f" ({skipped} cell(s) tagged {NEEDS_JUPYTER} skipped)" if skipped else ""
    print(f"=== {path}: ok in {time.perf_counter() - start:.0f} s{note}", flush=True)
    return True


# Side by side. The launcher pins rank k of a world to the k-th core of the affinity it inherits
# (helpers.launcher.world.pinned_cores): notebooks started side by side with the same affinity
# would all pin their rank 0 to the first core, their rank 1 to the second, and leave the rest
# idle (on an H100 node's 16 cores, 16 notebooks' ranks shared 4 of them; four notebooks timed
# out). Each worker gets a slice of its own, so its ranks are pinned apart from every other's.
CORES_PER_NOTEBOOK = 4  # the course's largest world: 4 ranks of 1 thread each, none oversubscribed
STACKS_GRACE = 15.0  # s before the hard kill: room to print the hung cell's stacks and exit


def default_workers(cores: int) -> int:
    return max(1, cores // CORES_PER_NOTEBOOK)


def core_slices(cores: list[int], workers: int) -> list[list[int]]:
    """``workers`` disjoint, contiguous slices of ``cores`` (sorted), as even as they go; at most
    one per core."""
    cores, workers = sorted(cores), max(1, min(workers, len(cores)))
    n = len(cores)
    return [cores[k * n // workers : (k + 1) * n // workers] for k in range(workers)]


def _affinity() -> list[int] | None:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None  # macOS


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):  # nothing left in it
        return False


def _end_group(pgid: int, log: TextIO | None) -> None:
    """Kill what is left of a notebook's process group; first, given its ``log``, have each
    process print every thread's stack there (main() registers SIGUSR1 with faulthandler; forks
    inherit it)."""
    if log is not None and _signal_group(pgid, 0):  # 0: is anyone left?
        print(
            "--- processes of this notebook still running, each one's stacks:", file=log, flush=True
        )
        _signal_group(pgid, signal.SIGUSR1)
        time.sleep(1)  # written from the signal handler: at once
    _signal_group(pgid, signal.SIGKILL)


def run_one(path: str, log: Path, timeout: float, cores: list[int] | None) -> int:
    """``path`` in a process of its own pinned to ``cores``, its output in ``log``; its exit
    status, 124 if killed at ``timeout``."""
    budget = timeout - min(STACKS_GRACE, timeout / 4)  # its own alarm goes off first
    cmd = [sys.executable, __file__, "--timeout", str(budget), path]
    if cores is not None:
        cmd[2:2] = ["--cores", ",".join(map(str, cores))]
    with open(log, "w") as out:
        # its own process group: the kill reaches what it forked or started (Lightning's
        # ddp_notebook processes; the launcher's ranks end by themselves when their notebook goes)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = 124  # as timeout(1) says it
        # what is left (the notebook itself at the limit; after an early exit, what it forked)
        # would take the next notebook's cores; after a failure, where each was is worth a look
        # (a fork waiting on its parent's lock is a hang its parent's stack does not show)
        _end_group(proc.pid, out if rc else None)
        proc.wait()
    text = log.read_text(errors="replace")
    if not re.search(r"^=== .*: (ok|FAILED)", text, re.M):  # it died without saying so
        why = f"killed at the {timeout:.0f} s notebook limit" if rc == 124 else f"exit status {rc}"
        with open(log, "a") as out:
            print(f"=== {path}: FAILED ({why})", file=out)
    return rc


def run_side_by_side(paths: list[str], logs: Path, timeout: float, workers: int = 0) -> int:
    """Every notebook of ``paths`` by ``workers`` workers on disjoint cores (module docstring);
    the number that failed."""
    logs.mkdir(parents=True, exist_ok=True)
    cores = _affinity()
    slices = core_slices(cores, workers or default_workers(len(cores))) if cores else [None]
    failed, lock = [], threading.Lock()

    def worker(k: int) -> None:
        where = f"cores {','.join(map(str, slices[k]))}" if slices[k] else "any core"
        for path in paths[k :: len(slices)]:
            t0 = time.perf_counter()
            rc = run_one(path, logs / f"{Path(path).stem}.log", timeout, slices[k])
            with lock:
                failed.extend([path] if rc else [])
                took = time.perf_counter() - t0
                print(
                    f"{rc} {path} (worker {k + 1}/{len(slices)}, {where}, {took:.0f} s)", flush=True
                )

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(slices))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(failed)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="+")
    parser.add_argument("--timeout", type=float, help="seconds per notebook")
    parser.add_argument("--logs", type=Path, help="run side by side, a log per notebook here")
    parser.add_argument("--workers", type=int, default=0, help="with --logs (default: cores // 4)")
    parser.add_argument("--cores", help="pin this process to these cores first: 0,1,2,3")
    args = parser.parse_args(argv)
    if args.logs:
        if not args.timeout:
            parser.error("--logs needs --timeout: a hung notebook would hold its worker forever")
        return run_side_by_side(args.notebooks, args.logs, args.timeout, args.workers)
    if args.cores:  # before anything starts a thread or a rank: they inherit it
        os.sched_setaffinity(0, [int(c) for c in args.cores.split(",")])
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1`: every thread's stack, here and in forks
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.setdefault("MPLBACKEND", "Agg")
    _stub_ipython()
    _stub_ipywidgets()
    sys.path.insert(0, os.getcwd())
    return sum(not run(p, args.timeout) for p in args.notebooks)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
