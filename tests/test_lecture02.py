"""Lecture 02 as committed: in the syllabus, parameters tagged, outputs recorded without errors,
its deterministic cells (bytes, buckets, equalities) tagged for nbval.

(It runs under papermill and nbval with the whole syllabus in test_course_run and test_check.)
"""

from __future__ import annotations

import nbformat

from course.syllabus import REPO, load_syllabus

PATH = REPO / "lectures" / "02_data_parallel.ipynb"


def test_lecture02_is_in_the_syllabus_after_lecture01_within_two_minutes():
    entries = load_syllabus()
    paths = [e.path.relative_to(REPO).as_posix() for e in entries]
    i = paths.index("lectures/02_data_parallel.ipynb")
    assert paths[i - 1] == "lectures/01_collectives.ipynb"
    assert entries[i].budget_s <= 120 and entries[i].kind == "lecture"


def test_lecture02_is_recorded_and_its_checks_are_rechecked():
    nb = nbformat.read(PATH, as_version=4)
    assert nb.metadata["kernelspec"]["name"] == "multigpu-course"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "parameters" in code[0].metadata.get("tags", [])
    for cell in code:
        assert all(o.get("output_type") != "error" for o in cell.outputs), cell.source[:80]
        if "assert" in cell.source:  # a check against theory or a 1-process reference: nbval
            assert cell.outputs, cell.source[:80]  # re-runs it (an error fails), and shows it
    checked = [c for c in code if "nbval-check-output" in c.metadata.get("tags", [])]
    assert len(checked) >= 10  # bytes, buckets, no_sync, buffers, hooks, exercises: deterministic
    hidden = [c for c in code if c.metadata.get("jupyter", {}).get("source_hidden")]
    assert len(hidden) == 2  # the two exercises' answers, collapsed
