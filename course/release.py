"""`course release`: solutions/ -> labs/, the student version, as an ordered list of small passes.

1. validate the authoring format (course.grading.cells.validate);
2. replace each ``### BEGIN SOLUTION`` region with a stub that raises NotImplementedError
   (markdown answers become "YOUR ANSWER HERE");
3. drop ``### BEGIN HIDDEN TESTS`` regions;
4. clear outputs, execution counts and run metadata;
5. record nbgrader's checksum and cell type on every graded, solution or locked cell, exactly as
   nbgrader does, so `nbgrader validate` (the Validate button) accepts the student version.
The result depends only on the source: releasing twice writes the same bytes.
"""

from __future__ import annotations

from pathlib import Path

import nbformat

from course.grading import cells

STUB = 'raise NotImplementedError("{gid}: replace this line with your solution")'
ANSWER = "YOUR ANSWER HERE"


def clear_solution(cell, index: int) -> None:
    place = cells.where(cell, index)
    if cell.cell_type == "markdown":
        if cells.info(cell).get("solution"):
            cell.source = ANSWER
        return
    lines = cell.source.splitlines()
    for begin, end in reversed(cells.regions(cell.source, "SOLUTION", place)):
        indent = lines[begin][: len(lines[begin]) - len(lines[begin].lstrip())]
        lines[begin : end + 1] = [indent + STUB.format(gid=cells.grade_id(cell) or f"cell {index}")]
    cell.source = "\n".join(lines)


def clear_hidden_tests(cell, index: int) -> None:
    if cell.cell_type != "code":
        return
    lines = cell.source.splitlines()
    for begin, end in reversed(
        cells.regions(cell.source, "HIDDEN TESTS", cells.where(cell, index))
    ):
        del lines[begin : end + 1]
    cell.source = "\n".join(lines).rstrip()


def clear_outputs(cell) -> None:
    if cell.cell_type == "code":
        cell.outputs = []
        cell.execution_count = None
    for key in ("papermill", "execution", "collapsed", "scrolled"):
        cell.metadata.pop(key, None)


def lock(cell) -> None:
    """nbgrader's own checksum and cell type on every graded, solution or locked cell (as its
    ComputeChecksums pass does), so `nbgrader validate` can check a student's copy."""
    i = cells.info(cell)
    if i.get("grade") or i.get("solution") or i.get("locked"):
        cell.metadata["nbgrader"]["checksum"] = cells.nbgrader_checksum(cell)
        cell.metadata["nbgrader"]["cell_type"] = cell.cell_type


def student_version(nb):
    """The released notebook (a new object) from a solution notebook."""
    cells.validate(nb)
    nb = nbformat.from_dict(nb)  # a deep copy
    for index, cell in enumerate(nb.cells):
        clear_solution(cell, index)
        clear_hidden_tests(cell, index)
        clear_outputs(cell)
        lock(cell)
    nb.metadata.pop("papermill", None)
    nb.metadata.pop("widgets", None)
    return nb


def release(solution: Path | str, out: Path | str) -> Path:
    """Write the student version of ``solution`` to ``out``; return ``out``."""
    nb = nbformat.read(solution, as_version=4)
    try:
        student = student_version(nb)
    except cells.FormatError as exc:
        raise cells.FormatError(f"{Path(solution).name}: {exc}") from None
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(nbformat.writes(student) + "\n", encoding="utf-8")
    return out


def release_all(solutions: Path | str, labs: Path | str) -> list[Path]:
    """Release every notebook under ``solutions`` into the same place under ``labs``."""
    solutions, labs = Path(solutions), Path(labs)
    written = []
    for src in sorted(solutions.rglob("*.ipynb")):
        # build/ holds what a lab writes when it runs (lab 06's sweep points): not a lab
        if {".ipynb_checkpoints", "build"} & set(src.relative_to(solutions).parts):
            continue
        written.append(release(src, labs / src.relative_to(solutions)))
    return written
