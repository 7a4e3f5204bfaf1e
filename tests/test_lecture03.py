"""Lecture 03 as committed: in the syllabus, parameters tagged, outputs recorded without errors,
its measured-vs-formula cells tagged for nbval.

(It runs under papermill and nbval with the whole syllabus in test_course_run and test_check.)
"""

from __future__ import annotations

import nbformat

from course.syllabus import REPO, load_syllabus

PATH = REPO / "lectures" / "03_memory.ipynb"


def test_lecture03_is_in_the_syllabus_after_lecture02_within_two_minutes():
    entries = load_syllabus()
    paths = [e.path.relative_to(REPO).as_posix() for e in entries]
    i = paths.index("lectures/03_memory.ipynb")
    assert paths[i - 1] == "lectures/02_data_parallel.ipynb"
    assert entries[i].budget_s <= 120 and entries[i].kind == "lecture"


def test_lecture03_is_recorded_and_its_checks_are_rechecked():
    nb = nbformat.read(PATH, as_version=4)
    assert nb.metadata["kernelspec"]["name"] == "multigpu-course"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "parameters" in code[0].metadata.get("tags", [])
    for cell in code:
        assert all(o.get("output_type") != "error" for o in cell.outputs), cell.source[:80]
        if "assert" in cell.source:  # a check against theory or a 1-process reference
            assert cell.outputs, cell.source[:80]
    checked = [c for c in code if "nbval-check-output" in c.metadata.get("tags", [])]
    assert len(checked) >= 10  # bytes by part, formulas, OOM message, sharded table: deterministic
    hidden = [c for c in code if c.metadata.get("jupyter", {}).get("source_hidden")]
    assert len(hidden) == 1  # the exercise's answer, collapsed


def test_lecture03_shows_fully_shard_and_the_measured_table():
    nb = nbformat.read(PATH, as_version=4)
    text = "\n".join(c.source for c in nb.cells)
    assert "fully_shard" in text and "ZeroRedundancyOptimizer" in text
    outputs = "\n".join(
        str(o.get("data", {}).get("text/plain", "")) + str(o.get("text", ""))
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
    )
    assert "measured / formula" in outputs and "CUDA out of memory" in outputs
    assert "every rank of every run holds the parameters one process computes alone" in outputs
