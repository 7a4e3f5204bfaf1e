"""The lectures' findings as one family each, as committed: a lecture that compares declares
`findings.family(K)` before its first verdict, computed where its parameters set it, and ends
with `findings.summary()` under a line saying what it tells the reader; the recorded summary
shows no more comparisons than declared and none whose repeats could not separate at the
family's level (the repeats each verdict needs were taken).

(Lecture 00 prints no verdict.)
"""

from __future__ import annotations

import nbformat
import pytest

from course.syllabus import REPO
from helpers.measure.findings import MIME

LECTURES = [
    "01_collectives",
    "02_data_parallel",
    "03_memory",
    "04_model_pipeline_tensor",
    "05_large_batch",
    "06_measuring",
    "07_tools",
    "08_transformers_at_scale",
]
VERDICTS = ("findings.compare(", "findings.order(")


def _nb(name: str):
    return nbformat.read(REPO / "lectures" / f"{name}.ipynb", as_version=4)


def _summary(nb) -> dict:
    """The recorded summary's numbers: the last cell's displayed finding."""
    last = nb.cells[-1]
    shown = [o for o in last.outputs if MIME in o.get("data", {})]
    assert len(shown) == 1, "the last cell displays findings.summary() (record the lecture)"
    return shown[0]["data"][MIME]


@pytest.mark.parametrize("name", LECTURES)
def test_a_lecture_ends_with_its_findings_summary_under_a_line_that_reads_it(name):
    nb = _nb(name)
    last, before = nb.cells[-1], nb.cells[-2]
    assert last.cell_type == "code" and last.source.strip().endswith("findings.summary()")
    assert before.cell_type == "markdown" and "chance alone" in before.source
    summary = _summary(nb)
    assert summary["kind"] == "summary"
    text = "".join(o["data"].get("text/markdown", "") for o in last.outputs if "data" in o)
    assert text.startswith("**Findings of this run**")


@pytest.mark.parametrize("name", LECTURES)
def test_a_lecture_that_compares_declares_its_family_before_its_first_verdict(name):
    code = [c for c in _nb(name).cells if c.cell_type == "code"]
    judging = [i for i, c in enumerate(code) if any(v in c.source for v in VERDICTS)]
    declaring = [i for i, c in enumerate(code) if "findings.family(" in c.source]
    if not judging:  # fits only (lecture 01): nothing to count, nothing declared
        assert not declaring
        return
    assert declaring and declaring[0] < judging[0], "findings.family(K) in an early code cell"
    assert "parameters" not in code[declaring[0]].metadata.get("tags", [])  # after papermill's


@pytest.mark.parametrize("name", LECTURES)
def test_the_recorded_family_was_declared_large_enough_and_given_its_repeats(name):
    summary = _summary(_nb(name))
    if summary["comparisons"] == 0:
        return
    assert summary["declared"] is not None
    assert summary["comparisons"] <= summary["declared"]  # else "More than the K declared"
    assert summary["withdrawn"] == []
    assert summary["too_few_repeats"] == []  # every verdict could separate at its level
