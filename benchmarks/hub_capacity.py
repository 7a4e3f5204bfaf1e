"""How many students at once this machine carries: N students run a lab side by side, each in a
cgroup with the hub's limits, until a run goes past the lab's budget.

Each student is what the hub makes of one (course.hub.cgroups, the spawner's own code): a cgroup
with COURSE_HUB_CPU_LIMIT CPUs of quota and COURSE_HUB_MEM_LIMIT of memory, in which the lab
runs start to end as `course run` runs it (papermill, the course kernel, the quick profile).
N = 1, 2, 3, ... students start at the same moment; the step stops after the first N at which
a run ends past the syllabus's budget for the lab (or fails), or at --max.

Checked against theory as it runs: a student's CPU time, from the cgroup's own accounting, is
never more than the quota times the run's wall time, and all students together never more than
the machine's devices times the wall time (the CFS quota and the cores are the limits).

    .venv/bin/python benchmarks/hub_capacity.py [--lab solutions/lab01_ddp_scaling.ipynb]
        [--cpu 2] [--memory 4G] [--max 4]

Prints a table (median, min-max of the N runs' wall times against the budget) and the capacity,
and writes hub_capacity.md into --out (build/benchmarks/). Needs root and cgroups (as the hub does).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from course.hub import cgroups  # noqa: E402
from course.syllabus import load_syllabus  # noqa: E402
from helpers.launcher.world import cpu_count  # noqa: E402

# One student's run: the lab through course.run.execute, as `course run` would, in the
# student's cgroup (joined before the interpreter starts, so the kernel and ranks are in it).
STUDENT = """
import json, sys
from pathlib import Path
from course.run import execute
from course.syllabus import load_syllabus
entry = next(e for e in load_syllabus() if e.path == Path(sys.argv[1]).resolve())
r = execute(entry, "quick", Path(sys.argv[2]))
print(json.dumps({"seconds": r.seconds, "ok": r.ok, "error": r.error}))
"""


def parse_memory(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def run_class(n: int, lab: Path, limits: cgroups.Limits, tree: cgroups.Group, tmp: Path) -> dict:
    """``n`` students run ``lab`` at once; their wall times, CPU seconds and outcomes."""
    groups = [cgroups.make(tree.child(f"n{n}-student{i}"), limits) for i in range(n)]
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", STUDENT, str(lab), str(tmp / f"n{n}-s{i}")],
            preexec_fn=cgroups.joiner(g),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for i, g in enumerate(groups)
    ]
    runs = []
    for p, g in zip(procs, groups, strict=True):
        out, err = p.communicate()
        wall = time.monotonic() - start  # from the common start: what the student waited
        try:
            result = json.loads(out.strip().splitlines()[-1])
        except (IndexError, ValueError):
            result = {"seconds": wall, "ok": False, "error": (err.strip() or "no output")[-300:]}
        runs.append({**result, "wall": wall, "cpu_s": cgroups.cpu_seconds(g)})
    span = time.monotonic() - start
    for g in groups:
        cgroups.kill(g)
        cgroups.remove(g)
    return {"n": n, "runs": runs, "span": span}


def check_against_theory(row: dict, cpu_limit: float, devices: int) -> list[str]:
    """The quota and the cores bound the CPU time: a run over them is a broken limit."""
    slack = 1.05  # the CFS period (100 ms) lets a burst through at a period's edge
    problems = []
    for i, r in enumerate(row["runs"]):
        if r["cpu_s"] > cpu_limit * r["wall"] * slack + 1:
            problems.append(
                f"student {i} used {r['cpu_s']:.1f} CPU-s in {r['wall']:.1f} s, past its "
                f"quota of {cpu_limit:g} CPUs"
            )
    total = sum(r["cpu_s"] for r in row["runs"])
    if total > devices * row["span"] * slack + 1:
        problems.append(f"{total:.1f} CPU-s in {row['span']:.1f} s on {devices} devices")
    return problems


def table(rows: list[dict], budget: float, cpu_limit: float) -> str:
    lines = [
        "| students at once | run wall s: median (min-max) | × budget (median) | over budget "
        "or failed | CPU-s per student: median | CPU share of quota |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        walls = [r["wall"] for r in row["runs"]]
        cpu = [r["cpu_s"] for r in row["runs"]]
        bad = sum(1 for r in row["runs"] if not r["ok"] or r["wall"] > budget)
        share = statistics.median(c / (cpu_limit * w) for c, w in zip(cpu, walls, strict=True))
        lines.append(
            f"| {row['n']} | {statistics.median(walls):.0f} ({min(walls):.0f}-{max(walls):.0f}) "
            f"| {statistics.median(walls) / budget:.2f} | {bad} of {row['n']} "
            f"| {statistics.median(cpu):.0f} | {share:.0%} |"
        )
    return "\n".join(lines)


def capacity(rows: list[dict], budget: float) -> int:
    """The most students at once with every run done, and within the budget."""
    fits = [row["n"] for row in rows if all(r["ok"] and r["wall"] <= budget for r in row["runs"])]
    best = 0
    for n in sorted(fits):  # contiguous from 1: a lucky 3 after a failed 2 is not capacity
        if n != best + 1:
            break
        best = n
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lab", default="solutions/lab01_ddp_scaling.ipynb")
    parser.add_argument(
        "--cpu", type=float, default=float(os.environ.get("COURSE_HUB_CPU_LIMIT", 2))
    )
    parser.add_argument("--memory", default=os.environ.get("COURSE_HUB_MEM_LIMIT", "4G"))
    parser.add_argument("--max", type=int, default=4, help="most students at once to try")
    parser.add_argument("--out", default=str(REPO / "build" / "benchmarks"), help="report folder")
    args = parser.parse_args()
    lab = (REPO / args.lab).resolve()
    entry = next((e for e in load_syllabus() if e.path == lab), None)
    if entry is None:
        parser.error(f"{args.lab} is not a notebook of syllabus.yml")
    limits = cgroups.Limits(cpu=args.cpu, memory=parse_memory(args.memory), pids=4096)
    devices = cpu_count()
    tree = cgroups.here().child(f"course-capacity-{os.getpid()}")
    cgroups.make(tree)
    # stopped with SIGTERM (kill, a CI's timeout): still kill the students and remove the tree
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows, problems = [], []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for n in range(1, args.max + 1):
                row = run_class(n, lab, limits, tree, Path(tmp))
                rows.append(row)
                problems += check_against_theory(row, args.cpu, devices)
                print(table(rows[-1:], entry.budget_s, args.cpu).splitlines()[-1], flush=True)
                if any(not r["ok"] or r["wall"] > entry.budget_s for r in row["runs"]):
                    break
    finally:
        cgroups.kill(tree)
        cgroups.remove(tree)
    fits = capacity(rows, entry.budget_s)
    text = (
        f"{entry.path.relative_to(REPO)} (quick profile, budget {entry.budget_s:.0f} s), each "
        f"student in a cgroup of {args.cpu:g} CPUs and {args.memory}, on {devices} devices "
        f"({os.cpu_count()} cores); all students start together.\n\n"
        + table(rows, entry.budget_s, args.cpu)
        + f"\n\nCapacity: {fits} student{'s' if fits != 1 else ''} at once ran the lab within "
        "its budget" + (f" (the most tried: {args.max})" if fits == args.max else "") + ".\n"
    )
    for r in (r for row in rows for r in row["runs"] if not r["ok"]):
        text += f"\nA run failed: {r['error']}"
    print("\n" + text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hub_capacity.md").write_text(text)
    if problems:
        print("AGAINST THEORY:\n" + "\n".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
