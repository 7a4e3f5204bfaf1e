"""Written answers, graded by a person: a sheet and a page per question, merged back.

    course grade LAB SUBS --out OUT   also writes, for every question a person grades,
        OUT/manual/<question>.csv    student, points (blank), comment, max, lab: fill it in a
                                     spreadsheet or an editor (a TA can take one question)
        OUT/manual/<question>.html   the question as the lab asks it, then the whole class's
                                     answers to it, each beside the model answer, with a link
                                     to the student's feedback (figures)
    course mark LAB OUT              checks every sheet, then merges it: results, gradebook
                                     (total and max count a written answer once it has points;
                                     "pending" lists the rest), feedback pages with the comments
    course export OUT                lms.csv: one row per student, for an LMS's grade import

A re-run of `course grade` keeps what the sheets hold for the students it still grades, drops
the rows of those it no longer does, and adds rows for new students (with the points their
saved result already has). Names go through reports.to_cell and read back exactly; a sheet
saved with a byte-order mark (Excel's "CSV UTF-8") reads as one without. `mark` refuses, before
changing anything, a sheet of another lab version, an unknown student, a student twice, points
that are not a number in [0, max], and a sheet of no question.
Trusts: the lab, and the sheets (the instructor's). Does not trust: the answers, shown with
their HTML escaped.
"""

from __future__ import annotations

import csv
import hashlib
import html
import io
import math
import urllib.parse
from pathlib import Path

from course.grading import cells
from course.grading.reports import CSP, STYLE, from_cell, markdown, to_cell, write_atomic
from course.grading.results import Question, Result, pending

FOLDER = "manual"
COLUMNS = ["student", "points", "comment", "max", "lab"]
ANSWER_CHARS = 20_000  # of one written answer, kept in the result for the sheet's page


def lab_version(source_bytes: bytes) -> str:
    """The lab's version as the sheets carry it: the start of its SHA-256."""
    return hashlib.sha256(source_bytes).hexdigest()[:12]


def answers_of(notebook, qs: list[Question]) -> dict[str, str]:
    """{question: the student's answer} for the questions a person grades."""
    manual = {q.grade_id for q in qs if q.manual}
    out = {}
    for cell in notebook.cells:
        gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        if gid in manual and gid not in out:
            out[gid] = str(cell.source)[:ANSWER_CHARS]
    return out


def asked(source, qs) -> dict[str, tuple[str, str]]:
    """{written question: (its text, the answer's cell type)}; the text is the Markdown cell
    just before the answer in the lab, where the labs ask it ("" where that is no question)."""
    written = {q.grade_id for q in qs if q.manual}
    found = {}
    for i, cell in enumerate(source.cells):
        gid = cells.grade_id(cell)
        if gid in written and gid not in found:
            before = source.cells[i - 1] if i else None
            found[gid] = (_question(before), cell.cell_type)
    return found


def _question(cell) -> str:
    """A cell's text where it asks a question: Markdown, neither graded nor an answer."""
    if cell is None or cell.cell_type != "markdown":
        return ""
    return "" if cells.is_graded(cell) or cells.info(cell).get("solution") else str(cell.source)


def _read(path: Path) -> list[dict]:
    # utf-8-sig: Excel's "CSV UTF-8" starts with a byte-order mark, which would be read as part
    # of the first column's name
    with open(path, newline="", encoding="utf-8-sig") as f:
        return list(csv.DictReader(f))


def _row(q: Question, student: str, r: Result, version: str) -> dict:
    """A new row of ``q``'s sheet: blank, or the points and comment ``r`` already holds (a
    student graded again after a re-run dropped them loses no marks)."""
    points = r.scores.get(q.grade_id)
    return {
        "student": to_cell(student),  # "=cmd()" stays text in a spreadsheet, and reads back
        "points": "" if points is None else f"{points:g}",
        "comment": (r.comments or {}).get(q.grade_id, ""),
        "max": f"{q.points:g}",
        "lab": version,
    }


def write_sheets(out: Path, source, source_bytes: bytes, qs, results: dict[str, Result]) -> None:
    """A sheet and a page per written question: the rows already in a sheet are kept as they
    are, but those of students graded here before and not now (their saved results keep what
    `course mark` merged; a row of no student at all stays for `mark` to refuse), and new
    students get a row."""
    folder = out / FOLDER
    folder.mkdir(exist_ok=True)
    version = lab_version(source_bytes)
    model, questions = answers_of(source, qs), asked(source, qs)
    gone = {p.stem for p in (out / "results").glob("*.json")} - set(results)
    for q in (q for q in qs if q.manual):
        sheet = folder / f"{q.grade_id}.csv"
        rows = [r for r in (_read(sheet) if sheet.exists() else []) if _student(r) not in gone]
        have = {_student(row) for row in rows}
        rows += [_row(q, s, results[s], version) for s in sorted(results) if s not in have]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        write_atomic(sheet, buf.getvalue())
        question, kind = questions.get(q.grade_id, ("", "markdown"))
        page = _page(q, question, kind, model.get(q.grade_id, ""), results)
        write_atomic(folder / f"{q.grade_id}.html", page)


def _student(row: dict) -> str:
    """The student of a sheet's row, exactly as graded: " carol" is not "carol"."""
    return from_cell(row.get("student") or "")


def _page(q: Question, question: str, kind: str, model: str, results: dict[str, Result]) -> str:
    """The page a person marks ``q`` from: the question, the model answer, every answer (a
    written answer's Markdown rendered, its HTML escaped; a code answer as text)."""
    shown = markdown if kind == "markdown" else lambda text: f"<pre>{html.escape(text)}</pre>"
    parts = [
        "<!doctype html><meta charset='utf-8'>",
        f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\">",
        f"<title>{html.escape(q.grade_id)}: up to {q.points:g} points</title>",
        STYLE,
        f"<h1>{html.escape(q.grade_id)} · {q.points:g} points</h1>",
        f"<p>Enter points (0–{q.points:g}) and a comment per student in "
        f"<code>{html.escape(q.grade_id)}.csv</code> beside this page, then run "
        "<code>course mark LAB OUT</code>.</p>",
        f"<h2>The question</h2>{markdown(question)}" if question else "",
        f"<h2>Model answer</h2>{shown(model)}",
    ]
    for name in sorted(results):
        text = (results[name].answers or {}).get(q.grade_id)
        link = html.escape(f"../feedback/{urllib.parse.quote(name)}.html")
        parts.append(
            f"<h2 id='{html.escape(name)}'>{html.escape(name)}</h2>"
            f"<p><a href='{link}'>their notebook as graded, figures included</a></p>"
            + (shown(text) if text else "<p><i>no answer</i></p>")
        )
    return "".join(parts)


def _points(value: str, q: Question, where: str) -> float | None:
    if not value.strip():
        return None  # not graded yet
    try:
        points = float(value)
    except ValueError:
        raise ValueError(f"{where}: points {value!r} is not a number") from None
    if not math.isfinite(points) or not 0 <= points <= q.points:
        raise ValueError(f"{where}: points {value} outside 0–{q.points:g}")
    return points


def read_marks(out: Path, source_bytes: bytes, qs, students) -> dict:
    """{question: {student: (points or None, comment)}} from the sheets, every one checked:
    a ValueError names the first problem, and nothing is merged."""
    folder, version = out / FOLDER, lab_version(source_bytes)
    manual = {q.grade_id: q for q in qs if q.manual}
    marks: dict = {}
    for sheet in sorted(folder.glob("*.csv")):
        q = manual.get(sheet.stem)
        if q is None:
            raise ValueError(f"{sheet.name}: this lab has no written question {sheet.stem!r}")
        rows, seen = _read(sheet), {}
        if rows and set(COLUMNS) - set(rows[0]):
            raise ValueError(f"{sheet.name}: columns must be {', '.join(COLUMNS)}")
        for i, row in enumerate(rows, 2):  # line 1 is the header
            where = f"{sheet.name} line {i}"
            student = _student(row)
            if (row.get("lab") or "").strip() != version:
                raise ValueError(
                    f"{where}: the sheet is for lab version {row.get('lab')!r}, this lab is "
                    f"{version}: grade it again with this lab, or mark with the lab you graded"
                )
            if student not in students:
                raise ValueError(f"{where}: no student {student!r} was graded in this folder")
            if student in seen:
                raise ValueError(f"{where}: {student!r} is also on line {seen[student]}")
            seen[student] = i
            comment = (row.get("comment") or "").strip()
            marks.setdefault(q.grade_id, {})[student] = (
                _points(row.get("points") or "", q, where),
                comment,
            )
    return marks


def apply(results: dict[str, Result], marks: dict) -> None:
    """Put the marks into the results: points (None: still pending) and comments."""
    for gid, by_student in marks.items():
        for student, (points, comment) in by_student.items():
            r = results[student]
            r.scores[gid] = points
            r.comments = {**(r.comments or {}), gid: comment} if comment else r.comments


def export_lms(results: dict[str, Result], qs, out: Path, title: str) -> Path:
    """lms.csv: the columns an LMS gradebook import maps (student, the assignment's points, its
    maximum), the written answers included once marked; a pending one is said, not zeroed."""
    buf = io.StringIO()
    w = csv.writer(buf)
    full = sum(q.points for q in qs)
    w.writerow(["Student", f"{title} ({full:g})", "Max", "Pending written answers"])
    for name in sorted(results):
        r = results[name]
        w.writerow([to_cell(name), f"{r.total:g}", f"{full:g}", " ".join(pending(r, qs))])
    path = out / "lms.csv"
    write_atomic(path, buf.getvalue())
    return path
