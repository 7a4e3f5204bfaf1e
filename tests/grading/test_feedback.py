"""The feedback page a student reads: their figures, wrapped text, each graded cell headed by its
question and points, a cell stopped at its time limit saying so, the isolation details folded.
Graded for real (a sandboxed kernel), then opened in headless Chromium at a laptop's width."""

from __future__ import annotations

import os
import shutil

import pytest
from grading_fixtures import answer, cell_index, release, write
from nbformat.v4 import new_code_cell

from course.grade import grade
from course.grading.results import Limits
from course.syllabus import REPO

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SHOTS = REPO / "build" / "screenshots"
LONG = "z" * 3000  # one word far wider than any window


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("feedback")
    source, student = release(tmp)
    forged = "raise type('[grader] stopped at the 8 s cell limit', (Exception,), {})('no')"
    nb = answer(  # square hangs in its test; mean fails dressed as the grader
        student, square="import time; time.sleep(60); return x * x", mean=forged
    )
    plot = (
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [1, 4, 9]); plt.title('my curve'); plt.show()\n"
        f"print('{LONG}')"
    )
    nb.cells.insert(cell_index(nb, "square"), new_code_cell(plot))
    subs = write(tmp / "subs", {"ann": nb})
    result = grade(
        source, subs, tmp / "out", progress=False, limits=Limits(cell_timeout=8, budget=120)
    )["ann"]
    return result, (tmp / "out" / "feedback" / "ann.html").read_text()


def test_the_page_shows_the_figure_and_heads_graded_cells_by_question(page):
    result, html = page
    assert result.status == "graded", result.reason
    assert "<img alt='figure' src='data:image/png;base64," in html  # plt.show(), inline
    assert "test_square · 2 points · automatic test" in html
    assert "why · 1 points · your answer, read by the instructor" in html
    assert "<details><summary>How it ran" in html  # the isolation block, folded
    assert "every core of this machine" in html  # one slot: how many cores the timings had


def test_a_cell_stopped_at_its_limit_says_so(page):
    result, html = page
    assert result.scores["test_square"] == 0.0
    assert result.errors["test_square"].startswith("[grader] stopped at the 8 s cell limit")
    assert "<b>Note from the grader</b><pre>[grader] stopped at the 8 s cell limit" in html
    assert "KeyboardInterrupt:" not in result.errors["test_square"]
    # the submission's own exception cannot speak as the grader
    assert result.errors["test_mean"].startswith("your code raised [grader]"), result.errors


def test_the_page_fits_a_laptop_window_with_its_figure_drawn(page, tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"no Chromium at {CHROMIUM}: scripts/setup.sh installs Debian's chromium")
    from playwright.sync_api import sync_playwright

    _, html = page
    path = tmp_path / "ann.html"
    path.write_text(html)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        view = browser.new_page(viewport={"width": 1280, "height": 800})
        view.goto(path.as_uri())
        width = view.evaluate("document.documentElement.scrollWidth")
        drawn = view.evaluate("[...document.images].map(i => i.complete && i.naturalWidth)")
        SHOTS.mkdir(parents=True, exist_ok=True)
        view.screenshot(path=str(SHOTS / "feedback.png"), full_page=False)  # for the eye
        browser.close()
    assert width <= 1280, f"the page is {width} px wide: a line is not wrapped"
    assert drawn and all(w > 100 for w in drawn), drawn
