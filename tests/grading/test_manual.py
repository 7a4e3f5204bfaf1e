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
from grading_fixtures import answer, plain_submissions, release, write

from course.grade import grade

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


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("manual")
    lab, student = release(tmp)
    subs = plain_submissions(student)
    subs["correct"] = answer(student)
    subs["=2+3"] = answer(student)  # a folder name a spreadsheet would run as a formula
    write(tmp / "subs", {k: subs[k] for k in ("correct", "wrong_square", "unanswered", "=2+3")})
    grade(lab, tmp / "subs", tmp / "out", progress=False)
    return lab, tmp / "subs", tmp / "out"


def test_grading_writes_a_sheet_and_a_page_per_written_question(graded):
    lab, _, out = graded
    sheet = rows(out / "manual" / "why.csv")
    assert [r["student"] for r in sheet] == ["'=2+3", "correct", "unanswered", "wrong_square"]
    assert all(r["points"] == "" and r["max"] == "1" for r in sheet)
    page = (out / "manual" / "why.html").read_text()
    assert "A real number times itself is never negative." in page  # the student's answer
    assert "Model answer" in page and "../feedback/correct.html" in page
    book = {r["student"]: r for r in rows(out / "gradebook.csv")}
    assert book["correct"]["pending"] == "why" and book["correct"]["max"] == "6.0"


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
    assert "Your notebook, as graded" in page  # the page written again keeps the notebook
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
