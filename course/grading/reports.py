"""What the grader writes for people: the gradebook, one feedback page per student, a summary.

``write_gradebook`` replaces gradebook.csv atomically (a reader never sees half a file; the
batch rewrites it after every submission). ``write_feedback`` writes the student's page: the
points of each question, the notes on their notebook, the isolation it ran under, and the
notebook as graded (at most PAGE_LIMIT of it). ``summary`` is the line `course grade` prints at
the end. In every CSV the grader writes, a text a student controls goes through ``to_cell``
(a spreadsheet never runs it as a formula) and reads back exactly through ``from_cell``.
Trusts: the Results the grader made (scores, statuses, its own notes). Does not trust: the
executed notebook and every text that came from the submission (its sources, outputs, names
and error messages), shown as escaped text only, Markdown rendered with its raw HTML escaped,
figures as data images that must be base64; the page's Content-Security-Policy forbids
scripts, frames and remote loads even if something slips by.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import html
import io
import os
import re
from collections import Counter
from pathlib import Path

import nbformat

from course.grading.results import Question, Result, pending
from course.grading.sandbox import SUBMISSION_OUTPUT_LIMIT

# A leading = + - @ (or tab, CR) makes a formula in Excel and LibreOffice (CSV injection); the
# apostrophe is the spreadsheets' own "this is text" mark, so a text starting with one is
# quoted too, and reading back removes exactly one.
QUOTED = ("=", "+", "-", "@", "\t", "\r", "'")


def to_cell(value: str) -> str:
    """A field a student controls (a name, an error message) as a CSV cell a spreadsheet will
    not run: a leading apostrophe before one that starts like a formula, or with an apostrophe,
    so that ``from_cell`` gives back exactly ``value``."""
    return "'" + value if value[:1] in QUOTED else value


def from_cell(cell: str) -> str:
    """``to_cell`` undone: the text itself, whatever a spreadsheet showed."""
    return cell[1:] if cell[:1] == "'" else cell


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
            "flags",  # what a person should read: a restored cell, a rebound helper (assemble)
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
        w.writerow(
            [
                to_cell(name),
                *row,
                r.total,
                top,
                " ".join(waiting),
                r.status,
                to_cell(r.reason),
                to_cell(" | ".join(r.flags)),
            ]
        )
    return write_atomic(out / "gradebook.csv", buf.getvalue())


def write_atomic(path: Path, text: str) -> Path:
    """``text`` at ``path``, replaced whole (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        # a lone surrogate (JSON may hold one in a student's text) is written escaped: never an
        # error that would stop the batch
        tmp.write_text(text, encoding="utf-8", errors="backslashreplace")
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
    "div.md{overflow-x:auto}div.md table{border-collapse:collapse}"
    "div.md td,div.md th{border:1px solid #bbb;padding:.2em .5em}"
    "</style>"
)
MARKDOWN_CHARS = 100_000  # of one Markdown cell rendered (mistune is linear: ~0.3 s per 100 kB)
# of the notebook one feedback page shows, in bytes: the runner's cap on a notebook's outputs
# (sandbox.SUBMISSION_OUTPUT_LIMIT), however much escaping adds ('<' is '&lt;')
PAGE_LIMIT = SUBMISSION_OUTPUT_LIMIT
NOTEBOOK = "<!-- the notebook as graded -->"  # where a page's notebook part starts (see _notebook)


@functools.lru_cache(maxsize=1)
def _renderer():
    import mistune  # pinned in pyproject.toml (nbconvert brings it too)

    return mistune.create_markdown(escape=True, plugins=["table", "strikethrough"])


def markdown(text: str) -> str:
    """Markdown as HTML (tables, emphasis, code), its author's raw HTML escaped as text (a
    student's ``<script>`` reads as written); a cell too long to render, or one the renderer
    fails on, as escaped text."""
    if len(text) <= MARKDOWN_CHARS:
        with contextlib.suppress(Exception):  # RecursionError, or the renderer's own bug
            return f"<div class='md'>{_renderer()(text)}</div>"
    return f"<pre>{html.escape(text)}</pre>"


def _heading(cell, by_id: dict) -> str:
    """A cell's heading: its question and points where it is graded, else In / markdown."""
    gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
    q = by_id.get(gid)
    if q is None:
        return f"<h4>{'In' if cell.cell_type == 'code' else cell.cell_type}</h4>"
    kind = "your answer, read by the instructor" if q.manual else "automatic test"
    return f"<h4 class='graded'>{html.escape(q.grade_id)} · {q.points:g} points · {kind}</h4>"


def _cell_html(cell, by_id: dict):
    """A cell's parts as HTML: its heading, its source (Markdown rendered, code as text), then
    each output as escaped text (PNG figures as data images)."""
    source = cell.source if isinstance(cell.source, str) else "".join(cell.source)
    shown = (
        markdown(source) if cell.cell_type == "markdown" else f"<pre>{html.escape(source)}</pre>"
    )
    yield _heading(cell, by_id) + shown
    for o in cell.get("outputs", []):
        kind = o.get("output_type")
        if kind == "stream" and o.get("name") == "grader":  # the runner's own notes only
            yield (
                "<div class='grader'><b>Note from the grader</b><pre>"
                + html.escape(str(o.get("text", "")))
                + "</pre></div>"
            )
        elif kind == "stream":
            yield (
                f"<pre class='{o.get('name') == 'stderr' and 'err' or 'out'}'>"
                + html.escape(ANSI.sub("", str(o.get("text", ""))))
                + "</pre>"
            )
        elif kind == "error":
            text = "\n".join(o.get("traceback") or []) or f"{o.get('ename')}: {o.get('evalue')}"
            yield f"<pre class='err'>{html.escape(ANSI.sub('', text))}</pre>"
        elif kind in ("execute_result", "display_data"):
            data = o.get("data", {})
            png = data.get("image/png")
            if isinstance(png, str) and PNG.fullmatch(png):
                yield f"<img alt='figure' src='data:image/png;base64,{png.strip()}'>"
            elif "text/plain" in data:
                text = data["text/plain"]
                text = text if isinstance(text, str) else "".join(text)
                yield f"<pre>{html.escape(text)}</pre>"


def notebook_as_text(nb, qs: list[Question] = ()) -> str:
    """The notebook as HTML with no HTML of the student's (``_cell_html``), graded cells headed
    by their question and points (``qs``); cut, with a note, where it would pass PAGE_LIMIT."""
    out, size, by_id = [], 0, {q.grade_id: q for q in qs}
    for cell in nb.cells:
        for part in _cell_html(cell, by_id):
            size += len(part.encode(errors="backslashreplace"))
            if size > PAGE_LIMIT:
                out.append(
                    "<div class='grader'><b>Note from the grader</b><pre>the rest of your "
                    f"notebook is not shown: a page shows at most {PAGE_LIMIT:,} bytes of it "
                    "(print less)</pre></div>"
                )
                return "".join(out)
            out.append(part)
    return "".join(out)


def _notebook(r: Result, qs: list[Question], out: Path, again: bool) -> str:
    """The page's notebook part: rendered from the executed notebook while it exists, else, for
    a page written ``again`` (`course mark`), the part the page holds (the executed notebook goes
    once its page is written). Everything before NOTEBOOK is the grader's escaped text, so the
    first NOTEBOOK of a page is where its notebook starts."""
    executed = getattr(r, "executed", None)
    if executed and Path(executed).exists():
        notebook = nbformat.read(executed, as_version=4)
        return f"{NOTEBOOK}<h2>Your notebook, as graded</h2>{notebook_as_text(notebook, qs)}"
    page = out / "feedback" / f"{r.student}.html"
    if not again or not page.exists():
        return ""
    text = page.read_text(encoding="utf-8", errors="replace")
    return text[text.find(NOTEBOOK) :] if NOTEBOOK in text else ""


def points_line(r: Result, qs: list[Question]) -> str:
    """ "6 / 7 points", and how many written answers a person has still to read."""
    waiting = len(pending(r, qs))
    line = f"{r.total:g} / {sum(q.points for q in qs):g} points"
    if waiting:
        line += f" ({waiting} written answer{'s' * (waiting > 1)} to be read)"
    return line


def write_feedback(r: Result, qs: list[Question], out: Path, again: bool = False) -> Path:
    """The student's page; ``again``: the page of this same result, written again with its marks
    (`course mark`), keeps the notebook it shows."""

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
        # Nothing in this page may run: a submission's outputs are shown as text, its Markdown
        # with its HTML escaped, and the policy forbids scripts, frames and remote loads even
        # if something slips by.
        "<!doctype html><meta charset='utf-8'>",
        f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\">",
        f"<title>Feedback: {html.escape(r.student)}: {points_line(r, qs)}</title>",
        STYLE,
        f"<h1>{html.escape(r.student)}: {points_line(r, qs)}</h1>",
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
    parts.append(_notebook(r, qs, out, again))
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
