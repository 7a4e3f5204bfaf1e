"""Run a lab function under torchrun, on one node or many: the same function launch() runs.

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m helpers.run labs.lab01:train 3 batch_size=64 --out results.pkl

Each rank reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR/PORT), sets its threads and device, initialises the default process group, calls
``module:function(*args, **kwargs)`` and sends its return value to rank 0, which prints one
line per rank and, with ``--out``, pickles the list in rank order (what launch() returns).
Arguments are Python literals (``3``, ``'adam'``, ``[1, 2]``) or plain strings; ``k=v`` is a
keyword argument.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import importlib
import os
import pickle
import sys
from typing import NoReturn

import torch.distributed as dist

from helpers.launcher import watch
from helpers.launcher import world as world_mod

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def parse_value(text: str):
    """A Python literal if it parses as one, else the string itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_call(words: list[str]) -> tuple[list, dict]:
    args, kwargs = [], {}
    for word in words:
        key, sep, value = word.partition("=")
        if sep and key.isidentifier():
            kwargs[key] = parse_value(value)
        else:
            args.append(parse_value(word))
    return args, kwargs


def resolve(target: str):
    """Import ``module:function`` (dots allowed after the colon)."""
    module, sep, name = target.partition(":")
    if not sep or not name:
        raise SystemExit(f"helpers.run: expected module:function, got {target!r}")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise SystemExit(f"helpers.run: {target} is not callable")
    return obj


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m helpers.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", help="module:function to run on every rank")
    parser.add_argument("args", nargs="*", help="arguments: Python literals, or key=value")
    parser.add_argument("--backend", default="auto", help="auto, gloo, nccl or mpi")
    parser.add_argument("--threads", type=int, default=None, help="threads per rank")
    parser.add_argument("--out", default=None, help="rank 0 pickles the results list here")
    opts = parser.parse_args(argv)

    missing = [k for k in ENV if k not in os.environ]
    if missing:
        raise SystemExit(
            f"helpers.run reads torchrun's environment and {', '.join(missing)} is not set: start "
            "it with torchrun, e.g. torchrun --standalone --nproc-per-node 2 -m helpers.run "
            "module:function (from a notebook, use helpers.launch instead)."
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    os.environ["HELPERS_LAUNCH_RANK"] = str(rank)  # launch() inside a rank is an error here too
    if os.environ.get("MASTER_ADDR") in ("127.0.0.1", "localhost") or local_world == world:
        world_mod.use_loopback()  # one node: no network needed
    fn = resolve(opts.target)
    args, kwargs = parse_call(opts.args)
    watch.install()
    world_mod.init_rank(rank, world, local_rank, local_world, opts.backend, opts.threads)
    try:
        result = fn(*args, **kwargs)
        results = [None] * world if rank == 0 else None
        dist.gather_object(result, results, dst=0)
        if rank == 0:
            for r, value in enumerate(results):
                print(f"[rank {r}] -> {value!r}", flush=True)
            if opts.out:
                with open(opts.out, "wb") as f:
                    pickle.dump(results, f)
        # Every rank waits here until rank 0 has its results: a rank that tore gloo down while
        # a peer still used its connection could fail that peer's last collective.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def exit_now(code: int) -> NoReturn:
    """Exit with ``code`` once atexit handlers have run, skipping the runtime's own teardown.

    The results are out by now. What remains is the interpreter's finalisation and the C++ static
    destructors, and there a gloo thread still alive can abort the process ("terminate called
    without an active exception", SIGABRT, seen in CI after a clean run). torchrun then reports a
    failed worker and holds the other node in its exit barrier. Launched ranks exit the same way.
    """
    atexit._run_exitfuncs()  # what sys.exit would still have run: logging, user handlers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
