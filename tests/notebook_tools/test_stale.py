"""A measured number typed in Markdown must be printed by the run (course/stale.py), and
`course check --executed` fails on one that is not, naming its cell."""

from __future__ import annotations

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output
from test_check import executed_copy

from course.check import compare
from course.kernel import KERNELSPEC
from course.stale import typed_measurements


def run_of(markdown: str, printed: str = "", code: str = "x = 2") -> nbformat.NotebookNode:
    """A notebook whose one code cell printed ``printed``, followed by ``markdown``."""
    out = [new_output("stream", name="stdout", text=printed)] if printed else []
    cells = [
        new_code_cell(code, execution_count=1, outputs=out),
        new_markdown_cell(markdown),
    ]
    return new_notebook(cells=cells, metadata={"kernelspec": KERNELSPEC})


def flagged(markdown: str, printed: str = "", code: str = "x = 2") -> list[str]:
    return [f"{t.number} {t.unit}" for t in typed_measurements(run_of(markdown, printed, code))]


@pytest.mark.parametrize(
    "markdown, printed, code, stale",
    [
        # a timing typed from some earlier run: the run printed another
        ("One rank took 0.115 s per step.", "step 0.093 s\n", "x = 2", ["0.115 s"]),
        # ... and the same number, printed by this run: consistent
        ("One rank took 0.115 s per step.", "step 0.115 s\n", "x = 2", []),
        # in its own unit, a rounding of a printed measurement is still typed: the next run's
        # 0.1152 would break it (and a theory ratio must not pass on a chance 1.52 elsewhere)
        ("One rank took 0.115 s per step.", "step 0.1149 s\n", "x = 2", ["0.115 s"]),
        ("ZeRO-1 sends 1.5× DDP's bytes.", "speedup 1.52\n", "x = 2", ["1.5 ×"]),
        ("ZeRO-1 sends 1.5× DDP's bytes.", "ratio 1.50\n", "x = 2", []),
        # in another unit, typing rounds: 115 ms printed as 0.1149 s
        ("One rank took 115 ms per step.", "step 0.1149 s\n", "x = 2", []),
        # a share, printed as a fraction by the run
        ("Exposed: 28 % of the step.", "exposed 0.28\n", "x = 2", []),
        (
            "Exposed: 5 % (5–7 %) of the step.",
            "exposed 0.28 (0.16-0.31)\n",
            "x = 2",
            ["5 %", "5 %", "7 %"],
        ),
        # a range, both ends checked
        ("From 0.101–0.115 s.", "0.101 0.2\n", "x = 2", ["0.115 s"]),
        # a size the run printed in bytes
        ("It sends 3.3 MB per step.", "bytes/step 3305512\n", "x = 2", []),
        ("It sends 4.2 MB per step.", "bytes/step 3305512\n", "x = 2", ["4.2 MB"]),
        # a ratio
        ("DP took 1.8× as long.", "ratio 1.23\n", "x = 2", ["1.8 ×"]),
        # a parameter of the code is not a measurement
        ("Buckets of 25 MB.", "", "bucket_cap_mb = 25", []),
        # theory and citations: math, code, quotations, a cited sentence, a marked paragraph
        ("The bound is $0.25 s$ here.", "", "x = 2", []),
        ("Call `sleep(0.5 s)`.", "", "x = 2", []),
        ("> CUDA out of memory. Tried to allocate 314.00 MiB", "", "x = 2", []),
        ("Goyal et al. trained in 60 min on 256 GPUs.", "", "x = 2", []),
        ("The seed reported 0.192 s per step.", "", "x = 2", []),
        ("<!-- theory -->\nZeRO-1 keeps 30 GB.", "", "x = 2", []),
        ("<!-- cited -->\nThe poster: 11 % faster.", "", "x = 2", []),
        # the marker covers its paragraph only
        ("<!-- theory -->\nZeRO keeps 30 GB.\n\nWe measured 0.7 s.", "", "x = 2", ["0.7 s"]),
        # numbers without a unit of measurement are not looked at
        ("Use 4 ranks and 3 repeats for 12 steps.", "", "x = 2", []),
    ],
)
def test_typed_measurements(markdown, printed, code, stale):
    assert flagged(markdown, printed, code) == stale


def test_course_check_executed_names_the_cell_of_a_stale_number(tmp_path):
    reference = run_of("One rank took 0.115 s per step.", "step 0.115 s\n")
    nbformat.write(reference, tmp_path / "nb.ipynb")
    (tmp_path / "build").mkdir()
    same = executed_copy(reference)
    nbformat.write(same, tmp_path / "build" / "nb.ipynb")
    assert compare(tmp_path / "nb.ipynb", tmp_path / "build" / "nb.ipynb", {"x": 1}) == []
    # the next run printed another time: the typed sentence is now wrong
    moved = executed_copy(
        reference, outputs=[[new_output("stream", name="stdout", text="step 0.093 s\n")], []]
    )
    nbformat.write(moved, tmp_path / "build" / "nb.ipynb")
    (problem,) = compare(tmp_path / "nb.ipynb", tmp_path / "build" / "nb.ipynb", {"x": 1})
    assert "markdown cell 1 (all cells from 0): '0.115 s' is typed" in problem
    assert "helpers.findings" in problem


def test_every_committed_notebook_prints_what_its_markdown_says():
    """The recorded outputs hold the same rule as a fresh run: a typed measurement caught here
    costs no execution (the executed check in test_course_run catches what the next run moves)."""
    from course.run import select
    from course.syllabus import load_syllabus

    problems = []
    for entry in select(load_syllabus(), None):
        nb = nbformat.read(entry.path, as_version=4)
        problems += [f"{entry.path}: {typed}" for typed in typed_measurements(nb)]
    assert problems == [], "\n".join(problems)
