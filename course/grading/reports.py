"""What the grader writes for people: the gradebook, one feedback page per student, a summary.

``write_gradebook`` replaces gradebook.csv atomically (a reader never sees half a file; the
batch rewrites it after every submission). ``write_feedback`` writes the student's page: the
points of each question, the notes on their notebook, the isolation it ran under, and the
notebook as graded. ``summary`` is the line `course grade` prints at the end.
Trusts: the Results the grader made (scores, statuses, its own notes). Does not trust: the
executed notebook and every text that came from the submission (its sources, outputs, names
and error messages), shown as escaped text only, figures as data images that must be base64;
the page's Content-Security-Policy forbids scripts, frames and remote loads even if something
slips by.
"""

from __future__ import annotations

import csv
import html
import io
import os
import re
from collections import Counter
from pathlib import Path

import nbformat

from course.grading.results import Question, Result, pending


def _text(value: str) -> str:
    """A field a student controls (a folder's name, an error message) as text a spreadsheet will
    not run: a leading = + - @ (or tab, CR) makes a formula in Excel and LibreOffice (CSV
    injection), so it gets a leading apostrophe, the spreadsheets' own "this is text" mark."""
    return "'" + value if value[:1] in ("=", "+", "-", "@", "\t", "\r") else value


def write_gradebook(results: dict[str, Result], qs: list[Question], out: Path) -> Path:
    """gradebook.csv, replaced atomically (a reader never sees half a file)."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(
        [
            "student",
            *[f"{q.grade_id} ({q.points:g})" for q in qs],
            "total",
            "max",
            "pending",
            "status",
            "reason",
        ]
    )
    for name in sorted(results):
        r = results[name]
        row = [
            "manual"
            if r.scores.get(q.grade_id) is None and q.manual
            else r.scores.get(q.grade_id, 0)
            for q in qs
        ]
        # max: the automatic points, and each written answer's once a person has marked it
        waiting = pending(r, qs)
        top = sum(q.points for q in qs if q.grade_id not in waiting)
        w.writerow([_text(name), *row, r.total, top, " ".join(waiting), r.status, _text(r.reason)])
    return write_atomic(out / "gradebook.csv", buf.getvalue())


def write_atomic(path: Path, text: str) -> Path:
    """``text`` at ``path``, replaced whole (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:  # a full disk: the old file stays whole, and the half-written copy goes
        tmp.unlink(missing_ok=True)
        raise
    return path


CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
PNG = re.compile(r"[A-Za-z0-9+/=\s]+")


STYLE = (
    "<style>body{font-family:system-ui,sans-serif;max-width:110ch;margin:1em auto;padding:0 1em}"
    "pre{white-space:pre-wrap;overflow-wrap:anywhere;background:#f6f6f6;padding:.4em}"
    "pre.err{background:#fdecec}img{max-width:100%}td{vertical-align:top}"
    "td pre{margin:0;background:none;padding:0}h4{margin:1.2em 0 .2em}"
    "h4.graded{border-top:2px solid #888;padding-top:.4em}"
    "div.grader{border:2px solid #1a5fb4;padding:.3em;margin:.3em 0}div.grader pre{margin:0}"
    "</style>"
)


def _heading(cell, by_id: dict) -> str:
    """A cell's heading: its question and points where it is graded, else In / markdown."""
    gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
    q = by_id.get(gid)
    if q is None:
        return f"<h4>{'In' if cell.cell_type == 'code' else cell.cell_type}</h4>"
    kind = "your answer, read by the instructor" if q.manual else "automatic test"
    return f"<h4 class='graded'>{html.escape(q.grade_id)} · {q.points:g} points · {kind}</h4>"


def notebook_as_text(nb, qs: list[Question] = ()) -> str:
    """Cells and outputs as escaped text (PNG figures as data images): no HTML of the student's.
    Graded cells are headed by their question and points (``qs``)."""
    out, by_id = [], {q.grade_id: q for q in qs}
    for cell in nb.cells:
        out.append(f"{_heading(cell, by_id)}<pre>{html.escape(cell.source)}</pre>")
        for o in cell.get("outputs", []):
            kind = o.get("output_type")
            if kind == "stream" and o.get("name") == "grader":  # the runner's own notes only
                out.append("<div class='grader'><b>Note from the grader</b><pre>")
                out.append(html.escape(str(o.get("text", ""))) + "</pre></div>")
            elif kind == "stream":
                out.append(f"<pre class='{o.get('name') == 'stderr' and 'err' or 'out'}'>")
                out.append(html.escape(ANSI.sub("", str(o.get("text", "")))) + "</pre>")
            elif kind == "error":
                text = "\n".join(o.get("traceback") or []) or f"{o.get('ename')}: {o.get('evalue')}"
                out.append(f"<pre class='err'>{html.escape(ANSI.sub('', text))}</pre>")
            elif kind in ("execute_result", "display_data"):
                data = o.get("data", {})
                png = data.get("image/png")
                if isinstance(png, str) and PNG.fullmatch(png):
                    out.append(f"<img alt='figure' src='data:image/png;base64,{png.strip()}'>")
                elif "text/plain" in data:
                    text = data["text/plain"]
                    text = text if isinstance(text, str) else "".join(text)
                    out.append(f"<pre>{html.escape(text)}</pre>")
    return "".join(out)


def write_feedback(r: Result, qs: list[Question], out: Path) -> Path:
    def score(q):
        if r.scores.get(q.grade_id) is None:
            return "pending: read by the instructor" if q.manual else "0"
        return f"{r.scores[q.grade_id]:g}"

    rows = "".join(
        f"<tr><td>{q.grade_id}</td><td>{score(q)}</td><td>{q.points:g}</td>"
        f"<td><pre>{html.escape(r.errors.get(q.grade_id, ''))}</pre></td>"
        f"<td>{html.escape((r.comments or {}).get(q.grade_id, ''))}</td></tr>"
        for q in qs
    )
    parts = [
        # Nothing in this page may run: a submission's outputs and markdown are shown as text,
        # and the policy forbids scripts, frames and remote loads even if something slips by.
        "<!doctype html><meta charset='utf-8'>",
        f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\">",
        f"<title>Feedback: {html.escape(r.student)}</title>",
        STYLE,
        f"<h1>{html.escape(r.student)}: {r.total:g} points</h1>",
        f"<p>Status: <b>{r.status}</b> {html.escape(r.reason)}</p>",
        "<table border=1 cellpadding=4><tr><th>question</th><th>points</th><th>of</th>"
        "<th>error</th><th>the instructor's comment</th></tr>",
        rows,
        "</table>",
    ]
    if r.flags:
        parts.append(
            "<h2>Notes</h2><ul>" + "".join(f"<li>{html.escape(f)}</li>" for f in r.flags) + "</ul>"
        )
    parts.append(  # for the instructor: folded
        "<details><summary>How it ran (isolation, for the instructor)</summary><ul>"
        + "".join(f"<li>{html.escape(f)}</li>" for f in r.isolation)
        + "</ul></details>"
    )
    executed = getattr(r, "executed", None)
    if executed and Path(executed).exists():
        parts.append(
            "<h2>Your notebook, as graded</h2>"
            + notebook_as_text(nbformat.read(executed, as_version=4), qs)
        )
    path = out / "feedback" / f"{r.student}.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, "".join(parts))


def summary(results: dict[str, Result]) -> str:
    if not results:
        return "no submissions"
    totals = [r.total for r in results.values()]
    reasons = Counter(r.status for r in results.values() if r.status != "graded")
    text = f"{len(results)} submissions, mean {sum(totals) / len(totals):.2f} points"
    if reasons:
        text += "; not fully run: " + ", ".join(f"{k} {v}" for k, v in reasons.most_common())
    return text
