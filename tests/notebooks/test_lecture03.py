"""Lecture 03 as committed: its measured-vs-formula cells tagged for nbval, fully_shard shown
(what every syllabus notebook must be: test_syllabus_notebooks).

(It runs under papermill and nbval with the whole syllabus in test_course_run and test_check.)
"""

from __future__ import annotations

import nbformat

from course.syllabus import REPO

PATH = REPO / "lectures" / "03_memory.ipynb"


def test_lecture03_checks_its_figures_with_nbval():
    code = [c for c in nbformat.read(PATH, as_version=4).cells if c.cell_type == "code"]
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
