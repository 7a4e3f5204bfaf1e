"""`course run` (the README's main job) and `course check` of the whole syllabus, on one run.

The suite executes each syllabus notebook once: `course run` (papermill, quick profile) writes the
executed copies, HTML pages and an index into a temporary build folder, and `course check
--executed` holds those copies to the committed outputs by nbval's rules. A notebook that fails,
or a checked output that changed, fails `test_the_whole_syllabus_holds_its_committed_outputs`
with the notebook and cell named."""

from __future__ import annotations

import subprocess
import sys

import nbformat
import pytest

from course.syllabus import REPO, load_syllabus

ENTRIES = load_syllabus()


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """The whole syllabus executed once by the main job's command, quick profile."""
    out = tmp_path_factory.mktemp("build")
    proc = subprocess.run(
        [sys.executable, "-m", "course", "run", "--profile", "quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        # about 10 min on 2 quiet cores; the limit holds with a second grader beside the suite
        timeout=3000,
    )
    return out, proc


@pytest.mark.slow
@pytest.mark.timeout(3300)  # the module's one run of the syllabus happens inside this test
def test_course_run_executes_the_syllabus_under_papermill_into_an_index(build):
    """The README's main job, quick profile: papermill with the project kernel, the profile's
    parameters injected, HTML and an index, a summary that counts failures."""
    out, proc = build
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert f"{len(ENTRIES)} notebooks in" in proc.stdout and "0 failed" in proc.stdout
    index = (out / "index.html").read_text()
    for entry in ENTRIES:
        rel = entry.path.relative_to(REPO)
        executed = nbformat.read(out / rel, as_version=4)
        assert executed["metadata"]["kernelspec"]["name"] == "multigpu-course"
        assert str(rel.with_suffix(".html")) in index and (out / rel.with_suffix(".html")).exists()
        if entry.kind == "lab":  # the quick profile was injected (a lecture's is empty)
            quick = entry.parameters("quick")
            assert quick and executed.metadata["papermill"]["parameters"] == quick
    setup = nbformat.read(out / "lectures" / "00_setup_check.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in setup.cells for o in c.get("outputs", []))
    assert "[rank 0] I am rank 0 of 2" in text and "[rank 1] I am rank 1 of 2" in text


@pytest.mark.slow
@pytest.mark.timeout(3300)  # run alone, the syllabus's run happens inside this test
def test_the_whole_syllabus_holds_its_committed_outputs(build):
    """`course check --executed`: every cell ran (or raised where marked to), every checked
    output equals the committed one after sanitizing; nothing is executed again."""
    out, _ = build
    proc = subprocess.run(
        [sys.executable, "-m", "course", "check", "--executed", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert f"{len(ENTRIES)} notebooks checked against {out}, 0 failed" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(3300)
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
