"""`course run` (the README's main job) and `course check` of the syllabus's labs (solutions,
each with its quick profile injected), on one run; the lectures are the other half
(test_course_run.py, syllabus_run.py says why two)."""

from __future__ import annotations

import nbformat
import pytest
import syllabus_run

from course.syllabus import REPO

LABS = syllabus_run.half("lab")


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """The syllabus's labs executed once by the main job's command, quick profile."""
    out = tmp_path_factory.mktemp("build")
    return out, syllabus_run.run(LABS, out)


@pytest.mark.slow
@pytest.mark.timeout(2700)  # the module's one run of the labs happens inside this test
def test_course_run_executes_the_labs_under_papermill_into_an_index(build):
    out, proc = build
    syllabus_run.assert_ran_into_an_index(LABS, out, proc)


@pytest.mark.slow
@pytest.mark.timeout(2700)  # run alone, the labs' run happens inside this test
def test_the_labs_hold_their_committed_outputs(build):
    out, _ = build
    syllabus_run.assert_holds_its_committed_outputs(LABS, out)


@pytest.mark.slow
@pytest.mark.timeout(2700)  # run alone, the labs' run happens inside this test
def test_the_labs_make_their_book_and_reverse_no_verdict(build):
    out, _ = build
    syllabus_run.assert_makes_its_book(LABS, out)
    syllabus_run.assert_no_verdict_reversed(LABS, out)


@pytest.mark.slow
@pytest.mark.timeout(2700)
def test_a_changed_number_in_a_checked_output_of_the_run_fails_the_check_naming_its_cell(build):
    """The check above can fail: one digit of a checked output edited in a real executed copy."""
    from course.check import compare

    out, _ = build
    lab = REPO / "solutions" / "lab02_build_ddp.ipynb"
    nb = nbformat.read(out / "solutions" / lab.name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code" and "injected-parameters" not in
            c.metadata.get("tags", [])]  # fmt: skip
    num, cell = next(
        (i, c)
        for i, c in enumerate(code)
        if "nbval-check-output" in c.metadata.get("tags", [])
        and any(ch.isdigit() for o in c.outputs for ch in o.get("text", ""))
    )
    stream = next(o for o in cell.outputs if any(ch.isdigit() for ch in o.get("text", "")))
    digit = next(ch for ch in stream["text"] if ch.isdigit())
    stream["text"] = stream["text"].replace(digit, str((int(digit) + 1) % 10), 1)
    edited = out.parent / "edited.ipynb"
    nbformat.write(nb, edited)
    problems = compare(lab, edited)
    assert len(problems) == 1 and problems[0].startswith(f"{lab}::Cell {num}: checked output"), (
        problems
    )
