"""%%ranks beside its peers: the round trip of a trivial cell, and the time to start a world.

Measures, side by side in one run, with repeats (median, min-max):
  - the round trip of a trivial cell (``x = 1``) on 2 and 4 ranks: helpers' ``%%ranks``,
    ipyparallel's ``%%px`` and nbdistributed's ``%%distributed``;
  - the time to start a world (every rank up, its process group initialised) of 2 and 4, from
    a fresh kernel: ``%ranks start N``; ``ipp.Cluster(n=N)`` started, connected and
    ``init_process_group`` run by ``%%px``; ``%dist_init -n N``.
Each start is a fresh interpreter (one per repeat), which then times the round trips. The cells
run in an IPython shell in that interpreter (the kernel's messaging is the same for the three).

The peers are pinned in benchmarks/requirements-peers.txt, not in the course's pyproject, and
live in their own venv, which sees the course's .venv (torch and helpers) through a .pth file:

    python3 -m venv build/peers-venv
    echo "$PWD/.venv/lib/python3.11/site-packages" \\
        > build/peers-venv/lib/python3.11/site-packages/course-venv.pth
    build/peers-venv/bin/pip install -r benchmarks/requirements-peers.txt
    build/peers-venv/bin/python benchmarks/interactive_bench.py [--repeats 3] [--cells 20]

Run it alone on the machine: the figures are wall times of processes that share its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = ("ranks", "ipyparallel", "nbdistributed")
TRIVIAL = "x = 1"


def _shell():
    from IPython.testing.globalipapp import start_ipython

    return start_ipython()


def _load(tool: str, ip) -> None:
    """What a notebook's first cell does before any world: load the extension (or import)."""
    if tool == "ipyparallel":
        import ipyparallel  # noqa: F401
    else:
        ip.run_line_magic("load_ext", {"ranks": "helpers.interactive"}.get(tool, tool))


def _start(tool: str, ip, n: int):
    """Start a world of ``n`` with ``tool`` in shell ``ip``; return what stops it."""
    if tool == "ranks":
        import helpers

        ip.run_line_magic("ranks", f"start {n}")
        # the rank server outlives a world (one per kernel): stopped here, not left behind
        return lambda: (ip.run_line_magic("ranks", "stop"), helpers.shutdown())
    if tool == "ipyparallel":
        import ipyparallel as ipp

        cluster = ipp.Cluster(n=n, log_level=40)
        rc = cluster.start_and_connect_sync(activate=True)
        rc.wait_for_engines(n)
        view = rc[:]
        view.scatter("rank", list(range(n)), flatten=True)
        view["world_size"] = n
        ok = view.apply_sync(_gloo_init, _free_port())  # every engine joins one process group
        assert all(ok)
        return cluster.stop_cluster_sync
    ip.run_line_magic("dist_init", f"-n {n}")
    magics = next(m for m in ip.magics_manager.registry.values() if hasattr(m, "dist_init"))
    if magics._comm_manager is None:  # it prints its failure and goes on: do not time that
        raise RuntimeError("nbdistributed did not start its workers (see its output)")
    return lambda: ip.run_line_magic("dist_shutdown", "")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_init(port: int) -> bool:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # noqa: F821 (pushed)
    return dist.is_initialized()


def one(tool: str, n: int, cells: int) -> dict:
    """In this fresh interpreter: start a world of ``n``, then time ``cells`` trivial cells."""
    sys.path.insert(0, str(REPO))
    ip = _shell()
    magic = {"ranks": "ranks", "ipyparallel": "px", "nbdistributed": "distributed"}[tool]
    began = time.perf_counter()
    _load(tool, ip)
    loaded = time.perf_counter()
    stop = _start(tool, ip, n)
    started = time.perf_counter() - loaded
    workers = _processes()
    ip.run_cell_magic(magic, "", TRIVIAL)  # the first cell may pay one-time costs
    trips = []
    for _ in range(cells):
        t = time.perf_counter()
        ip.run_cell_magic(magic, "", TRIVIAL)
        trips.append(time.perf_counter() - t)
    stop()
    _kill_leftovers(workers)
    return {"load": loaded - began, "start": started, "trips": trips}


def _processes() -> list:
    import psutil

    return psutil.Process().children(recursive=True)


def _kill_leftovers(workers: list) -> None:
    """Kill the world's processes still running after the tool's own stop (nbdistributed 0.1.0
    leaves its workers, reparented to init), so the next measurement has the cores to itself;
    say so on stderr."""
    import psutil

    time.sleep(1.0)  # a stop may end its processes a moment after it returns
    left = [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in left:
        p.kill()
    if left:
        print(f"killed {len(left)} processes left after stop", file=sys.stderr)


def spread(xs: list[float], unit: float = 1.0) -> str:
    xs = [x * unit for x in xs]
    return f"{statistics.median(xs):9.3f} ({min(xs):.3f}-{max(xs):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="fresh interpreters per figure")
    parser.add_argument("--cells", type=int, default=20, help="trivial cells timed in each")
    parser.add_argument("--one", nargs=2, metavar=("TOOL", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        sys.stdout = open(os.devnull, "w")  # the tools' banners; the result goes to stderr
        print(json.dumps(one(args.one[0], int(args.one[1]), args.cells)), file=sys.stderr)
        return
    # nbdistributed starts its workers as "python" from PATH: make that this venv's python
    env = dict(
        os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])
    )
    results: dict = {}
    for _ in range(args.repeats):
        for n in (2, 4):
            for tool in TOOLS:  # interleaved: a busy moment hurts every tool alike
                cmd = [sys.executable, __file__, "--one", tool, str(n), "--cells", str(args.cells)]
                p = subprocess.run(
                    cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600
                )
                line = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
                try:
                    got = json.loads(line)
                except json.JSONDecodeError:
                    sys.exit(f"{tool} n={n} failed:\n{p.stderr[-3000:]}")
                slot = results.setdefault((tool, n), {"load": [], "start": [], "trips": []})
                slot["load"].append(got["load"])
                slot["start"].append(got["start"])
                slot["trips"] += got["trips"]
                if "killed" in p.stderr:
                    slot["leftovers"] = True
    report(results, args)


def report(results: dict, args) -> None:
    import importlib.metadata as md

    versions = ", ".join(f"{t} {md.version(t)}" for t in ("ipyparallel", "nbdistributed"))
    print(f"peers: {versions}; python {sys.version.split()[0]}; cores: {os.cpu_count()}")
    print(f"repeats: {args.repeats} fresh interpreters x {args.cells} cells; median (min-max)")
    for n in (2, 4):
        print(
            f"\nworld of {n}      round trip of `{TRIVIAL}` (ms)   start (s)"
            "                load: extension/import (s)"
        )
        for tool in TOOLS:
            r = results[(tool, n)]
            left = "   left processes after its stop" if r.get("leftovers") else ""
            print(
                f"  {tool:14} {spread(r['trips'], 1e3)}   {spread(r['start'])}   "
                f"{spread(r['load'])}{left}"
            )
        ours = results[("ranks", n)]
        for tool in TOOLS[1:]:
            r = results[(tool, n)]
            trip = statistics.median(r["trips"]) / statistics.median(ours["trips"])
            start = statistics.median(r["start"]) / statistics.median(ours["start"])
            # what a student waits for from the first cell: the extension's load (ours imports
            # torch into the kernel, the peers' do not) and then the world's start
            first = _first_cell(r) / _first_cell(ours)
            print(
                f"  {tool} / %%ranks (above 1: %%ranks is faster): round trip {trip:.1f}x, "
                f"start {start:.1f}x, load + start {first:.1f}x"
            )


def _first_cell(r: dict) -> float:
    return statistics.median(r["load"]) + statistics.median(r["start"])


if __name__ == "__main__":
    main()
