"""Written answers, graded by a person: a sheet and a page per question, merged back.

    course grade LAB SUBS --out OUT   also writes, for every question a person grades,
        OUT/manual/<question>.csv    student, points (blank), comment, max, lab: fill it in a
                                     spreadsheet or an editor (a TA can take one question)
        OUT/manual/<question>.html   the whole class's answers to it, each beside the model
                                     answer, with a link to the student's feedback (figures)
    course mark LAB OUT              checks every sheet, then merges it: results, gradebook
                                     (total and max count a written answer once it has points;
                                     "pending" lists the rest), feedback pages with the comments
    course export OUT                lms.csv: one row per student, for an LMS's grade import

A re-run of `course grade` keeps what the sheets hold and adds rows for new students. `mark`
refuses, before changing anything, a sheet of another lab version, an unknown student, a
student twice, points that are not a number in [0, max], and a sheet of no question.
Trusts: the lab, and the sheets (the instructor's). Does not trust: the answers, shown escaped.
"""

from __future__ import annotations

import csv
import hashlib
import html
import io
import json
import math
import urllib.parse
from pathlib import Path

from course.grading.reports import CSP, STYLE, _text, write_atomic
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


FORMULA = ("=", "+", "-", "@", "\t", "\r", "'")


def _cell(name: str) -> str:
    """A student's name as a sheet holds it: a leading apostrophe before a name a spreadsheet
    would run as a formula (or that starts with one itself), so every name reads back exactly."""
    return "'" + name if name[:1] in FORMULA else name


def _name(cell: str) -> str:
    """The student's name from a sheet's cell: ``_cell`` undone."""
    return cell[1:] if cell[:1] == "'" else cell


def _read(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def write_sheets(out: Path, source, source_bytes: bytes, qs, results: dict[str, Result]) -> None:
    """A sheet and a page per written question; rows already in a sheet are kept as they are."""
    folder = out / FOLDER
    folder.mkdir(exist_ok=True)
    version = lab_version(source_bytes)
    model = answers_of(source, qs)
    for q in (q for q in qs if q.manual):
        sheet = folder / f"{q.grade_id}.csv"
        rows = _read(sheet) if sheet.exists() else []
        have = {_name(row.get("student") or "") for row in rows}
        rows += [
            # a name like "=cmd()" stays text in a spreadsheet (reports._text); mark reads it back
            {
                "student": _text(s),
                "points": "",
                "comment": "",
                "max": f"{q.points:g}",
                "lab": version,
            }
            for s in sorted(results)
            if s not in have
        ]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        write_atomic(sheet, buf.getvalue())
        write_atomic(folder / f"{q.grade_id}.html", _page(q, model.get(q.grade_id, ""), results))


def _page(q: Question, model: str, results: dict[str, Result]) -> str:
    parts = [
        "<!doctype html><meta charset='utf-8'>",
        f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\">",
        f"<title>{html.escape(q.grade_id)}</title>",
        STYLE,
        f"<h1>{html.escape(q.grade_id)} · {q.points:g} points</h1>",
        f"<p>Enter points (0–{q.points:g}) and a comment per student in "
        f"<code>{html.escape(q.grade_id)}.csv</code> beside this page, then run "
        "<code>course mark LAB OUT</code>.</p>",
        f"<h2>Model answer</h2><pre>{html.escape(model)}</pre>",
    ]
    for name in sorted(results):
        text = (results[name].answers or {}).get(q.grade_id)
        link = html.escape(f"../feedback/{urllib.parse.quote(name)}.html")
        parts.append(
            f"<h2 id='{html.escape(name)}'>{html.escape(name)}</h2>"
            f"<p><a href='{link}'>their notebook as graded, figures included</a></p>"
            + (f"<pre>{html.escape(text)}</pre>" if text else "<p><i>no answer</i></p>")
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
            student = _name(row.get("student") or "")  # exactly: " carol" is not "carol"
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
        w.writerow([_text(name), f"{r.total:g}", f"{full:g}", " ".join(pending(r, qs))])
    path = out / "lms.csv"
    write_atomic(path, buf.getvalue())
    return path


def load_results(out: Path) -> dict[str, Result]:
    return {
        p.stem: Result(**json.loads(p.read_text()))
        for p in sorted((out / "results").glob("*.json"))
    }
