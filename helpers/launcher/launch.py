"""Run a function typed in a notebook cell on N ranks, and bring everything back.

``launch(fn, *args, world_size=N)`` ships ``fn`` by value (cloudpickle) to N worker processes
that already joined one process group, streams their output into the cell with a ``[rank k]``
prefix, and returns the N return values in rank order. Workers are forked by a rank server, a
fresh interpreter that imported torch once (never a fork of the kernel, so CUDA in the notebook
does no harm): a new world starts in a fraction of a second. They stay warm between launches,
so a repeated launch costs milliseconds. Failures, hard deaths, hangs and interrupts stop every
rank and raise one exception that says which rank and why. Introduced in lecture 01.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections import OrderedDict

from helpers.launcher import _pickling, _rankserver
from helpers.launcher.errors import (
    LaunchError,
)
from helpers.launcher.limits import cpu_limit
from helpers.launcher.pool import START_TIMEOUT, Pool
from helpers.launcher.world import (
    BACKENDS,
    oversubscribed,
    thread_budget,
)

OUTPUTS = ("live", "rank0", "grouped", "none")
DEFAULT_TIMEOUT = float(os.environ.get("HELPERS_LAUNCH_TIMEOUT", "300"))
# An upper bound on every launch, explicit timeouts included: `course grade` sets it below its
# cell time limit, so a hung launch ends with its diagnosis in the feedback, not with the cell
# interrupted in silence.
TIMEOUT_CAP = float(os.environ.get("HELPERS_LAUNCH_TIMEOUT_CAP", "inf"))


MAX_POOLS = 3  # warm pools kept (one per world_size/backend/threads), least recent dropped
# the folder that holds the helpers package (ranks import it from there)
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_pools: OrderedDict = OrderedDict()
_server: _rankserver.Server | None = None
_lock = threading.RLock()


def launch(
    fn,
    *args,
    world_size: int = 2,
    backend: str = "auto",
    timeout: float | None = None,
    output: str | None = None,
    threads: int | None = None,
    **kwargs,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return their results in rank order.

    The default process group is initialised before ``fn`` runs (``backend="auto"``: NCCL when
    every rank can have its own GPU, else gloo). ``timeout`` (seconds, default
    $HELPERS_LAUNCH_TIMEOUT or 300) bounds the run; a hang raises LaunchTimeout naming where
    each rank is blocked. ``output``: "live" (lines as they come, prefixed ``[rank k]``),
    "rank0" (rank 0's lines only), "grouped" (after the run, rank by rank: deterministic, for
    nbval) or "none"; default $HELPERS_LAUNCH_OUTPUT or "live". ``threads``: cores per CPU rank,
    default $HELPERS_THREADS or 1 at every world size (one rank plays one device; each rank is
    pinned to its own cores). A world that needs more cores than there are runs, but is
    oversubscribed: a one-line notice says so, and timings recorded there carry the mark.
    """
    if os.environ.get("HELPERS_LAUNCH_RANK") is not None:
        raise LaunchError(
            f"launch() was called inside a launched rank (rank {os.environ['HELPERS_LAUNCH_RANK']})"
            ": a rank cannot start ranks of its own. Call launch() from the notebook; inside fn, "
            "use torch.distributed directly, the process group is already set up."
        )
    if not callable(fn):
        raise TypeError(
            f"launch() needs a function to run on every rank, got {fn!r} "
            f"({type(fn).__name__}). Pass the function itself: launch(work, world_size=2)."
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, not {world_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    output = output or os.environ.get("HELPERS_LAUNCH_OUTPUT", "live")
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {', '.join(OUTPUTS)}, not {output!r}")
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(
            f"timeout must be a positive number of seconds (or math.inf), not {timeout!r}"
        )
    timeout = min(timeout, TIMEOUT_CAP)
    threads = thread_budget(world_size, threads)
    payload = _pickle_call(fn, args, kwargs)
    # The ranks see the caller's working directory, import path and argv, as a thread would.
    opts = {
        "cwd": os.getcwd(),
        "sys_path": [os.path.abspath(p) for p in sys.path],
        "argv": list(sys.argv),
    }

    with _lock:
        pool = _get_pool(world_size, backend, threads)
        try:
            results = pool.run(payload, opts, timeout, output)
        except BaseException:
            _retire(pool)  # after a failure, hang or interrupt its ranks are in no known state
            raise
        if pool.dirty:  # the function destroyed the process group: these ranks are spent
            _retire(pool)
        return results


def shutdown() -> None:
    """Stop every worker the launcher keeps, and the rank server; no process is left behind."""
    global _server
    with _lock:
        for pool in list(_pools.values()):
            _retire(pool)
        if _server is not None and _server.owner == os.getpid():
            _server.close()
        _server = None


atexit.register(shutdown)


def _pickle_call(fn, args, kwargs) -> bytes:
    """Pickle the call by value; if that fails, name the argument that cannot travel."""
    try:
        return _pickling.dumps((fn, args, kwargs))
    except Exception as exc:
        culprit = "the function (something it uses from the notebook)"
        for name, value in [(None, fn), *enumerate(args), *kwargs.items()]:
            try:
                _pickling.dumps(value)
            except Exception:
                if name is None:
                    break
                culprit = (
                    f"argument {name!r}" if isinstance(name, str) else f"positional argument {name}"
                )
                culprit += f" ({type(value).__name__})"
                break
        raise TypeError(
            f"{culprit} cannot be sent to the ranks: {exc}. Ranks are separate processes: send "
            "data that pickles (numbers, lists, dicts, tensors, a file path) and create "
            "the rest (open files, locks, generators, models on a GPU) inside the function."
        ) from None


def _get_pool(world_size: int, backend: str, threads: int):
    key = (world_size, backend, threads)
    pool = _pools.get(key)
    if pool is not None and (pool.owner != os.getpid() or not pool.alive()):
        _pools.pop(key)
        if pool.owner == os.getpid():
            pool.kill()  # a rank died while idle: replace the pool transparently
        pool = None
    if pool is None:
        server = _rank_server()
        while len(_pools) >= MAX_POOLS:
            _retire(next(iter(_pools.values())))
        pool = Pool(world_size, backend, threads, server)
        _pools[key] = pool
        pool.start()
        if oversubscribed(world_size, threads):
            # stdout, not stderr: nbgrader fails any test cell that writes to stderr
            print(oversubscribed_notice(world_size, threads), flush=True)
    _pools.move_to_end(key)
    return pool


# Variables that change without changing what a rank would import: pytest names the running test
# in one, and a rank server restarted for each test (torch imported again, seconds) bought nothing;
# torch sets TORCHINDUCTOR_CACHE_DIR to its own default the first time an optimizer step imports
# torch._dynamo, which a rank would compute the same way (a lab's check that trains in the kernel
# cost every later launch a cold pool).
_VOLATILE = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"})


def _rank_server() -> _rankserver.Server:
    """The kernel's rank server, started (again) when there is none, it died, or the kernel's
    environment changed since it started: ranks see the environment as it is when they start,
    as fresh interpreters would (some libraries read it only on import)."""
    global _server
    env = {k: v for k, v in os.environ.items() if k not in _VOLATILE}
    if _server is not None and (
        _server.owner != os.getpid() or not _server.alive() or _server.source != env
    ):
        if _server.owner == os.getpid():
            for pool in list(_pools.values()):
                _retire(pool)  # their ranks are the old server's children
            _server.close()
        _server = None
    if _server is None:
        _server = _rankserver.Server(_server_env(env), source=env, start_timeout=START_TIMEOUT)
    return _server


def _server_env(env: dict) -> dict:
    """The environment every rank inherits; each rank adds its own variables (``Pool._spawn``)."""
    env = dict(env)
    env.update(
        PYTHONUNBUFFERED="1",
        # The kernel's inline backend exists only inside a Jupyter kernel.
        MPLBACKEND="Agg",
        PYTHONPATH=os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")])),
        # Thread pools are sized when torch loads; each rank sets its own budget (world.py).
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
    )
    return env


def oversubscribed_notice(world_size: int, threads: int) -> str:
    """The one line a cell shows when its world has more ranks than devices to run them."""
    limit = cpu_limit()
    n = limit.count
    why = f" Devices here: {limit.describe()}." if limit.source in ("quota", "slurm") else ""
    return (
        f"helpers.launch: {world_size} ranks × {threads} thread{'s' if threads > 1 else ''} on "
        f"{n} device{'s' if n != 1 else ''} is OVERSUBSCRIBED: ranks take turns on the cores, "
        f"so its timings are not scaling (they are marked oversubscribed).{why}"
    )


def _retire(pool) -> None:
    _pools.pop(pool.key, None)
    if pool.owner == os.getpid():
        pool.kill()
