"""Attacks on `course grade` through the notebook's structure, the feedback and the files.

Each submission is built from the fixture assignment (tests/grading_fixtures.py) the way a
student who wants points without the work would build it, and graded for real. What is
asserted: the points it really earned, nothing more, and nothing hidden shown back to it.
(Attacks that forge a test's verdict from inside the kernel are issue 11's item 1, not here.)
"""

from __future__ import annotations

import os
import tempfile

import nbformat
import pytest
from grading_fixtures import answer, cell_index, release, write
from nbformat.v4 import new_code_cell, new_markdown_cell

from course.grade import Limits, grade, load_submission

LIMITS = Limits(cell_timeout=30, budget=90)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("redteam")
    src, student = release(root)
    subs = {}

    # A "bonus" cell of the student's own, carrying grader metadata that claims points.
    bonus = answer(student)
    fake = new_code_cell("print('bonus')")
    fake.metadata = {
        "nbgrader": {"grade": True, "points": 50, "grade_id": "bonus", "solution": False},
        "grader_test": True,
    }
    bonus.cells.append(fake)
    subs["bonus_cell"] = bonus

    # The same, but claiming an existing test's grade_id and type: it must not replace the test.
    stolen = answer(student, square="return 0")
    steal = new_code_cell("pass")
    steal.metadata = {"nbgrader": {"grade": True, "points": 2, "grade_id": "test_square"}}
    stolen.cells.insert(0, steal)
    subs["stolen_grade_id"] = stolen

    # Metadata that would replace the source the feedback shows.
    disguised = answer(student, square="return 0")
    i = cell_index(disguised, "square")
    disguised.cells[i].metadata["grader_source"] = "def square(x):\n    return x * x"
    subs["disguised_source"] = disguised

    # The written answer turned into a code cell that runs cleanly.
    coded = nbformat.from_dict(student)
    j = cell_index(coded, "why")
    md = coded.cells[j]
    coded.cells[j] = new_code_cell("1 + 1", metadata=md.metadata)
    subs["markdown_to_code"] = coded

    # Script in an output and in markdown, aimed at the feedback page.
    script = answer(student)
    script.cells.append(
        new_code_cell(
            "from IPython.display import HTML, display\n"
            "display(HTML('<script>document.body.innerHTML=\"100 points\"</script><b id=x>hi</b>'))"
        )
    )
    script.cells.append(new_markdown_cell("<img src=x onerror=alert(1)><script>alert(2)</script>"))
    subs["script_in_feedback"] = script

    # A wrong answer that fails only the hidden tests (square(-4) must be 16).
    subs["fails_hidden"] = answer(student, square="return abs(x) * x")

    out = root / "out"
    before = set(os.listdir(tempfile.gettempdir()))
    results = grade(src, write(root / "subs", subs), out, jobs=2, progress=False, limits=LIMITS)
    left_behind = set(os.listdir(tempfile.gettempdir())) - before
    return results, out, left_behind


def test_nothing_is_left_behind_in_tmp(graded):
    leftovers = {
        name
        for name in graded[2]
        if name.startswith(("expose-", "graded-kernels-", "grade-", "torchinductor_"))
    }
    assert not leftovers


def feedback(out, name):
    return (out / "feedback" / f"{name}.html").read_text()


def test_a_cell_claiming_grader_metadata_earns_nothing_and_breaks_nothing(graded):
    results, _, _ = graded
    r = results["bonus_cell"]
    assert r.status == "graded" and r.total == 6.0  # the genuine answers, no bonus
    assert "bonus" not in r.scores
    stolen = results["stolen_grade_id"]
    assert stolen.status == "graded" and stolen.scores["test_square"] == 0.0


def test_the_feedback_shows_what_ran_not_what_the_metadata_says(graded):
    results, out, _ = graded
    assert results["disguised_source"].scores["test_square"] == 0.0
    page = feedback(out, "disguised_source")
    assert "return 0" in page and "return x * x" not in page


def test_a_written_answer_turned_into_code_stays_a_written_answer(graded):
    results, out, _ = graded
    r = results["markdown_to_code"]
    assert r.scores["why"] is None and r.total == 0.0  # waits for a person, scores nothing
    assert any("'why' was changed to a code cell" in f for f in r.flags)


def test_feedback_pages_run_nothing_from_the_submission(graded):
    _, out, _ = graded
    page = feedback(out, "script_in_feedback")
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert "<script" not in page and "onerror=" not in page.replace("onerror=alert", "")
    assert "&lt;script&gt;" in page  # shown as text


def test_hidden_tests_never_reach_the_feedback_or_the_gradebook(graded):
    results, out, _ = graded
    r = results["fails_hidden"]
    assert r.scores["test_square"] == 0.0 and r.scores["test_mean"] == 3.0
    assert r.errors["test_square"] == "AssertionError: a hidden test failed"
    for name in ("fails_hidden", "bonus_cell"):
        page = feedback(out, name)
        assert "square(-4)" not in page and "square(0.5)" not in page and "HIDDEN" not in page
        assert "assert square(3) == 9" in page  # the visible test is shown
    assert "square(-4)" not in (out / "gradebook.csv").read_text()


def test_links_and_special_files_in_a_submission_are_refused(tmp_path):
    secret = tmp_path / "solution.ipynb"
    secret.write_text('{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}')
    folder = tmp_path / "alice"
    folder.mkdir()
    (folder / "lab.ipynb").symlink_to(secret)
    assert load_submission(folder) == (
        None,
        "lab.ipynb is a symbolic link: links are not accepted in a submission",
    )
    (tmp_path / "bob.ipynb").symlink_to(secret)
    assert "symbolic link" in load_submission(tmp_path / "bob.ipynb")[1]
    carol = tmp_path / "carol"
    carol.mkdir()
    os.link(secret, carol / "lab.ipynb")
    assert "hard link" in load_submission(carol)[1]
    dave = tmp_path / "dave"
    (dave / "sub").mkdir(parents=True)
    os.symlink(tmp_path, dave / "sub" / "up")
    (dave / "lab.ipynb").write_text(secret.read_text())
    assert "sub/up is a symbolic link" in load_submission(dave)[1]
    erin = tmp_path / "erin"
    erin.mkdir()
    os.mkfifo(erin / "pipe.ipynb")
    assert "not a regular file" in load_submission(erin)[1]  # and no hang reading a FIFO


def test_grading_refuses_to_run_without_isolation(tmp_path, monkeypatch, capsys):
    from course import cli
    from course import grade as grading

    src, student = release(tmp_path)
    subs = write(tmp_path / "subs", {"alice": answer(student)})
    monkeypatch.setattr(grading.os, "geteuid", lambda: 1000)  # as an instructor without root
    with pytest.raises(grading.IsolationUnavailable, match="not running as root"):
        grade(src, subs, tmp_path / "out", progress=False, limits=LIMITS)
    assert not (tmp_path / "out" / "results" / "alice.json").exists()  # nothing ran
    code = cli.main(["grade", str(src), str(subs), "--out", str(tmp_path / "out")])
    assert code == 2 and "--unsafe-no-isolation" in capsys.readouterr().err


def test_unsafe_grading_is_said_on_every_page_and_in_the_gradebook(tmp_path):
    from course.grade import UNSAFE

    src, student = release(tmp_path)
    subs = write(tmp_path / "subs", {"alice": answer(student)})
    out = tmp_path / "out"
    results = grade(src, subs, out, progress=False, limits=LIMITS, isolation=UNSAFE)
    assert results["alice"].status == "graded" and results["alice"].total == 6.0
    assert "UNSAFE" in feedback(out, "alice") and "UNSAFE" in (out / "gradebook.csv").read_text()
