"""Grading throughput: `course grade` at -j 1 and -j 2 against nbgrader autograde, one run.

The same small assignment (tests/grading_fixtures.py) and the same answers, 8 submissions,
graded from scratch by each. Prints submissions per minute and the ratios; writes
build/benchmarks/grading.md. Our runs include the isolation (sandbox, uid, namespaces, cgroups)
that this machine allows; nbgrader runs without any.

    .venv/bin/python benchmarks/grading_bench.py [--copies 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from grading_fixtures import ANSWERS, nbgrader_grade, release, write  # noqa: E402

from course.grade import grade  # noqa: E402
from course.grading.isolation import Isolation  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=2, help="copies of the 4 answer kinds")
    args = parser.parse_args()
    answers = {f"{name}{i}": make for i in range(args.copies) for name, make in ANSWERS.items()}
    n = len(answers)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src, student = release(tmp)
        subs = write(tmp / "subs", {name: make(student) for name, make in answers.items()})
        for jobs in (1, 2):
            start = time.perf_counter()
            grade(src, subs, tmp / f"out{jobs}", jobs=jobs, progress=False)
            rows.append((f"course grade -j {jobs}", time.perf_counter() - start))
        start = time.perf_counter()
        nbgrader_grade(tmp, answers)
        rows.append(("nbgrader autograde", time.perf_counter() - start))
    base = rows[-1][1]
    lines = ["| grader | seconds | submissions / minute | speed vs nbgrader |", "|---|---|---|---|"]
    for name, seconds in rows:
        lines.append(f"| {name} | {seconds:.1f} | {n / seconds * 60:.1f} | {base / seconds:.2f}× |")
    text = (
        "\n".join(lines) + f"\n\n{n} submissions; isolation: {'; '.join(Isolation().describe())}\n"
    )
    print(text)
    out = REPO / "build" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    (out / "grading.md").write_text(text)


if __name__ == "__main__":
    main()
