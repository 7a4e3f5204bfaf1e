"""Reading a submission safely: a notebook file, or a folder holding one, or a reason why not.

The grader may run as root, and a submission is anything a student could upload: a symbolic
link, a hard link or a device file could make it read the solutions or a classmate's work and
show them in the feedback, a FIFO could hang it, a huge file could exhaust its memory. So a
folder is walked without following links and refused whole if anything in it is not a plain
file or folder; the notebook is opened without following a link, checked to be a regular file
with one name, read up to a cap, and parsed as JSON, then as a notebook.
``names`` gives each submission the name it is graded under, or a reason it cannot be: a name
becomes file names (results/NAME.json, feedback/NAME.html) and the gradebook's rows, so one that
is not UTF-8, hidden, too long, or shared by two entries is refused alone, under a name of its
own that no other entry takes.
A folder `course collect` (course.exchange) filled holds the notebook it took, or instead a
note (NOT_COLLECTED) saying why it took none: no notebook in the home, or one refused by these
same rules; that note is the reason the gradebook gives.
Trusts: nothing of the submission; a refusal is a reason the student reads in the feedback.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from pathlib import Path

import nbformat

MAX_SUBMISSION = 64 * 2**20  # bytes of a submitted notebook, outputs included
# A lab has about 60 cells and 100 kB of source. A notebook of a million empty cells is small
# on disk and took the grader to 7 GB (nbformat, assembly, the feedback page): refused on its
# count, before any of that, as a source bigger than any answer needs.
MAX_CELLS = 2_000
MAX_SOURCE = 4 * 2**20  # characters of source, all cells together
NAME_BYTES = 200  # of a student's name, which becomes file names (results/NAME.json)


def shown(name: str) -> str:
    """A file name as text that can be written anywhere: bytes that are not UTF-8 as \\xNN."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def _notebooks_in(folder: Path) -> tuple[list[Path], str | None]:
    """The folder's notebooks, walking without following links; a reason if anything is unsafe.

    The grader may run as root: a link (or a hard link, or a device file) in a submission could
    make it read the solutions or a classmate's work and show them in the feedback.
    """
    found, unreadable = [], []
    for root, dirs, files in os.walk(folder, followlinks=False, onerror=unreadable.append):
        for name in dirs + files:
            p = Path(root, name)
            try:
                st = p.lstat()
            except OSError as exc:
                unreadable.append(exc)
                break
            rel = p.relative_to(folder)
            if p.is_symlink():
                why = "is a symbolic link: links are not accepted in a submission"
                return [], f"{shown(str(rel))} {why}"
            if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                return [], f"{shown(str(rel))} is not a regular file: submit only files and folders"
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                return [], f"{shown(str(rel))} is a hard link to another file: submit a copy"
        if unreadable:
            break
        dirs[:] = [d for d in dirs if d != ".ipynb_checkpoints"]
        found += [Path(root, f) for f in files if f.endswith(".ipynb")]
    if unreadable:  # a folder nested past the path limit, or one the grader cannot list
        why = unreadable[0].strerror or type(unreadable[0]).__name__
        return [], f"part of the submission cannot be read ({why}): submit a shallower folder"
    return sorted(found), None


def read_regular(path: Path, dir_fd: int | None = None) -> tuple[bytes | None, str | None]:
    """The bytes of a regular file opened without following a link, or a reason. ``dir_fd``:
    ``path`` is a name in that open folder (course.exchange walks a home that way)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            return None, f"{shown(path.name)} is a symbolic link: submit the notebook itself"
        return None, f"{shown(path.name)} cannot be read safely ({exc.strerror})"
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return None, f"{shown(path.name)} is not a regular file"
        if st.st_nlink > 1:
            return None, f"{shown(path.name)} is a hard link to another file: submit a copy"
        raw = f.read(MAX_SUBMISSION + 1)
        if len(raw) > MAX_SUBMISSION:
            return None, (
                f"{shown(path.name)} is over {MAX_SUBMISSION // 2**20} MiB: clear its outputs "
                "(Edit > Clear Outputs of All Cells) and submit again"
            )
        return raw, None


def _over_caps(data: dict) -> str | None:
    """Why a parsed notebook is too big to grade (MAX_CELLS, MAX_SOURCE), or None."""
    cells = data.get("cells")
    if "cells" not in data and isinstance(data.get("worksheets"), list):  # nbformat 3
        cells = [
            c for ws in data["worksheets"] if isinstance(ws, dict) for c in ws.get("cells", [])
        ]
    if not isinstance(cells, list):
        return None  # nbformat says what is wrong with it
    if len(cells) > MAX_CELLS:
        return (
            f"{len(cells):,} cells, over the limit of {MAX_CELLS:,}: delete the scratch cells "
            "and submit again"
        )
    size = 0
    for cell in cells:
        source = cell.get("source", "") if isinstance(cell, dict) else ""
        if isinstance(source, list):  # lines; anything else in it is nbformat's to refuse
            size += sum(len(line) for line in source if isinstance(line, str))
        elif isinstance(source, str):
            size += len(source)
    if size > MAX_SOURCE:
        return (
            f"{size:,} characters of source, over the limit of {MAX_SOURCE:,}: "
            "paste data into a file, not into cells"
        )
    return None


def student_name(path: Path) -> str:
    """The name a submission is graded under: a file's without .ipynb, a folder's whole."""
    return path.stem if path.is_file() else path.name


COLLECTED = "collected.json"  # `course collect`'s manifest, beside the students' folders
NOT_COLLECTED = "NOT_COLLECTED.txt"  # in a student's folder: why `course collect` took nothing
# What tools leave in a folder of submissions, never a student's: skipped with a note
TOOL_LITTER = {
    ".ipynb_checkpoints": "Jupyter's checkpoints, not a submission",
    ".DS_Store": "macOS's folder settings, not a submission",
    COLLECTED: "course collect's manifest, not a submission",
}


def unnamable(name: str) -> str | None:
    """Why no submission can be graded under ``name`` (None: it can)."""
    if shown(name) != name:  # it would not survive gradebook.csv, a sheet or an LMS
        return "the name is not UTF-8: rename it (e.g. to the student's id) and grade again"
    if name.startswith("."):
        return "the name starts with '.', as hidden files do: rename it if it is a submission"
    if len(name.encode()) > NAME_BYTES:
        return f"the name is over {NAME_BYTES} bytes: rename the submission and grade again"
    return None


def names(entries: list[Path]) -> list[tuple[Path, str, str | None]]:
    """(entry, the name it is graded under, why it is refused or None) for each of ``entries``,
    in their order. An entry graded keeps ``student_name``; one refused (its name ``unnamable``,
    or shared with another entry: a folder bob/ beside bob.ipynb would overwrite one grade) gets
    a readable name that no entry graded or refused takes ("bob (file) #2" beside a student's
    own "bob (file).ipynb"), so no row of the gradebook overwrites another."""
    by_name: dict[str, list[Path]] = {}
    for p in entries:
        by_name.setdefault(student_name(p), []).append(p)
    kept = {name for name, same in by_name.items() if len(same) == 1 and not unnamable(name)}
    taken, out = set(kept), []
    for p in entries:
        name = student_name(p)
        if name in kept:
            out.append((p, name, None))
            continue
        why, label = unnamable(name), shown(name)
        if why is None:
            same = by_name[name]
            listed = ", ".join(sorted(q.name for q in same))
            why = f"{len(same)} submissions are named {name!r} ({listed}): keep one"
            label = f"{name} ({'folder' if p.is_dir() else 'file'})"
        if len(label.encode()) > NAME_BYTES:
            label = f"{label[:40]}…{hashlib.sha256(os.fsencode(name)).hexdigest()[:8]}"
        out.append((p, _unique(label, taken), why))
    return out


def _unique(label: str, taken: set) -> str:
    """``label``, or ``label #2``, ``#3``... the first that is not ``taken``; now taken."""
    name, n = label, 1
    while name in taken:
        n += 1
        name = f"{label} #{n}"
    taken.add(name)
    return name


def _collect_note(folder: Path) -> str | None:
    """The reason `course collect` left in ``folder`` (NOT_COLLECTED) for taking no notebook,
    or None where it left none."""
    raw, _ = read_regular(folder / NOT_COLLECTED)
    text = raw[:2000].decode("utf-8", "replace").strip() if raw else ""
    return text or None


def load_submission(path: Path):
    """(notebook, None) or (None, reason) for anything that is not a readable notebook."""
    if path.is_symlink():
        return None, f"{shown(path.name)} is a symbolic link: submit the notebook itself"
    if path.is_dir():
        found, refused = _notebooks_in(path)
        if refused:
            return None, refused
        if not found:
            return None, _collect_note(path) or "no .ipynb file in the submission folder"
        path = found[0]
    if path.suffix != ".ipynb":
        return None, f"not a notebook ({shown(path.name)})"
    raw, refused = read_regular(path)
    if refused:
        return None, refused
    if not raw.strip():
        return None, "empty file"
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"not valid JSON ({str(exc)[:80]})"
    if not isinstance(data, dict) or "cells" not in data and "worksheets" not in data:
        return None, "JSON, but not a notebook (no cells)"
    too_big = _over_caps(data)
    if too_big:
        return None, too_big
    try:
        nb = nbformat.reads(raw.decode("utf-8"), as_version=4)
    except Exception as exc:
        return None, f"unreadable notebook format ({type(exc).__name__}: {str(exc)[:80]})"
    return nb, None
