"""An interactive world: notebook cells that run on every rank and keep their state (lecture 01).

``%load_ext helpers.interactive`` (or ``helpers.interactive.start(4)``, which also loads it):

    %ranks start 4 [--backend gloo] [--threads 1] [--timeout 60]   start, or resize to, 4 ranks
    %ranks reset | stop | status
    %%ranks [0,2 | 1-3] [--timeout S] [--output live|grouped|rank0|none]

A ``%%ranks`` cell runs on every rank (or the ranks listed), each in its own namespace kept
across cells, which starts with ``torch``, ``dist``, ``helpers``, ``rank`` and ``world_size``.
Output streams live as ``[rank k]``; the cell's last expression is shown per rank, side by side.
``pull(name)`` brings a name back from every rank; ``push(name, value)`` sends a value to all.

The world is a ``launcher.cellpool.WorldPool``: the launcher's rank server, handshake,
``[rank k]`` printer and hang diagnosis, whose task is one cell. Its machinery is in the
launcher; this module is the notebook's face of it (and the rank's side of a cell). What
survives what:
  - an error: the ranks all answered, so the world and every rank's variables are kept;
  - an interrupt: forwarded to every rank as KeyboardInterrupt; kept if every rank stops;
  - a rank blocked in C++ (a collective another rank will never join, after an error, a hang
    or an interrupt): gloo cannot abandon a collective, so the ranks are replaced by a fresh
    world of the same size, and the message says so (their variables are gone).
"""

from __future__ import annotations

import ast
import builtins
import itertools
import linecache
import os
import pickle
import shlex
import signal
import sys
import time

import torch
import torch.distributed as dist

import helpers
from helpers.launcher import _pickling, launch
from helpers.launcher._worker import dumps_result, error_info
from helpers.launcher.cellpool import RESTARTED, Broken, WorldPool
from helpers.launcher.errors import LaunchError, LaunchTimeout, describe_exit
from helpers.launcher.world import (
    BACKENDS,
    choose_backend,
    cpu_count,
    oversubscribed,
    thread_budget,
)

HERE = os.path.abspath(__file__)


class WorldError(LaunchError):
    """A world could not run a cell, pull or push (no world, or its ranks are gone)."""


# -- on a rank ---------------------------------------------------------------------------------

_namespace: dict | None = None  # this rank's variables, kept between cells (rank process only)


def _ns() -> dict:
    global _namespace
    if _namespace is None:
        _namespace = {
            "__name__": "__main__",
            "__builtins__": builtins,
            "torch": torch,
            "dist": dist,
            "helpers": helpers,
            "rank": dist.get_rank(),
            "world_size": dist.get_world_size(),
        }
    return _namespace


def _error(exc: BaseException) -> dict:
    """The launcher's error report, without this module's frames."""
    info = error_info(exc)
    info["frames"] = [f for f in info["frames"] if f[0] != HERE]
    return {"error": info}


def _run_cell(source: str, filename: str, ranks: list[int] | None):
    """Run a cell in this rank's namespace; return its last value's text, None, or an error.

    Trusts the kernel: ``source`` parsed there already. A rank outside ``ranks`` returns at once.
    """
    if ranks is not None and dist.get_rank() not in ranks:
        return None
    lines = source.splitlines(True)
    linecache.cache[filename] = (len(source), None, lines, filename)  # for tracebacks
    ns = _ns()
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    # the launcher's ranks ignore SIGINT; a cell is interruptible while it runs
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        exec(compile(tree, filename, "exec"), ns)
        if last is None:
            return None
        value = eval(compile(ast.Expression(last.value), filename, "eval"), ns)
    except BaseException as exc:  # KeyboardInterrupt too: the rank answers and lives on
        return _error(exc)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if value is None:
        return None
    ns["_"] = value
    return {"repr": repr(value), "tensor": isinstance(value, torch.Tensor)}


def _pull(name: str):
    """This rank's ``name``, pickled here (so a value that cannot travel is named, not lost)."""
    ns = _ns()
    if name not in ns:
        return ("missing",)
    try:
        return ("value", dumps_result(ns[name]))
    except Exception as exc:
        return ("unsendable", type(ns[name]).__name__, str(exc))


def _push(name: str, value, ranks: list[int] | None) -> None:
    if ranks is None or dist.get_rank() in ranks:
        _ns()[name] = value


# -- in the kernel -----------------------------------------------------------------------------


class World:
    """N ranks that keep their variables between calls; owned by the kernel that started it."""

    def __init__(self, size: int, backend: str, threads: int, timeout: float):
        self.size, self.backend, self.threads, self.timeout = size, backend, threads, timeout
        self.pool: WorldPool | None = None
        self.cells = itertools.count(1)

    def start(self) -> None:
        with launch._lock:
            server = launch._rank_server()  # the launcher's: torch is imported once per kernel
            self.pool = WorldPool(self.size, self.backend, self.threads, server)
            self.pool.start()

    def stop(self) -> None:
        if self.pool is not None and self.pool.owner == os.getpid():
            self.pool.kill()
        self.pool = None

    def alive(self) -> bool:
        return self.pool is not None and self.pool.alive()

    def describe(self) -> str:
        over = oversubscribed(self.size, self.threads)
        backend = choose_backend(self.backend, self.size)
        return (
            f"{self.size} rank{'s' if self.size > 1 else ''} (backend {backend}, "
            f"{self.threads} thread{'s' if self.threads > 1 else ''} each) on {cpu_count()} "
            f"device{'s' if cpu_count() != 1 else ''}"
            + (": OVERSUBSCRIBED, the ranks take turns on the cores (no scaling)" if over else "")
        )

    def call(self, fn, args: tuple, timeout: float | None, output: str | None) -> dict:
        """Run ``fn(*args)`` on every rank; {rank: result}. Restarts the world if it broke."""
        __tracebackhide__ = True  # IPython shows the rank's traceback, not the machinery's
        if not self.alive():
            gone = [
                f"rank {r} ({describe_exit(p.returncode)})"
                for r, p in enumerate(self.pool.procs if self.pool else [])
                if p.poll() is not None
            ]
            raise WorldError(
                "the world's ranks are gone"
                + (f": {', '.join(gone)} ended" if gone else "")
                + " (helpers.shutdown(), or a launch after the kernel's environment changed, "
                "stops them). `%ranks reset` starts a fresh world of the same size."
            )
        timeout = self.timeout if timeout is None else timeout
        if not timeout > 0:
            raise WorldError(f"a cell's timeout is a positive number of seconds, not {timeout!r}")
        timeout = min(timeout, launch.TIMEOUT_CAP)
        output = output or os.environ.get("HELPERS_LAUNCH_OUTPUT", "live")
        if output not in launch.OUTPUTS:
            raise WorldError(f"output is one of {', '.join(launch.OUTPUTS)}, not {output!r}")
        opts = {"cwd": os.getcwd(), "sys_path": [os.path.abspath(p) for p in sys.path]}
        opts["argv"] = list(sys.argv)
        try:
            return self.pool.call(_pickling.dumps((fn, args, {})), opts, timeout, output)
        except Broken as broken:
            self.stop()
            self.start()
            error = broken.error
            if isinstance(error, LaunchTimeout):
                text = str(error).replace("launch did not finish", "the cell did not finish", 1)
                error = LaunchTimeout(text + RESTARTED.format(n=self.size), error.diagnosis)
            raise _shown_plain(error) from None
        except (LaunchError, KeyboardInterrupt) as error:
            raise _shown_plain(error) from None


def _shown_plain(error: BaseException) -> BaseException:
    """IPython shows this error as its message alone (the rank's traceback is in it): the
    kernel's frames of this module would only push it down (IPython always shows the last)."""
    error._render_traceback_ = lambda: [f"{type(error).__name__}: {error}"]
    return error


_world: World | None = None


def _require_world() -> World:
    if _world is None:
        raise WorldError(
            "there is no world yet: start one first with `%ranks start 4` "
            "(or helpers.interactive.start(4))."
        )
    return _world


def start(world_size: int = 2, backend: str = "auto", threads=None, timeout=None) -> World:
    """Start a world of ``world_size`` ranks (stopping any earlier one); load the magics.

    ``timeout``: seconds a cell may run before its hang is diagnosed (default
    $HELPERS_LAUNCH_TIMEOUT or 300). Returns the world.
    """
    global _world
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, not {world_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    timeout = launch.DEFAULT_TIMEOUT if timeout is None else float(timeout)
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
    _load_magics()
    previous = stop()
    world = World(world_size, backend, thread_budget(world_size, threads), timeout)
    began = time.perf_counter()
    world.start()
    _world = world
    note = f" (the world of {previous} was stopped; its variables are gone)" if previous else ""
    print(f"world: {world.describe()}, ready in {time.perf_counter() - began:.2f} s{note}")
    return world


def stop() -> int | None:
    """Stop the world, if any; return the number of ranks it had."""
    global _world
    if _world is None:
        return None
    world, _world = _world, None
    world.stop()
    return world.size


def reset() -> World:
    """A fresh world of the same size and settings: every rank's variables are gone."""
    w = _require_world()
    return start(w.size, w.backend, w.threads, w.timeout)


def run_cell(source: str, ranks=None, timeout=None, output=None):
    """Run ``source`` on every rank (or ``ranks``); the ``%%ranks`` cell, as a function.

    Returns a ``PerRank`` of the last expression's text on each rank that has one, or None.
    """
    __tracebackhide__ = True  # IPython shows the rank's traceback, not the machinery's
    world = _require_world()
    ranks = None if ranks is None else _check_ranks(ranks, world.size)
    filename = f"<ranks cell {next(world.cells)}>"
    ast.parse(source, filename)  # a syntax error is the kernel's to show, before any rank runs
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    got = world.call(_run_cell, (source, filename, ranks), timeout, output)
    shown = {r: v for r, v in sorted(got.items()) if v is not None}
    return PerRank(shown) if shown else None


def pull(name: str, ranks=None) -> list:
    """``name`` from every rank (or ``ranks``), in rank order."""
    __tracebackhide__ = True  # IPython shows the rank's traceback, not the machinery's
    world = _require_world()
    _check_name(name)
    ranks = list(range(world.size)) if ranks is None else _check_ranks(ranks, world.size)
    got = world.call(_pull, (name,), None, "live")
    missing = [r for r in ranks if got[r][0] == "missing"]
    if missing:
        have = [r for r in range(world.size) if got[r][0] != "missing"]
        raise NameError(
            f"name {name!r} is not defined on {_ranks(missing)}"
            + (f" (it is on {_ranks(have)})" if have else "")
            + f": set it in a %%ranks cell first, or push it with push({name!r}, value)."
        )
    bad = [r for r in ranks if got[r][0] == "unsendable"]
    if bad:
        _, kind, why = got[bad[0]]
        raise TypeError(
            f"{name!r} on {_ranks(bad)} is a {kind}, which cannot be sent to the notebook: {why}."
            " Pull plain data (numbers, lists, dicts, tensors, arrays)."
        )
    return [pickle.loads(got[r][1]) for r in ranks]


def push(name: str, value, ranks=None) -> None:
    """Set ``name`` to ``value`` on every rank (or ``ranks``): each rank gets its own copy."""
    __tracebackhide__ = True  # IPython shows the rank's traceback, not the machinery's
    world = _require_world()
    _check_name(name)
    ranks = None if ranks is None else _check_ranks(ranks, world.size)
    try:
        _pickling.dumps(value)
    except Exception as exc:
        raise TypeError(
            f"the value for {name!r} ({type(value).__name__}) cannot be sent to the ranks: {exc}."
            " Ranks are separate processes: push data that pickles (numbers, lists, dicts, "
            "tensors), and create the rest (open files, locks, generators) in a %%ranks cell."
        ) from None
    world.call(_push, (name, value, ranks), None, "live")


def _check_name(name) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a variable name is a string such as 'x', not {name!r}")


def _check_ranks(ranks, size: int) -> list[int]:
    ranks = sorted(set(ranks))
    out = [r for r in ranks if not isinstance(r, int) or not 0 <= r < size]
    if out:
        raise WorldError(
            f"{_ranks(out)} {'is' if len(out) == 1 else 'are'} not in this world: it has ranks "
            f"0-{size - 1}. `%ranks start {max([size, *[r + 1 for r in out if isinstance(r, int)]])}"
            "` makes a bigger one."
        )
    return ranks


def _ranks(rs) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


class PerRank(dict):
    """The last expression of a cell on each rank, as text: side by side when short."""

    def __repr__(self) -> str:
        cols = {r: v["repr"].splitlines() or [""] for r, v in self.items()}
        width = {r: max(len(f"rank {r}"), *map(len, c)) for r, c in cols.items()}
        if sum(width.values()) + 3 * len(cols) > 110:  # too wide: one after the other
            return "\n".join(f"[rank {r}] " + v["repr"] for r, v in self.items())
        rows = [[f"rank {r}".ljust(width[r]) for r in cols]]
        for i in range(max(map(len, cols.values()))):
            rows.append([(c[i] if i < len(c) else "").ljust(width[r]) for r, c in cols.items()])
        return "\n".join("   ".join(row).rstrip() for row in rows)

    def _repr_html_(self) -> str:
        import html

        head = "".join(f"<th>rank {r}</th>" for r in self)
        cells = "".join(
            f"<td style='text-align:left'><pre>{html.escape(v['repr'])}</pre></td>"
            for v in self.values()
        )
        return f"<table><tr>{head}</tr><tr>{cells}</tr></table>"


# -- the magics ---------------------------------------------------------------------------------


def _parse(line: str, flags: dict) -> tuple[list[str], dict]:
    """Split a magic's line into positional words and --flag values (converted by ``flags``)."""
    from IPython.core.error import UsageError

    words, opts = [], {}
    tokens = iter(shlex.split(line))
    for tok in tokens:
        if tok.startswith("--"):
            key = tok[2:]
            if key not in flags:
                raise UsageError(f"unknown option {tok}; options: {', '.join(flags)}")
            try:
                opts[key] = flags[key](next(tokens))
            except (StopIteration, ValueError):
                raise UsageError(f"{tok} needs a value, e.g. {tok} {flags[key](1)}") from None
        else:
            words.append(tok)
    return words, opts


def _rank_spec(spec: str) -> list[int]:
    """'0,2' or '1-3' or '0,2-3' -> ranks."""
    from IPython.core.error import UsageError

    ranks = []
    try:
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            ranks += list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise UsageError(
            f"{spec!r} is not a list of ranks: write %%ranks 0,2 or %%ranks 1-3"
        ) from None
    return ranks


def ranks_magic(line: str, cell: str | None = None):
    """%ranks start N | reset | stop | status; %%ranks [ranks] runs the cell on the ranks."""
    from IPython.core.error import UsageError

    __tracebackhide__ = True  # IPython shows the rank's traceback, not the machinery's
    try:
        if cell is None:
            return _line(line)
        words, opts = _parse(line, {"timeout": float, "output": str})
        if len(words) > 1:
            raise UsageError(f"%%ranks takes one list of ranks (e.g. 0,2), not {' '.join(words)}")
        ranks = _rank_spec(words[0]) if words else None
        return run_cell(cell, ranks, opts.get("timeout"), opts.get("output"))
    except WorldError as exc:
        raise UsageError(str(exc)) from None


def _line(line: str):
    from IPython.core.error import UsageError

    words, opts = _parse(line, {"backend": str, "threads": int, "timeout": float})
    verb = words[0] if words else "status"
    if verb in ("start", "resize") and len(words) == 2 and words[1].isdigit():
        start(int(words[1]), **opts)
    elif verb == "reset" and len(words) == 1:
        reset()
    elif verb == "stop" and len(words) == 1:
        size = stop()
        print(f"world of {size} stopped" if size else "there was no world to stop")
    elif verb == "status" and len(words) == 1:
        print(f"world: {_world.describe()}" if _world else "no world: `%ranks start 4` starts one")
    else:
        raise UsageError(
            f"%ranks {line.strip()!r}: use %ranks start N | reset | stop | status "
            "(start N on a running world resizes it)"
        )


def load_ipython_extension(ip) -> None:
    """``%load_ext helpers.interactive``: register %ranks and %%ranks."""
    ip.register_magic_function(ranks_magic, "line_cell", "ranks")
    with launch._lock:
        launch._rank_server()  # it imports torch while the student types `%ranks start 4`


def _load_magics() -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is not None and "ranks" not in ip.magics_manager.magics["cell"]:
        load_ipython_extension(ip)
