"""`course compare`: the findings verdicts that differ between two executed builds.

Two builds of one small notebook, executed by the project's kernel: the same cells, other
repeats. One comparison turns round (a reversal: exit status 1), others weaken (listed), one is
displayed in one build and printed in the other (read from its JSON, then from its sentence: no
difference). The sentences are also read back directly, for every template of helpers.findings.
"""

from __future__ import annotations

import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook

from course.cli import main
from course.compare import parse, read_verdicts, relations
from course.kernel import KERNEL_NAME, KERNELSPEC
from course.syllabus import REPO
from helpers.measure import findings

FAST, SLOW = [1.0, 1.1, 1.2, 1.3, 1.4], [2.0, 2.1, 2.2, 2.3, 2.4]  # 5 against 5: 0.0079
NEAR = [1.05, 1.15, 1.25, 2.05, 2.15]  # overlaps both
REL = "lectures/fixture.ipynb"

# per build: the samples of each cell, and whether its finding is displayed or printed
BUILDS = {
    "A": {
        "bubble": ("GPipe", FAST, "1F1B", SLOW),  # GPipe ahead
        "epoch": ("batch 64", FAST, "batch 32", SLOW),  # separated
        "same": ("DDP", FAST, "ScratchDDP", SLOW),
        "same_shown": "display",
        "order": {"x": FAST, "y": SLOW, "z": [3.0, 3.1, 3.2, 3.3, 3.4]},  # x < y < z
        "predicted": 47.4,  # outside 48.7–66.0: misses
    },
    "B": {
        "bubble": ("GPipe", SLOW, "1F1B", FAST),  # 1F1B ahead: the reversal
        "epoch": ("batch 64", NEAR, "batch 32", SLOW),  # indistinguishable: a weakening
        "same": ("DDP", FAST, "ScratchDDP", SLOW),
        "same_shown": "print",
        "order": {"x": NEAR, "y": SLOW, "z": [3.0, 3.1, 3.2, 3.3, 3.4]},  # x ≈ y < z
        "predicted": 50.0,  # inside: usable
    },
}


def cells(build: dict) -> list[str]:
    def pair(key, what):
        a, xa, b, xb = build[key]
        return f'findings.compare({{"{a}": {xa}, "{b}": {xb}}}, "s", what="{what}")'

    same = pair("same", "step time")
    return [
        "from IPython.display import display\nfrom helpers.measure import findings\n"
        "findings.family(4)  # four comparisons and an ordering of three: 6 pairs, 0.1 / 4 each",
        f"display({pair('bubble', 'bubble at m = 4')})",
        f"print({pair('epoch', 'epoch time (oversubscribed)')})",
        f"display({same})" if build["same_shown"] == "display" else f"print({same})",
        f'print(findings.order({build["order"]}, "s", what="time to target"))',
        f'print(findings.fit("α-β at n = 2", 0.914, predicted={build["predicted"]}, '
        'measured=[48.7, 55.0, 66.0], unit="ms"))',
        "findings.summary()",
    ]


def execute(build: dict, path):
    nb = new_notebook(cells=[new_code_cell(c) for c in cells(build)])
    nb.metadata["kernelspec"] = KERNELSPEC
    NotebookClient(
        nb, kernel_name=KERNEL_NAME, timeout=120, resources={"metadata": {"path": str(REPO)}}
    ).execute()
    path.parent.mkdir(parents=True)
    nbformat.write(nb, path)  # validates: the findings' JSON is a valid output
    return nb


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Two build folders, each holding lectures/fixture.ipynb as the kernel executed it."""
    root = tmp_path_factory.mktemp("builds")
    for name, build in BUILDS.items():
        execute(build, root / name / REL)
    return root


def course_compare(a, b) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "course", "compare", str(a), str(b)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_reversal_fails_and_every_weakening_is_listed(builds):
    proc = course_compare(builds / "A", builds / "B")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert f"REVERSAL  {REL}, cells 1 / 1: compare 'bubble at m = 4' of 1F1B, GPipe" in out
    assert "GPipe better than 1F1B in A, 1F1B better than GPipe in B" in out
    assert "compare 'epoch time (oversubscribed)' of batch 32, batch 64: batch 64 better " in out
    assert "batch 64 better than batch 32 in A, not separated in B" in out
    assert "order 'time to target' of x, y, z: x before y in A, not separated in B" in out
    assert "fit 'α-β at n = 2': misses in A, usable in B" in out
    # displayed in A (read from its JSON), printed in B (read from its sentence): the same
    assert "step time" not in out
    assert out.strip().endswith("1 notebooks, 5 verdicts in both: 1 reversals, 3 weakenings")


def test_the_suite_fails_on_a_reversal_only_when_strict(builds, capsys):
    """syllabus_run's check, on the two builds (one made-up reversal, three weakenings): strict
    (the default), it fails with the notebook, its cells and both verdicts in the message; not
    strict, it lists them and passes. Weakenings alone never fail."""
    import syllabus_run

    from course.syllabus import Entry

    entries = [Entry(builds / "A" / REL, "fixture", "lecture", 60)]
    assert syllabus_run.STRICT is True
    with pytest.raises(AssertionError) as failed:
        syllabus_run.assert_no_verdict_reversed(entries, builds / "A", against=builds / "B")
    message = str(failed.value)
    assert f"REVERSAL  {REL}, cells 1 / 1: compare 'bubble at m = 4'" in message
    assert "GPipe better than 1F1B in A, 1F1B better than GPipe in B" in message
    assert "A: GPipe is faster than 1F1B" in message and "B: 1F1B is faster than GPipe" in message
    assert "epoch" not in message  # a weakening is no reason to fail
    syllabus_run.assert_no_verdict_reversed(
        entries, builds / "A", against=builds / "B", strict=False
    )
    assert "1 reversals, 3 weakenings" in capsys.readouterr().out  # listed with the output
    syllabus_run.assert_no_verdict_reversed(entries, builds / "A", against=builds / "A")


@pytest.mark.parametrize("load, fails", [(None, True), (2.5, True), (9.0, False)])
def test_a_reversal_in_a_run_on_a_contended_machine_is_listed_not_failed(
    builds, tmp_path, capsys, load, fails
):
    """A run made while other work held the cores (load beyond the cores + SPARE_LOAD, stamped
    by `course run`) cannot contradict an idle recording of a verdict that pits one core against
    two: its reversal is printed with the load. A run without a stamp, or on free cores, fails."""
    import shutil

    import syllabus_run

    from course.syllabus import Entry

    run = tmp_path / "A"
    shutil.copytree(builds / "A", run)
    nb = nbformat.read(run / REL, as_version=4)
    if load is not None:
        nb.metadata["course_run"] = {"profile": "quick", "ok": True, "load": load, "cores": 2}
    nbformat.write(nb, run / REL)
    entries = [Entry(run / REL, "fixture", "lecture", 60)]
    if fails:
        with pytest.raises(AssertionError, match="a verdict reversed"):
            syllabus_run.assert_no_verdict_reversed(entries, run, against=builds / "B")
    else:
        syllabus_run.assert_no_verdict_reversed(entries, run, against=builds / "B")
        assert "not failed, this run was contended (load 9.0 on 2 cores)" in capsys.readouterr().out


def compare_here(capsys, a, b) -> tuple[int, str, str]:
    """`course compare A B` through the CLI's own parser, in this process: (status, out, err)."""
    code = main(["compare", str(a), str(b)])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_build_against_itself_and_weakenings_alone_pass(builds, tmp_path, capsys):
    code, out, _ = compare_here(capsys, builds / "A", builds / "A")
    assert code == 0 and "0 reversals, 0 weakenings" in out
    # the executed A without its reversed cell: weakenings only, listed, and no error
    nb = nbformat.read(builds / "A" / REL, as_version=4)
    del nb.cells[1]
    (tmp_path / "lectures").mkdir()
    nbformat.write(nb, tmp_path / REL)
    code, out, err = compare_here(capsys, tmp_path, builds / "B")
    assert code == 0, out + err
    assert "0 reversals, 3 weakenings" in out
    assert "compare 'bubble at m = 4' of 1F1B, GPipe, only in B" in out


def test_the_executed_notebook_says_its_comparisons_and_what_chance_alone_gives(builds):
    nb = nbformat.read(builds / "A" / REL, as_version=4)
    shown = nb.cells[-1].outputs[0].data
    assert shown["text/markdown"].startswith(
        "**Findings of this run**: 6 comparisons, 6 separated, each judged at a chance of at "
        "most 0.025, 0.1 over the 4 declared"
    )
    # more comparisons than declared: judged again at 0.1 / 6 = 0.017; 5 against 5 still holds
    assert "every separation stands" in shown["text/markdown"]
    assert shown[findings.MIME]["comparisons"] == 6
    assert len(read_verdicts(builds / "A" / REL)) == 5  # the summary is not a verdict


def test_a_displayed_verdict_is_read_from_its_json_not_its_sentence(builds, tmp_path):
    nb = nbformat.read(builds / "A" / REL, as_version=4)
    shown = nb.cells[1].outputs[0].data  # display(compare GPipe / 1F1B)
    assert shown[findings.MIME]["first"] == "GPipe"
    del shown["text/markdown"], shown["text/plain"]
    nbformat.write(nb, tmp_path / "json-only.ipynb")
    bubble = read_verdicts(tmp_path / "json-only.ipynb")[0]
    assert bubble.key == ("compare", "bubble at m = 4", ("1F1B", "GPipe"), 1)
    assert bubble.relations == {("1F1B", "GPipe"): ("GPipe", "1F1B")}


def test_nothing_to_compare_is_a_clear_error(builds, tmp_path, capsys):
    code, _, err = compare_here(capsys, tmp_path / "nowhere", builds / "A")
    assert code == 2 and "does not exist" in err
    (tmp_path / "empty").mkdir()
    code, _, err = compare_here(capsys, tmp_path / "empty", builds / "A")
    assert code == 2 and "no notebook in common" in err
    (tmp_path / "broken" / "lectures").mkdir(parents=True)
    (tmp_path / "broken" / REL).write_text("{ not a notebook")
    code, _, err = compare_here(capsys, tmp_path / "broken", builds / "A")
    assert code == 2 and f"{tmp_path / 'broken' / REL} is not a readable notebook" in err


@pytest.fixture
def judged_alone():
    findings.family()
    try:
        yield
    finally:
        findings.family()


def _sentences():
    """One finding of each shape compare reads, names and quantities with parentheses too."""
    f, s = FAST, SLOW
    return [
        findings.compare({"1 rank": f, "2 ranks": s}, "s", what="step time"),
        findings.compare({"2 ranks": s, "1 rank": f}, "s"),
        findings.compare({"a": s, "b": f}, better="higher", what="accuracy"),
        findings.compare({"1 rank": f, "4 ranks (oversubscribed)": s}, "s"),
        findings.compare(
            {"1 rank": f, "2 ranks": s}, "s", what="epoch at batch 16 (oversubscribed)"
        ),
        findings.compare({"1 rank": f, "2 ranks": NEAR}, "s", what="step time (compute)"),
        findings.order({"x": f, "y": s, "z": [3.0, 3.1, 3.2, 3.3, 3.4]}, "s", what="time"),
        findings.order({"x": f, "y": s, "z": [3.0, 3.1, 3.2, 3.3, 3.4]}, highest_first=True),
        findings.order({"DP": [10, 10.5, 11], "TP": [9, 12, 15], "PP": [12, 12.5, 13]}, "ms"),
        findings.order(
            {"c": [3, 3.1, 3.2], "a": [1, 1.1, 1.2], "b": [1.15, 2.1, 2.2]}, what="t (s)"
        ),
        findings.fit("t = a + S/β at n = 2", 0.97),
        findings.fit("t = a + S/β at n = 4 (oversubscribed)", -0.4),
        findings.fit("α-β", 0.914, predicted=47.4, measured=[48.7, 66.0], unit="ms"),
    ]


def test_every_findings_sentence_reads_back_as_the_verdict_it_states(judged_alone):
    for f in _sentences():
        for text in (str(f), f.text, f"  - {f.text}"):  # printed, displayed, a list's item
            record = parse(text)
            assert record is not None, text
            assert record["kind"] == f.record["kind"] and record["what"] == f.record["what"]
            assert relations(record) == relations(f.record), text
    assert parse("large layers: DataParallel is faster than one device, DDP is …") is None
    # a name with " and " in it reads back from the Markdown; printed, it is ambiguous (to a
    # reader as well): displayed findings carry their JSON, so course compare needs neither
    tie = findings.compare({"one and two": FAST, "three": NEAR}, "s")
    assert relations(parse(tie.text)) == relations(tie.record)
