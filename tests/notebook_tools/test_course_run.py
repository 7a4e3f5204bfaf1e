"""`course run` (the README's main job) and `course check` of the syllabus's lectures, on one run;
the labs are the other half (test_course_run_labs.py, syllabus_run.py says why two)."""

from __future__ import annotations

import subprocess
import sys

import nbformat
import pytest
import syllabus_run

from course.syllabus import REPO

LECTURES = syllabus_run.half("lecture")


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """The syllabus's lectures executed once by the main job's command, quick profile."""
    out = tmp_path_factory.mktemp("build")
    return out, syllabus_run.run(LECTURES, out)


@pytest.mark.slow
@pytest.mark.timeout(2700)  # the module's one run of the lectures happens inside this test
def test_course_run_executes_the_lectures_under_papermill_into_an_index(build):
    out, proc = build
    syllabus_run.assert_ran_into_an_index(LECTURES, out, proc)
    setup = nbformat.read(out / "lectures" / "00_setup_check.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in setup.cells for o in c.get("outputs", []))
    assert "[rank 0] I am rank 0 of 2" in text and "[rank 1] I am rank 1 of 2" in text
    ran = setup.metadata["course_run"]  # how busy the machine was: syllabus_run.contended reads it
    assert ran["load"] >= 0 and ran["cores"] >= 1, ran


@pytest.mark.slow
@pytest.mark.timeout(2700)  # run alone, the lectures' run happens inside this test
def test_the_lectures_hold_their_committed_outputs(build):
    out, _ = build
    syllabus_run.assert_holds_its_committed_outputs(LECTURES, out)


@pytest.mark.slow
@pytest.mark.timeout(2700)  # run alone, the lectures' run happens inside this test
def test_the_lectures_make_their_book_and_reverse_no_verdict(build):
    out, _ = build
    syllabus_run.assert_makes_its_book(LECTURES, out)
    syllabus_run.assert_no_verdict_reversed(LECTURES, out)


def test_without_notebooks_course_run_takes_the_whole_syllabus_in_its_order():
    from course.run import select

    assert select(syllabus_run.ENTRIES, None) == syllabus_run.ENTRIES
    assert {e.kind for e in syllabus_run.ENTRIES} == {"lecture", "lab"}  # the halves cover it
    picked = select(syllabus_run.ENTRIES, [str(syllabus_run.ENTRIES[-1].path)])
    assert picked == [syllabus_run.ENTRIES[-1]]


def test_a_failing_notebook_is_reported_and_fails_the_run(tmp_path):
    from nbformat.v4 import new_code_cell, new_notebook

    from course.check import compare
    from course.kernel import KERNELSPEC
    from course.run import execute
    from course.syllabus import Entry

    nb = new_notebook(
        cells=[new_code_cell("x = 1"), new_code_cell("1/0"), new_code_cell("print(x)")],
        metadata={"kernelspec": KERNELSPEC},
    )
    path = tmp_path / "broken.ipynb"
    nbformat.write(nb, path)
    result = execute(Entry(path, "broken", "lecture", 60), "quick", tmp_path / "build")
    assert not result.ok and "ZeroDivisionError" in result.error
    assert result.output.exists() and result.html.exists()
    # and the check of that run names the cell that failed (code cells counted from 0)
    problems = compare(path, result.output)
    assert problems == [
        f"{path}: its run failed: {result.error}",
        f"{path}::Cell 1: raised ZeroDivisionError: division by zero",
    ]


def test_a_cell_cut_at_its_time_limit_fails_the_check(tmp_path):
    """papermill marks a timed-out cell "completed", like any other: `course run` records how
    the run ended, and the check refuses it, even when the cut cell is the last one."""
    from nbformat.v4 import new_code_cell, new_notebook

    from course.check import compare
    from course.kernel import KERNELSPEC
    from course.run import execute
    from course.syllabus import Entry

    nb = new_notebook(
        cells=[new_code_cell("x = 1"), new_code_cell("import time\ntime.sleep(60)")],
        metadata={"kernelspec": KERNELSPEC},
    )
    path = tmp_path / "slow.ipynb"
    nbformat.write(nb, path)
    result = execute(Entry(path, "slow", "lecture", 1), "quick", tmp_path / "build")  # 3 s a cell
    assert not result.ok
    problems = compare(path, result.output)
    assert problems and problems[0].startswith(f"{path}: its run failed: "), problems


def test_a_notebook_outside_the_syllabus_is_refused():
    proc = subprocess.run(
        [sys.executable, "-m", "course", "run", "tests/nope.ipynb"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "not in syllabus.yml" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(2700)  # run alone, the lectures' run happens inside this test
def test_a_build_is_adopted_as_the_recording_only_when_it_ran_the_same_code(build, tmp_path):
    from course.record import adopt

    out, _ = build
    reference = REPO / "lectures" / "00_setup_check.ipynb"
    stored = nbformat.read(
        adopt(out / "lectures" / reference.name, reference, to=tmp_path / "r.ipynb"), 4
    )
    assert "papermill" not in stored.metadata
    assert [c.source for c in stored.cells] == [c.source for c in nbformat.read(reference, 4).cells]
    text = "".join(o.get("text", "") for c in stored.cells for o in c.get("outputs", []))
    assert "I am rank 1 of 2" in text and str(out) not in text and str(REPO) not in text
    counts = [c.execution_count for c in stored.cells if c.cell_type == "code" and c.outputs]
    assert counts == sorted(counts) and counts[0] >= 1


def test_prose_edited_since_the_build_is_kept(tmp_path):
    from course.record import adopt

    executed, reference = _executed_copy(tmp_path, prose="An older sentence.")
    stored = nbformat.read(adopt(executed, reference, to=tmp_path / "r.ipynb"), 4)
    assert [c.source for c in stored.cells] == [c.source for c in nbformat.read(reference, 4).cells]


def _executed_copy(tmp_path, profile="quick", ok=True, edit=None, prose=None):
    """A notebook as `course run` leaves it, made by hand: the refusals need no kernel."""
    reference = REPO / "lectures" / "00_setup_check.ipynb"
    nb = nbformat.read(reference, 4)
    nb.metadata["papermill"] = {"input_path": str(reference)}
    nb.metadata["course_run"] = {"profile": profile, "ok": ok, "error": "" if ok else "boom"}
    if edit is not None:
        nb.cells[edit].source += "\nprint('changed')"
    if prose is not None:
        next(c for c in nb.cells if c.cell_type == "markdown").source = prose
    path = tmp_path / "executed.ipynb"
    nbformat.write(nb, path)
    return path, reference


@pytest.mark.parametrize(
    "case, says",
    [
        ({"edit": 2}, "ran other code"),
        ({"ok": False}, r"failed \(boom\)"),
        ({"profile": "full"}, "ran the 'full' profile"),
    ],
)
def test_a_build_of_other_code_a_failed_run_or_another_profile_is_refused(tmp_path, case, says):
    from course.record import adopt

    executed, reference = _executed_copy(tmp_path, **case)
    with pytest.raises(SystemExit, match=says):
        adopt(executed, reference, to=tmp_path / "r.ipynb")
    assert not (tmp_path / "r.ipynb").exists()
    ok, _ = _executed_copy(tmp_path)
    assert adopt(ok, reference, to=tmp_path / "r.ipynb").exists()  # the same, as it ran: stored
