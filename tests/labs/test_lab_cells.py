"""A released lab is mostly the student's: their cells and the short tests beside them.

The machinery a lab needs (runs, tables, plots, hidden checks) lives in ``helpers.labs`` and is
tested there; a locked cell the student scrolls past stays short. Counted in code lines (not blank,
not a comment), outside the parameters cell (a list of settings, not code to read):
- the student's: cells the student writes (nbgrader, not locked) and the graded test cells;
- the rest: locked set-up and harness cells, and the free cells that run, plot and print findings.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[2]
LABS = sorted((REPO / "labs").glob("lab*.ipynb"))
LOCKED_LIMIT = 30  # lines of one locked code cell


def code_lines(source: str) -> int:
    return sum(
        1 for line in source.splitlines() if line.strip() and not line.strip().startswith("#")
    )


def kind(cell) -> str:
    """'parameters', 'student', 'test', 'locked' or 'free' (no nbgrader metadata)."""
    if "parameters" in cell.metadata.get("tags", []):
        return "parameters"
    grader = cell.metadata.get("nbgrader")
    if grader is None:
        return "free"
    if grader.get("grade"):
        return "test"
    return "locked" if grader.get("locked") else "student"


def census(path: Path) -> dict[str, int]:
    counts = dict.fromkeys(("parameters", "student", "test", "locked", "free"), 0)
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type == "code":
            counts[kind(cell)] += code_lines(cell.source)
    return counts


def test_the_labs_are_found():
    assert len(LABS) == 7, [p.name for p in LABS]


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem)
def test_no_locked_cell_is_long(path):
    long = [
        (cell.metadata["nbgrader"].get("grade_id"), code_lines(cell.source))
        for cell in nbformat.read(path, as_version=4).cells
        if cell.cell_type == "code" and kind(cell) == "locked"
        if code_lines(cell.source) > LOCKED_LIMIT
    ]
    assert not long, (
        f"{path.name}: locked cells over {LOCKED_LIMIT} lines: {long}; move it to helpers.labs"
    )


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem)
def test_the_students_cells_and_tests_are_most_of_the_code(path):
    c = census(path)
    theirs = c["student"] + c["test"]
    rest = c["locked"] + c["free"]
    assert theirs > rest, (
        f"{path.name}: the student's cells and tests are {theirs} code lines against {rest} of "
        f"set-up, harness and free cells ({c}): move runs, tables and plots to helpers.labs"
    )


def test_the_census_tells_the_kinds_apart():
    nb = nbformat.v4.new_notebook()
    meta = lambda grade, locked: {"nbgrader": {"grade": grade, "locked": locked}}  # noqa: E731
    nb.cells = [
        nbformat.v4.new_code_cell("a = 1\nb = 2", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(
            "def f():\n    # why\n\n    return 1", metadata=meta(False, False)
        ),
        nbformat.v4.new_code_cell("assert f() == 1", metadata=meta(True, True)),
        nbformat.v4.new_code_cell("import x\nimport y\nimport z", metadata=meta(False, True)),
        nbformat.v4.new_code_cell("plot()"),
        nbformat.v4.new_markdown_cell("# not code"),
    ]
    path = Path(pytest.importorskip("tempfile").mkdtemp()) / "nb.ipynb"
    nbformat.write(nb, path)
    assert census(path) == {"parameters": 2, "student": 2, "test": 1, "locked": 3, "free": 1}
