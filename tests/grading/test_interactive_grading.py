"""A graded notebook that uses the live world (%%ranks), graded by `course grade` in its sandbox.

The world's ranks start inside the submission's sandbox (own uid, namespaces, cgroup), a student's
%%ranks cell keeps its variables for the test cell after it, the probe pulls them into the
kernel, the check runs in the grader; a wrong all-reduce loses the points, and no rank is left.
"""

from __future__ import annotations

import csv

import nbformat
from grading_fixtures import meta, write
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from course.grade import grade
from course.kernel import KERNELSPEC
from course.release import student_version


def world_lab() -> nbformat.NotebookNode:
    return new_notebook(
        metadata={"kernelspec": KERNELSPEC, "language_info": {"name": "python"}},
        cells=[
            new_markdown_cell("# A live world", metadata=meta("intro", locked=True)),
            new_code_cell(
                "import helpers\n%load_ext helpers.interactive\n%ranks start 2",
                metadata=meta("world", locked=True),
            ),
            new_code_cell(
                "%%ranks\n### BEGIN SOLUTION\nx = torch.tensor([float(rank + 1)])\n"
                "dist.all_reduce(x)\n### END SOLUTION",
                metadata=meta("sum_ranks", solution=True),
            ),
            new_code_cell(
                "held = [t.item() for t in helpers.interactive.pull('x')]\n"
                "# --- check ---\nassert held == [3.0, 3.0], held",
                metadata=meta("test_sum_ranks", grade=True, points=2),
            ),
        ],
    )


ANSWERS = {
    "right": "%%ranks\nx = torch.tensor([float(rank + 1)])\ndist.all_reduce(x)",
    "no_reduce": "%%ranks\nx = torch.tensor([float(rank + 1)])",  # each rank keeps its own
    "in_kernel": "import torch\nx = torch.tensor([3.0])",  # not on the ranks at all
}


def test_a_world_cell_is_graded_in_the_sandbox(tmp_path):
    source = tmp_path / "source" / "world.ipynb"
    source.parent.mkdir()
    nbformat.write(world_lab(), source)
    student = student_version(world_lab())
    subs = {}
    for name, code in ANSWERS.items():
        nb = nbformat.from_dict(student)
        for cell in nb.cells:
            if cell.metadata.get("nbgrader", {}).get("grade_id") == "sum_ranks":
                cell.source = code
        subs[name] = nb
    out = tmp_path / "out"
    grade(source, write(tmp_path / "subs", subs), out, jobs=1, progress=False)
    with open(out / "gradebook.csv") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    points = {name: float(rows[name]["total"]) for name in ANSWERS}
    assert points == {"right": 2.0, "no_reduce": 0.0, "in_kernel": 0.0}, rows
    assert all(rows[n]["status"] == "graded" for n in ANSWERS), rows
