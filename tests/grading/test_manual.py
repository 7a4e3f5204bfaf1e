"""Written answers graded by a person, end to end: `course grade` writes a sheet and a page per
written question, a person fills the sheet, `course mark` merges it into the results, the
gradebook and the feedback (refusing a bad sheet whole), `course export` writes the LMS file."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys

import nbformat
import pytest
from grading_fixtures import answer, cell_index, plain_submissions, source, write

from course.grade import grade
from course.release import student_version

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def course(*args):
    return subprocess.run(
        [sys.executable, "-m", "course.cli", *map(str, args)], capture_output=True, text=True
    )


def rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def fill(sheet, marks: dict, extra: list[dict] = ()):
    """The sheet as a person leaves it: points and comments on some rows."""
    table = rows(sheet)
    for row in table:
        row["points"], row["comment"] = marks.get(row["student"], ("", ""))
    with open(sheet, "w", newline="") as f:
        w = csv.DictWriter(f, list(table[0]))
        w.writeheader()
        w.writerows([*table, *extra])


QUESTION = "**Question (1 point).** Why is the square *never* negative?"
MARKDOWN = """*Because* `x * x` is x squared:

| x | x * x |
|---|---|
| -2 | 4 |

<script>alert(1)</script> <img src=x onerror=alert(2)>"""


def release_with_question(folder):
    """The toy lab with its written question asked in the Markdown cell before the answer, as
    the course's labs ask theirs."""
    nb = source()
    nb.cells.insert(cell_index(nb, "why"), nbformat.v4.new_markdown_cell(QUESTION))
    path = folder / "source" / "ps1.ipynb"
    path.parent.mkdir(parents=True)
    nbformat.write(nb, path)
    return path, student_version(nb)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("manual")
    lab, student = release_with_question(tmp)
    subs = plain_submissions(student)
    subs["correct"] = answer(student)
    subs["=2+3"] = answer(student)  # a folder name a spreadsheet would run as a formula
    subs["tables"] = answer(student)
    subs["tables"].cells[cell_index(subs["tables"], "why")].source = MARKDOWN
    names = ("correct", "wrong_square", "unanswered", "=2+3", "tables")
    write(tmp / "subs", {k: subs[k] for k in names})
    grade(lab, tmp / "subs", tmp / "out", progress=False)
    return lab, tmp / "subs", tmp / "out"


def test_grading_writes_a_sheet_and_a_page_per_written_question(graded):
    lab, _, out = graded
    sheet = rows(out / "manual" / "why.csv")
    students = [r["student"] for r in sheet]
    assert students == ["'=2+3", "correct", "tables", "unanswered", "wrong_square"]
    assert all(r["points"] == "" and r["max"] == "1" for r in sheet)
    page = (out / "manual" / "why.html").read_text()
    assert "A real number times itself is never negative." in page  # the student's answer
    assert "Model answer" in page and "../feedback/correct.html" in page
    # the question, as the lab asks it (its Markdown rendered), above the answers
    asked = "<strong>Question (1 point).</strong> Why is the square <em>never</em> negative?"
    assert asked in page and page.index(asked) < page.index("never negative.")
    book = {r["student"]: r for r in rows(out / "gradebook.csv")}
    assert book["correct"]["pending"] == "why" and book["correct"]["max"] == "6.0"
    # a page's title gives the points with the maximum, and says what is still to be read
    title = "<title>Feedback: correct: 6 / 7 points (1 written answer to be read)</title>"
    assert title in (out / "feedback" / "correct.html").read_text()


def test_markdown_is_rendered_and_the_students_html_stays_text(graded):
    """Feedback pages and the written question's page showed Markdown as raw text (a table as
    pipes); rendered now, a student's raw HTML escaped (and scripts forbidden by the page)."""
    _, _, out = graded
    for page in (out / "feedback" / "tables.html", out / "manual" / "why.html"):
        text = page.read_text()
        assert "<em>Because</em> <code>x * x</code>" in text and "<td>-2</td>" in text, page
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text and "<script" not in text, page
        assert "&lt;img src=x onerror=alert(2)&gt;" in text and "<img src=x" not in text, page
    lab = (out / "feedback" / "correct.html").read_text()
    assert "<h1>Problem set 1</h1>" in lab  # the lab's own Markdown too


@pytest.mark.parametrize(
    "marks, extra, error",
    [
        ({"correct": ("2", "")}, [], "points 2 outside 0–1"),
        ({"correct": ("one", "")}, [], "points 'one' is not a number"),
        ({"correct": ("nan", "")}, [], "outside 0–1"),
        ({}, [{"student": "mallory", "lab": None}], "no student 'mallory'"),
        ({}, [{"student": "correct", "lab": None}], "'correct' is also on line 3"),
        ({}, [{"student": "correct", "lab": "0123456789ab"}], "the sheet is for lab version"),
    ],
)
def test_a_bad_sheet_is_refused_whole_and_changes_nothing(graded, tmp_path, marks, extra, error):
    lab, _, out = graded
    copy = tmp_path / "out"
    shutil.copytree(out, copy, symlinks=True)
    sheet = copy / "manual" / "why.csv"
    version = rows(sheet)[0]["lab"]
    extra = [
        {
            "student": e["student"],
            "points": "1",
            "comment": "",
            "max": "1",
            "lab": e["lab"] or version,
        }
        for e in extra
    ]
    fill(sheet, {"wrong_square": ("1", "fine"), **marks}, extra)
    before = (copy / "gradebook.csv").read_text()
    done = course("mark", lab, copy)
    assert done.returncode == 2 and error in done.stderr, done.stderr
    assert (copy / "gradebook.csv").read_text() == before  # not even the good row went in


def test_a_sheet_of_no_question_and_another_lab_version_are_refused(graded, tmp_path):
    lab, _, out = graded
    copy = tmp_path / "out"
    shutil.copytree(out, copy, symlinks=True)
    shutil.copy(copy / "manual" / "why.csv", copy / "manual" / "how.csv")
    done = course("mark", lab, copy)
    assert done.returncode == 2 and "no written question 'how'" in done.stderr
    (copy / "manual" / "how.csv").unlink()
    edited = tmp_path / "ps1.ipynb"
    nb = nbformat.read(lab, as_version=4)
    nb.cells[0].source += " (v2)"
    nbformat.write(nb, edited)
    done = course("mark", edited, copy)
    assert done.returncode == 2 and "graded with another version" in done.stderr


def test_marks_merge_into_gradebook_feedback_and_the_lms_file(graded, tmp_path):
    lab, subs, out = graded
    fill(
        out / "manual" / "why.csv",
        {
            "correct": ("1", "Right: x·x ≥ 0 for every real x."),
            "wrong_square": ("0.5", ""),
            "'=2+3": ("1", ""),
        },
    )
    assert (
        "<title>Feedback: correct: 6 / 7 points" in (out / "feedback" / "correct.html").read_text()
    )
    done = course("mark", lab, out)
    assert done.returncode == 0, done.stderr
    book = {r["student"]: r for r in rows(out / "gradebook.csv")}
    assert (book["correct"]["why (1)"], book["correct"]["total"]) == ("1.0", "7.0")
    assert (book["correct"]["max"], book["correct"]["pending"]) == ("7.0", "")
    assert book["wrong_square"]["total"] == "3.5" and book["wrong_square"]["max"] == "7.0"
    assert book["unanswered"]["pending"] == "why" and book["unanswered"]["max"] == "6.0"
    assert book["'=2+3"]["total"] == "7.0"  # the name read back from its sheet, marked
    page = (out / "feedback" / "correct.html").read_text()
    assert "Right: x·x ≥ 0 for every real x." in page
    assert "<title>Feedback: correct: 7 / 7 points</title>" in page
    # the page written again keeps the notebook (its executed copy is gone from .work)
    assert (
        "Your notebook, as graded" in page
        and "<td>-2</td>" in (out / "feedback" / "tables.html").read_text()
    )
    # A re-run of `course grade` keeps the marks (and the sheets' filled rows).
    grade(lab, subs, out, progress=False)
    assert rows(out / "manual" / "why.csv")[0]["points"] == "1"
    assert course("mark", lab, out).returncode == 0
    done = course("export", lab, out, "--title", "Problem set 1")
    assert done.returncode == 0, done.stderr
    lms = {r["Student"]: r for r in rows(out / "lms.csv")}
    assert lms["correct"]["Problem set 1 (7)"] == "7" and lms["correct"]["Max"] == "7"
    assert lms["unanswered"]["Pending written answers"] == "why"


def test_the_sheets_page_reads_in_a_browser(graded, tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"no Chromium at {CHROMIUM}: scripts/setup.sh installs Debian's chromium")
    from playwright.sync_api import sync_playwright

    _, _, out = graded
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        view = browser.new_page(viewport={"width": 1280, "height": 800})
        view.goto((out / "manual" / "why.html").as_uri())
        text = view.inner_text("body")
        width = view.evaluate("document.documentElement.scrollWidth")
        browser.close()
    assert "why · 1 points" in text and "never negative" in text and width <= 1280


def test_a_sheet_saved_as_excels_csv_utf8_is_read(graded, tmp_path):
    """Excel's "CSV UTF-8" starts the file with a byte-order mark: it was refused."""
    lab, _, out = graded
    copy = tmp_path / "out"
    shutil.copytree(out, copy, symlinks=True)
    sheet = copy / "manual" / "why.csv"
    fill(sheet, {"correct": ("1", "")})
    sheet.write_bytes(b"\xef\xbb\xbf" + sheet.read_bytes().replace(b"\n", b"\r\n"))
    done = course("mark", lab, copy)
    assert done.returncode == 0, done.stderr
    assert {r["student"]: r for r in rows(copy / "gradebook.csv")}["correct"]["total"] == "7.0"


def test_mark_on_a_merged_folder_says_to_mark_each_slice_then_merge(graded, tmp_path):
    lab, _, out = graded
    merged = tmp_path / "merged"
    assert course("grade-merge", lab, merged, out).returncode == 0
    done = course("mark", lab, merged)
    assert done.returncode == 2 and "mark each slice" in done.stderr, done.stderr
    assert "mark each slice" in " ".join(course("mark", "--help").stdout.split())
    assert course("export", lab, merged).returncode == 0  # the merged folder exports


def test_grade_merge_refuses_slices_graded_with_two_profiles(tmp_path):
    lab, _ = release_with_question(tmp_path)
    (tmp_path / "subs").mkdir()
    slices = [tmp_path / "slice1", tmp_path / "slice2"]
    grade(lab, tmp_path / "subs", slices[0], shard=(1, 2), progress=False)
    grade(lab, tmp_path / "subs", slices[1], shard=(2, 2), progress=False, parameters={"n": 4})
    done = course("grade-merge", lab, tmp_path / "merged", *slices)
    assert done.returncode == 2 and "--profile" in done.stderr, done.stderr


def test_a_student_graded_no_more_stays_out_of_mark_and_export(tmp_path):
    """Graded with a and b, then the same --out from a folder without b: the gradebook dropped
    b, and `course mark` and `course export` brought b back from its saved result."""
    lab, student = release_with_question(tmp_path)
    out = tmp_path / "out"
    subs = write(tmp_path / "subs", {"a": answer(student), "b": answer(student)})
    grade(lab, subs, out, progress=False)
    fill(out / "manual" / "why.csv", {"a": ("1", ""), "b": ("1", "")})
    assert course("mark", lab, out).returncode == 0
    (subs / "b.ipynb").unlink()
    grade(lab, subs, out, progress=False)
    assert [r["student"] for r in rows(out / "gradebook.csv")] == ["a"]
    assert [r["student"] for r in rows(out / "manual" / "why.csv")] == ["a"]
    done = course("mark", lab, out)
    assert done.returncode == 0, done.stderr
    assert [r["student"] for r in rows(out / "gradebook.csv")] == ["a"]
    assert course("export", lab, out).returncode == 0
    assert [r["Student"] for r in rows(out / "lms.csv")] == ["a"]
    # b back: graded again under the marks it had, none lost
    write(subs, {"b": answer(student)})
    grade(lab, subs, out, progress=False)
    assert {r["student"]: r["why (1)"] for r in rows(out / "gradebook.csv")} == {
        "a": "1.0",
        "b": "1.0",
    }
