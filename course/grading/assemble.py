"""The notebook to grade: the student's answers in the source's frame, its tests cut to probes.

``assemble`` matches the submission's cells to the solution notebook's by grade_id, so inserted,
moved or split cells do not matter. Answer cells keep only the student's text, in the cell the
source defines (its type and metadata); tests (with their hidden part) and locked cells come
from the source, and edited or deleted ones are restored and flagged; the grading profile goes
after the notebook's own parameters. ``split_tests`` then cuts each test cell to its probe, all
the sandbox gets, and keeps the checks (hidden ones included) on the grader's side.
Trusts: the solution notebook and its released version (course.release). Does not trust: the
submission's cells, of which only the text of answers and of the student's own cells is kept
(no metadata, outputs or attachments, only a 'parameters' tag on a code cell of its own:
nothing else it wrote reaches the runner or the feedback).
"""

from __future__ import annotations

import nbformat

from course.grading import cells, tampering
from course.grading.results import is_answer
from course.release import student_version


def _student_cell(cell_type: str, text):
    """A fresh cell holding only the student's text: no metadata, outputs or attachments."""
    text = text if isinstance(text, str) else "".join(text or [])
    if cell_type == "code":
        return nbformat.v4.new_code_cell(text)
    if cell_type == "markdown":
        return nbformat.v4.new_markdown_cell(text)
    return nbformat.v4.new_raw_cell(text)


def assemble(source, submission, parameters: dict | None = None):
    """The notebook to run: the student's answers in the source's frame. Returns (nb, flags)."""
    released = {cells.grade_id(c): c for c in student_version(source).cells if cells.grade_id(c)}
    out, used, flags = _matched(source, submission, released)
    _restore_deleted(source, released, out, used, flags)
    flags += tampering.flags(source, out)  # for a person: no score changes
    nb = nbformat.v4.new_notebook(cells=out, metadata=source.metadata)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            if cells.is_graded(cell) and not is_answer(cell):
                cell.metadata["grader_test"] = True
    if parameters:
        code = "# Parameters (grading profile)\n" + "\n".join(
            f"{k} = {v!r}" for k, v in parameters.items()
        )
        nb.cells.insert(
            _profile_at(nb),
            nbformat.v4.new_code_cell(code, metadata={"tags": ["injected-parameters"]}),
        )
    return nb, flags


def _matched(source, submission, released: dict) -> tuple[list, set, list]:
    """The submission's cells in its order, each matched to the source's by grade_id: answers
    keep the student's text in the source's cell, tests and locked cells are the source's, and
    cells of the student's own keep only their text. Returns (cells, grade_ids used, flags)."""
    by_gid = {cells.grade_id(c): c for c in source.cells if cells.grade_id(c)}
    flags, used, out = [], set(), []
    for cell in submission.cells:
        gid = cells.grade_id(cell)
        if gid in used:
            flags.append(
                f"grade_id {gid!r} appears more than once: the copy was run as an ordinary cell"
            )
            gid = None
        src = by_gid.get(gid)
        if src is None:  # a cell the student added (or split off): its source, nothing else
            out.append(_student_cell(cell.cell_type, cell.source))
            if cell.cell_type == "code" and "parameters" in _tags(cell):
                out[-1].metadata["tags"] = ["parameters"]  # where the grading profile goes
            continue
        used.add(gid)
        if (
            cells.info(src).get("solution")
            and not cells.is_locked(src)
            or (cells.info(src).get("solution") and src.cell_type == "markdown")
        ):
            # The student's text in the source's frame: the source decides the cell's type
            # (a written answer turned into code stays text, it does not become a test) and
            # its metadata (nothing the submission wrote reaches the runner or the feedback).
            if cell.cell_type != src.cell_type:
                flags.append(
                    f"answer cell {gid!r} was changed to a {cell.cell_type} cell: "
                    f"graded as the {src.cell_type} cell it is"
                )
            new = _student_cell(src.cell_type, cell.source)
            new.metadata = nbformat.from_dict(src.metadata)
            out.append(new)
        else:
            if cell.cell_type != src.cell_type or cells.checksum(cell) != cells.checksum(
                released[gid]
            ):
                flags.append(f"locked cell {gid!r} was edited: restored from the source")
            out.append(nbformat.from_dict(src))
    return out, used, flags


def _restore_deleted(source, released: dict, out: list, used: set, flags: list) -> None:
    """Cells of the source the student deleted, put back into ``out`` after their predecessor
    (an answer as released: unanswered), each flagged."""
    for i, src in enumerate(source.cells):
        gid = cells.grade_id(src)
        if gid is None or gid in used:
            continue
        prev = next(
            (cells.grade_id(c) for c in reversed(source.cells[:i]) if cells.grade_id(c) in used),
            None,
        )
        at = next((k + 1 for k, c in enumerate(out) if prev and cells.grade_id(c) == prev), 0)
        if cells.info(src).get("solution") and not cells.is_graded(src):
            flags.append(f"answer cell {gid!r} is missing: graded as unanswered")
            out.insert(at, nbformat.from_dict(released[gid]))
        else:
            flags.append(f"cell {gid!r} was deleted: restored from the source")
            out.insert(at, nbformat.from_dict(src))
        used.add(gid)


def _tags(cell) -> list:
    tags = cell.get("metadata", {}).get("tags", [])
    return tags if isinstance(tags, list) else []


def _profile_at(nb) -> int:
    """Where the grading profile goes: after the notebook's own parameters cell, as papermill
    puts it, so the notebook's defaults never override it. The parameters cell has no grade_id
    (the student's copy of it is theirs); without its tag, the profile goes before the first
    cell of the source, which comes after the defaults in every lab."""
    tagged = [k for k, c in enumerate(nb.cells) if "parameters" in _tags(c)]
    if tagged:
        return tagged[-1] + 1
    return next(
        (k for k, c in enumerate(nb.cells) if c.cell_type == "code" and cells.grade_id(c)), 0
    )


def split_tests(nb) -> dict:
    """Cut each test cell of ``nb`` to its probe (all the sandbox gets); keep the checks here.

    Returns {grade_id: {'check': [(code, hidden), ...], 'names': what the check reads,
    'released': the cell as released}}.
    """
    tests = {}
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.metadata.get("grader_test"):
            probe, check = cells.split_test(cell.source)
            tests[cells.grade_id(cell)] = {
                "check": cells.segments(check),
                "names": cells.exports(cell.source),
                "released": cells.without_hidden(cell.source).rstrip(),
            }
            cell.metadata["grader_test"] = {"exports": cells.exports(cell.source)}
            cell.source = probe
    return tests
