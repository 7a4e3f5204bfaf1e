"""`course check` (nbval with our sanitizer and the must-raise rule), its check of an executed
copy (`--executed`), and `course record`. The whole syllabus is checked in test_course_run.py,
on the one execution the suite makes of it."""

from __future__ import annotations

import subprocess
import sys

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

from course.check import compare
from course.kernel import KERNELSPEC
from course.record import normalise
from course.syllabus import REPO

CHECK = {"tags": ["nbval-check-output"]}
RAISES = {"tags": ["raises-exception"]}


def notebook(source, printed, metadata, error=False):
    outputs = [new_output("stream", name="stdout", text=printed)] if printed else []
    if error:
        outputs = [new_output("error", ename="ValueError", evalue="x", traceback=[])]
    cell = new_code_cell(source, metadata=metadata, execution_count=1, outputs=outputs)
    return new_notebook(cells=[cell], metadata={"kernelspec": KERNELSPEC})


CASES = {
    "test-output-pass-same": (notebook("print(2 + 3)", "5\n", CHECK), 0),
    "test-output-fail-changed": (notebook("print(2 + 4)", "5\n", CHECK), 1),
    "test-sanitize-pass-timing": (
        notebook("print('took 0.731 s at 3.2 GB/s')", "took 0.5 s at 1.1 GB/s\n", CHECK),
        0,
    ),
    "test-raises-pass-raises": (notebook("raise ValueError('x')", None, RAISES, error=True), 0),
    "test-raises-fail-raises-nothing": (notebook("x = 1", None, RAISES, error=True), 1),
    "test-error-fail-unexpected": (notebook("1 / 0", None, {}), 1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_course_check(name, tmp_path):
    nb, expected = CASES[name]
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(nb, path)
    proc = subprocess.run(
        [sys.executable, "-m", "course", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (proc.returncode != 0) == bool(expected), proc.stdout[-2000:]
    if name == "test-raises-fail-raises-nothing":
        assert "marked to raise an exception (raises-exception) but raised nothing" in proc.stdout


def ran(cell, status="completed"):
    """``cell`` as papermill leaves it: its status in the cell's metadata."""
    cell = nbformat.from_dict(cell)
    cell.metadata["papermill"] = {"status": status}
    return cell


def executed_copy(nb, outputs=None, status="completed"):
    """``nb`` as `course run` writes it: papermill's parameters cell injected, statuses, outputs."""
    out = nbformat.from_dict(nb)
    cells = [ran(c, status) for c in out.cells]
    for cell, new in zip(cells, outputs or [], strict=False):
        cell.outputs = new
    injected = new_code_cell("x = 1", metadata={"tags": ["injected-parameters"]})
    out.cells = [injected, *cells]
    return out


COMPARE = {  # name: (reference, executed copy, the words of the problem reported or None)
    "same": (notebook("print(2 + 3)", "5\n", CHECK), {}, None),
    "checked-output-changed": (
        notebook("print(2 + 3)", "5\n", CHECK),
        {"outputs": [[new_output("stream", name="stdout", text="6\n")]]},
        "Cell 0: checked output differs",
    ),
    "unchecked-output-changed": (
        notebook("print(2 + 3)", "5\n", {}),
        {"outputs": [[new_output("stream", name="stdout", text="6\n")]]},
        None,
    ),
    "timing-sanitized": (
        notebook("print(t)", "took 0.5 s at 1.1 GB/s\n", CHECK),
        {"outputs": [[new_output("stream", name="stdout", text="took 0.731 s at 3.2 GB/s\n")]]},
        None,
    ),
    "raised": (
        notebook("1 / 0", None, {}),
        {
            "outputs": [
                [new_output("error", ename="ZeroDivisionError", evalue="boom", traceback=[])]
            ],
            "status": "failed",
        },
        "Cell 0: raised ZeroDivisionError: boom",
    ),
    "raised-as-marked": (notebook("raise ValueError('x')", None, RAISES, error=True), {}, None),
    "marked-but-raised-nothing": (
        notebook("x = 1", None, RAISES, error=True),
        {"outputs": [[]]},
        "marked to raise an exception (raises-exception) but raised nothing",
    ),
    "stopped-at-time-limit": (
        notebook("print(2 + 3)", "5\n", CHECK),
        {"outputs": [[]], "status": "failed"},
        "Cell 0: did not finish",
    ),
    "never-reached": (
        notebook("print(2 + 3)", "5\n", CHECK),
        {"outputs": [[]], "status": "pending"},
        "Cell 0: did not finish",
    ),
}


@pytest.mark.parametrize("name", sorted(COMPARE))
def test_course_check_of_an_executed_copy_applies_nbvals_rules(name, tmp_path):
    """`course check --executed`: the committed notebook against the copy `course run` wrote,
    without executing anything; each problem names its cell as nbval does."""
    reference, change, problem = COMPARE[name]
    (tmp_path / "build").mkdir()
    nbformat.write(reference, tmp_path / "nb.ipynb")
    nbformat.write(executed_copy(reference, **change), tmp_path / "build" / "nb.ipynb")
    found = compare(tmp_path / "nb.ipynb", tmp_path / "build" / "nb.ipynb")
    if problem is None:
        assert found == []
    else:
        assert len(found) == 1 and problem in found[0], found
        assert found[0].startswith(f"{tmp_path / 'nb.ipynb'}::Cell 0")


def test_course_check_of_an_executed_copy_refuses_a_run_of_other_code(tmp_path):
    reference = notebook("print(2 + 3)", "5\n", CHECK)
    other = executed_copy(notebook("print(2 + 4)", "5\n", CHECK))
    nbformat.write(reference, tmp_path / "a.ipynb")
    nbformat.write(other, tmp_path / "b.ipynb")
    assert "is a run of other code" in compare(tmp_path / "a.ipynb", tmp_path / "b.ipynb")[0]
    assert "no executed copy" in compare(tmp_path / "a.ipynb", tmp_path / "nope.ipynb")[0]


def test_record_normalises_counts_paths_and_papermill_traces():
    nb = new_notebook(
        cells=[
            new_code_cell(
                "x",
                execution_count=7,
                outputs=[new_output("stream", name="stdout", text=f"{REPO}/helpers/a.py\n")],
            ),
            new_code_cell("y = 1", metadata={"tags": ["injected-parameters"]}, execution_count=8),
            new_code_cell("z", execution_count=9, outputs=[]),
        ],
        metadata={"papermill": {"parameters": {}}},
    )
    out = normalise(nb)
    assert [c.execution_count for c in out.cells] == [1, 2] and "papermill" not in out.metadata
    assert out.cells[0].outputs[0]["text"] == "helpers/a.py\n"
