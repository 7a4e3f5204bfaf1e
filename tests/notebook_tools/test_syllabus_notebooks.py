"""Every notebook of the syllabus as committed: the project kernel, a tagged parameters cell,
outputs recorded without errors, and every cell that checks a figure against theory recorded
with its output (nbval re-runs those in test_check; papermill runs them all in test_course_run)."""

from __future__ import annotations

import nbformat
import pytest

from course.syllabus import REPO, load_syllabus

ENTRIES = load_syllabus()


def test_lectures_come_in_order_before_the_labs():
    paths = [e.path.relative_to(REPO).as_posix() for e in ENTRIES]
    lectures = [p for p, e in zip(paths, ENTRIES, strict=True) if e.kind == "lecture"]
    assert lectures == sorted(lectures) and paths[: len(lectures)] == lectures
    assert all(e.budget_s <= (120 if e.kind == "lecture" else 180) for e in ENTRIES)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.path.name)
def test_recorded_with_its_checks(entry):
    nb = nbformat.read(entry.path, as_version=4)
    assert nb.metadata["kernelspec"]["name"] == "multigpu-course"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "parameters" in code[0].metadata.get("tags", [])
    for cell in code:
        if "raises-exception" not in cell.metadata.get("tags", []):  # e.g. a deadlock, shown
            assert all(o.get("output_type") != "error" for o in cell.outputs), cell.source[:80]
        if entry.kind == "lecture" and "assert" in cell.source:  # a check against theory: shown
            assert cell.outputs, cell.source[:80]


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.path.name)
def test_the_quick_profile_is_the_notebooks_own_defaults(entry):
    """The suite checks the syllabus as `course run` executes it, with the quick profile injected;
    a student runs the notebook with its own parameters cell. They must be the same run, or the
    committed outputs would be checked against a run no student makes."""
    nb = nbformat.read(entry.path, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    defaults: dict = {}
    exec(cell.source, defaults)  # plain assignments (papermill's convention)
    quick = entry.parameters("quick")
    assert {k: defaults.get(k, "<missing>") for k in quick} == quick
