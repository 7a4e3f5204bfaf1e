"""What a grading run leaves for people to read, and only that: feedback pages within the
documented caps however much a submission prints, each submission's work folder cleaned once
its page is written, and notes without unfilled placeholders."""

from __future__ import annotations

from grading_fixtures import answer, cell_index, raw, release, write
from nbformat.v4 import new_code_cell

from course.grade import grade
from course.grading.isolation import Isolation
from course.grading.sandbox import SUBMISSION_OUTPUT_LIMIT


def test_a_flood_of_markup_leaves_a_page_within_the_caps_and_nothing_in_work(tmp_path):
    """A submission printing 100 cells of 99 kB each: the runner keeps 8 MB of it, which
    escaped for HTML ('<' is '&lt;') made a 32 MB page, and its 8 MB executed notebook stayed
    in OUT/.work after the run."""
    lab, student = release(tmp_path)
    flood = answer(student)
    flood.cells += [new_code_cell("print('<' * 99_000)") for _ in range(100)]
    out = tmp_path / "out"
    results = grade(lab, write(tmp_path / "subs", {"flood": flood}), out, progress=False)
    assert results["flood"].total == 6.0
    page = out / "feedback" / "flood.html"
    assert page.stat().st_size < SUBMISSION_OUTPUT_LIMIT + 200_000
    text = page.read_text()
    assert "&lt;" * 1000 in text and "the rest of your notebook is not shown" in text
    assert [p for p in (out / ".work").rglob("*")] == []
    assert results["flood"].executed is None


def test_the_isolation_note_names_its_cgroups_without_a_placeholder():
    """On cgroup v1 the note printed the root's template, /sys/fs/cgroup/{controller}."""
    for root in ("/sys/fs/cgroup/{controller}", "/sys/fs/cgroup"):
        iso = object.__new__(Isolation)  # what describe() reads, without probing this machine
        iso.mode, iso.cgroup_root = "auto", root
        note = " ".join(iso.describe())
        assert "{" not in note and "/sys/fs/cgroup" in note, note


def test_a_lone_surrogate_in_a_students_text_stops_nothing(tmp_path):
    """JSON may hold a lone surrogate ("\\udcff"), which UTF-8 cannot encode: the executed
    notebook could not be written (a grader error, so 0 points, graded again every run), and
    past that the feedback page and the written question's page, which stopped the batch."""
    lab, student = release(tmp_path)
    odd = answer(student)
    odd.cells[cell_index(odd, "why")].source = "Because \udcff."
    subs = write(tmp_path / "subs", {"odd": raw(odd), "plain": answer(student)})
    (subs / "odd").rename(subs / "odd.ipynb")
    out = tmp_path / "out"
    results = grade(lab, subs, out, progress=False)
    assert results["odd"].total == results["plain"].total == 6.0
    for page in (out / "feedback" / "odd.html", out / "manual" / "why.html"):
        assert "Because \\udcff." in page.read_text(), page
