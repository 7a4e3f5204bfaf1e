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


def executed_copy(nb, outputs=None, started=True, ended=None):
    """``nb`` as `course run` writes it: papermill's parameters cell injected and its record of
    each cell (``started``: every cell began), outputs, and how the run ended (``ended``)."""
    out = nbformat.from_dict(nb)
    for i, cell in enumerate(out.cells):
        cell.metadata["papermill"] = {"start_time": "2026-01-01T00:00:00" if started else None}
        if outputs is not None:
            cell.outputs = outputs[i]
    injected = new_code_cell("x = 1", metadata={"tags": ["injected-parameters"]})
    out.cells = [injected, *out.cells]
    out.metadata["papermill"] = {"parameters": {"x": 1}}
    if ended is not None:
        out.metadata["course_run"] = ended
    return out


STDOUT_6 = [[new_output("stream", name="stdout", text="6\n")]]
COMPARE = {  # name: (reference, how the executed copy differs, the problem reported or None)
    "same": (notebook("print(2 + 3)", "5\n", CHECK), {}, None),
    "checked-output-changed": (
        notebook("print(2 + 3)", "5\n", CHECK),
        {"outputs": STDOUT_6},
        "::Cell 0: checked output differs",
    ),
    "unchecked-output-changed": (notebook("print(2 + 3)", "5\n", {}), {"outputs": STDOUT_6}, None),
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
            ]
        },
        "::Cell 0: raised ZeroDivisionError: boom",
    ),
    "raised-as-marked": (notebook("raise ValueError('x')", None, RAISES, error=True), {}, None),
    "marked-but-raised-nothing": (
        notebook("x = 1", None, RAISES, error=True),
        {"outputs": [[]]},
        "::Cell 0: marked to raise an exception (raises-exception) but raised nothing",
    ),
    "the-run-failed": (  # a cell cut at its time limit: papermill marks it completed
        notebook("print(2 + 3)", "5\n", CHECK),
        {"ended": {"ok": False, "error": "Cell execution timed out"}},
        ": its run failed: Cell execution timed out",
    ),
    "never-started": (
        notebook("print(2 + 3)", "5\n", CHECK),
        {"outputs": [[]], "started": False},
        "::Cell 0: never started",
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
    found = compare(tmp_path / "nb.ipynb", tmp_path / "build" / "nb.ipynb", {"x": 1})
    if problem is None:
        assert found == []
    else:
        assert found == [f"{tmp_path / 'nb.ipynb'}{problem}"] or (
            len(found) == 1 and found[0].startswith(f"{tmp_path / 'nb.ipynb'}{problem}")
        ), found


def test_course_check_of_an_executed_copy_refuses_what_is_not_this_run(tmp_path):
    """Not a run of this code, not a run at all (a copy of the committed notebook), another
    profile's parameters, no copy."""
    reference = notebook("print(2 + 3)", "5\n", CHECK)
    nbformat.write(reference, tmp_path / "a.ipynb")
    nbformat.write(executed_copy(notebook("print(2 + 4)", "5\n", CHECK)), tmp_path / "b.ipynb")
    nbformat.write(executed_copy(reference), tmp_path / "c.ipynb")
    a = tmp_path / "a.ipynb"
    assert "is a run of other code" in compare(a, tmp_path / "b.ipynb")[0]
    assert "was not executed by `course run`" in compare(a, a)[0]
    assert "ran with {'x': 1}, not {'x': 2}" in compare(a, tmp_path / "c.ipynb", {"x": 2})[0]
    assert "no executed copy" in compare(a, tmp_path / "nope.ipynb")[0]


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


def _sanitized(text: str) -> str:
    import re

    from nbval.plugin import get_sanitize_patterns

    from course.check import SANITIZE

    for regex, replace in get_sanitize_patterns(SANITIZE.read_text()):
        text = re.sub(regex, replace, text)
    return text


def test_every_sanitizer_rule_is_one_nbval_reads():
    """nbval reads a rule only as `regex: ...` then `replace: ...` with its space: a rule it
    skips is silently no rule (the oversubscribed notice's was, for days)."""
    from nbval.plugin import get_sanitize_patterns

    from course.check import SANITIZE

    text = SANITIZE.read_text()
    sections = [line for line in text.splitlines() if line.startswith("[")]
    assert len(get_sanitize_patterns(text)) == len(sections)


def test_the_oversubscribed_notice_is_the_machines_not_the_notebooks():
    recorded = (
        "helpers.launch: 4 ranks × 1 thread on 2 cores is OVERSUBSCRIBED: ranks take turns on "
        "the cores, so its timings are not scaling (they are marked oversubscribed).\n[rank 0] x\n"
    )
    under_a_quota = (
        "helpers.launch: 4 ranks × 1 thread on 1 device is OVERSUBSCRIBED: ranks take turns on "
        "the cores, so its timings are not scaling (they are marked oversubscribed). Devices "
        "here: 1 device: a CPU quota of 1 CPU (cgroup v1, /sys/fs/cgroup/cpu/x).\n[rank 0] x\n"
    )
    assert _sanitized(recorded) == _sanitized(under_a_quota) == "[rank 0] x\n"
    assert _sanitized("[rank 0] x\n[rank 1] y\n") == "[rank 0] x\n[rank 1] y\n"
