"""The authoring format: nbgrader cell metadata and markers, read and checked in one place.

A cell's ``metadata.nbgrader`` holds ``grade_id``, ``grade`` (a test cell that earns points),
``solution`` (the student writes here), ``locked`` (the student must not change it), ``points``
and ``schema_version``. In code, ``### BEGIN SOLUTION`` / ``### END SOLUTION`` delimit what the
student version replaces; ``### BEGIN HIDDEN TESTS`` / ``### END HIDDEN TESTS`` what it omits.
"""

from __future__ import annotations

import hashlib
import re

MARKERS = {
    "SOLUTION": ("### BEGIN SOLUTION", "### END SOLUTION"),
    "HIDDEN TESTS": ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"),
}


class FormatError(ValueError):
    """The solution notebook breaks the authoring format; the message says where and how."""


def info(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {}) or {}


def grade_id(cell) -> str | None:
    return info(cell).get("grade_id")


def is_graded(cell) -> bool:
    return bool(info(cell).get("grade"))


def is_locked(cell) -> bool:
    i = info(cell)
    return bool(i.get("locked") or (i.get("grade") and not i.get("solution")))


def where(cell, index: int) -> str:
    gid = grade_id(cell)
    return f"cell {index}" + (f" ({gid})" if gid else "")


def regions(source: str, kind: str, place: str) -> list[tuple[int, int]]:
    """(begin line, end line) of every ``kind`` region; unclosed or nested markers raise."""
    begin, end = MARKERS[kind]
    out, start = [], None
    for i, line in enumerate(source.splitlines()):
        text = line.strip()
        if text == begin:
            if start is not None:
                raise FormatError(
                    f"{place}: '{begin}' on line {i + 1} inside another (line {start + 1})"
                )
            start = i
        elif text == end:
            if start is None:
                raise FormatError(f"{place}: '{end}' on line {i + 1} without a '{begin}' before it")
            out.append((start, i))
            start = None
    if start is not None:
        raise FormatError(f"{place}: '{begin}' on line {start + 1} is never closed by '{end}'")
    return out


def validate(nb) -> None:
    """Check the whole notebook: unique grade_ids, points on graded cells, closed markers."""
    seen: dict[str, int] = {}
    tagged = 0
    for index, cell in enumerate(nb.cells):
        place = where(cell, index)
        i = info(cell)
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            tagged += 1
        if i:
            gid = i.get("grade_id")
            if not gid:
                raise FormatError(f"{place}: nbgrader metadata without a grade_id")
            if not re.fullmatch(r"[A-Za-z0-9_\-]+", gid):
                raise FormatError(
                    f"{place}: grade_id {gid!r} may use letters, digits, _ and - only"
                )
            if gid in seen:
                raise FormatError(f"{place}: grade_id {gid!r} is already used by cell {seen[gid]}")
            seen[gid] = index
            if i.get("grade") and not isinstance(i.get("points"), (int, float)):
                raise FormatError(f"{place}: a graded cell needs points (metadata.nbgrader.points)")
        if cell.cell_type == "code":
            for kind in MARKERS:
                regions(cell.source, kind, place)
    if tagged > 1:
        raise FormatError(f"{tagged} cells are tagged 'parameters'; papermill needs exactly one")


def nbgrader_checksum(cell) -> str:
    """The checksum nbgrader itself stores and checks (nbgrader.utils.compute_checksum, 0.9):
    md5 of the source, the type, nbgrader's grade/solution/locked flags, the grade_id and the
    points. Written exactly so ``nbgrader validate`` and the Validate button accept our labs;
    recomputed here so releasing a lab does not need nbgrader installed."""
    i = info(cell)
    grade, solution = bool(i.get("grade", False)), bool(i.get("solution", False))
    locked = False if solution else (True if grade else bool(i.get("locked", False)))
    m = hashlib.md5()
    for part in (
        cell.source,
        cell.cell_type,
        str(i.get("grade", False)),
        str(i.get("solution", False)),
    ):
        m.update(part.encode("utf-8"))
    m.update(str(locked).encode("utf-8"))
    m.update(i["grade_id"].encode("utf-8"))
    if grade:
        m.update(str(float(i["points"])).encode("utf-8"))
    return m.hexdigest()


def checksum(cell) -> str:
    """What a locked cell must keep: its type and source (whitespace at line ends ignored)."""
    source = "\n".join(line.rstrip() for line in cell.source.strip().splitlines())
    return hashlib.sha256(f"{cell.cell_type}\n{source}".encode()).hexdigest()
