"""How long does it take to run N ranks doing one all_reduce, and get the answer back?

Side by side on this machine, in one run: helpers.launch cold (first call in a fresh process)
and warm (a repeat call), `torchrun --standalone` (the whole command, as a notebook's
`!torchrun` runs it), torch.multiprocessing.spawn from a script, and start_processes with fork.
In-process methods are timed around the call, in a process that has already imported torch,
as a notebook kernel has. Prints a table and writes build/benchmarks/launch.{md,json}.

    .venv/bin/python benchmarks/launch_bench.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
TORCHRUN = str(Path(PY).parent / "torchrun")

WORK = """
import os, torch, torch.distributed as dist
def one_allreduce():
    t = torch.ones(1); dist.all_reduce(t); return t.item()
"""

LAUNCH = (
    WORK
    + """
import sys, time, json, helpers
n = int(sys.argv[1])
t0 = time.perf_counter(); assert helpers.launch(one_allreduce, world_size=n) == [float(n)] * n
cold = time.perf_counter() - t0
warm = []
for _ in range(20):
    t0 = time.perf_counter(); helpers.launch(one_allreduce, world_size=n); warm.append(time.perf_counter() - t0)
print(json.dumps({"cold": cold, "warm": sorted(warm)[len(warm) // 2]}))
"""
)

TORCHRUN_SCRIPT = (
    WORK
    + """
import socket
dist.init_process_group("gloo")
one_allreduce()
dist.destroy_process_group()
"""
)

SPAWN = (
    WORK
    + """
import sys, time, json, socket
import torch.multiprocessing as mp
def entry(rank, n, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    q.put((rank, one_allreduce()))
    dist.destroy_process_group()
if __name__ == "__main__":
    n, method = int(sys.argv[1]), sys.argv[2]
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    ctx = mp.get_context(method)
    q = ctx.SimpleQueue()
    t0 = time.perf_counter()
    if method == "spawn":
        mp.spawn(entry, args=(n, port, q), nprocs=n)
    else:
        mp.start_processes(entry, args=(n, port, q), nprocs=n, start_method="fork")
    results = [q.get() for _ in range(n)]
    print(json.dumps({"call": time.perf_counter() - t0}))
"""
)


def run_json(args, cwd) -> dict:
    out = subprocess.run(args, cwd=cwd, capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(n: int, repeats: int, tmp: Path) -> dict:
    (tmp / "bench_launch.py").write_text(LAUNCH)
    (tmp / "bench_torchrun.py").write_text(TORCHRUN_SCRIPT)
    (tmp / "bench_spawn.py").write_text(SPAWN)
    cold, warm, torchrun, spawn, fork = [], [], [], [], []
    for _ in range(repeats):
        r = run_json([PY, "bench_launch.py", str(n)], tmp)
        cold.append(r["cold"])
        warm.append(r["warm"])
        t0 = time.perf_counter()
        subprocess.run(
            [TORCHRUN, "--standalone", f"--nproc-per-node={n}", "bench_torchrun.py"],
            cwd=tmp,
            check=True,
            capture_output=True,
            timeout=300,
        )
        torchrun.append(time.perf_counter() - t0)
        spawn.append(run_json([PY, "bench_spawn.py", str(n), "spawn"], tmp)["call"])
        fork.append(run_json([PY, "bench_spawn.py", str(n), "fork"], tmp)["call"])
    med = statistics.median
    return {
        "ranks": n,
        "launch_cold": med(cold),
        "launch_warm": med(warm),
        "torchrun": med(torchrun),
        "mp_spawn": med(spawn),
        "fork": med(fork),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| ranks | helpers.launch cold | helpers.launch warm | torchrun --standalone | mp.spawn (script) | start_processes fork | torchrun / warm | torchrun / cold |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['ranks']} | {r['launch_cold']:.2f} s | {r['launch_warm'] * 1000:.1f} ms | {r['torchrun']:.2f} s "
            f"| {r['mp_spawn']:.2f} s | {r['fork']:.2f} s | {r['torchrun'] / r['launch_warm']:.0f}× "
            f"| {r['torchrun'] / r['launch_cold']:.2f}× |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(n, args.repeats, Path(tmp)) for n in args.ranks]
    text = table(rows)
    print(text)
    goals = [
        f"warm 4-rank launch ≤ 0.25 s: {'met' if rows[-1]['launch_warm'] <= 0.25 else 'MISSED'}",
        f"warm ≥ 20× faster than torchrun: {'met' if all(r['torchrun'] / r['launch_warm'] >= 20 for r in rows) else 'MISSED'}",
        f"cold no slower than torchrun: {'met' if all(r['launch_cold'] <= r['torchrun'] for r in rows) else 'MISSED'}",
    ]
    print("\n".join(goals))
    out = REPO / "build" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    (out / "launch.md").write_text(text + "\n\n" + "\n".join(goals) + "\n")
    (out / "launch.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
