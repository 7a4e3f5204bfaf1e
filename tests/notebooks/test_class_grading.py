"""Every lab graded as a class would hand it in, through `course grade`: one test for all labs.

For each lab, the two half-wrong submissions of ``lab_grading.grade_trimmed`` (the released lab
filled in, each wrong in every other question, right in the rest), graded once, in one round of
the grader's two slots: every right answer earns its points, every wrong one loses its own and
only those. The wrong answers, the cells left out and the quicker parameters are the lab's own
test module's (tests/notebooks/test_labNN.py: WRONG, UNGRADED, AUTO, MANUAL and, where it has
one, FASTER); its verdict kernel and replay attack stay there.

One module-scoped fixture per lab: pytest groups the parametrised tests by lab, so each lab's
class is graded once per suite, and a lab's grading is dropped before the next one starts.
"""

from __future__ import annotations

import importlib

import lab_grading
import nbformat
import pytest

from course.grading import cells
from course.syllabus import load_syllabus

LABS = [e.path.stem.split("_")[0] for e in load_syllabus() if e.kind == "lab"]  # lab01, ...


def lab_module(lab: str):
    """The lab's own test module (it sits beside this one, on pytest's path)."""
    return importlib.import_module(f"test_{lab}")


def automatic_points(path) -> dict[str, float]:
    """{grade_id: points} of the notebook's graded test cells (what the grader scores itself)."""
    return {
        cells.grade_id(c): cells.info(c)["points"]
        for c in nbformat.read(path, as_version=4).cells
        if c.cell_type == "code" and cells.is_graded(c) and not cells.info(c).get("solution")
    }


@pytest.fixture(scope="module", params=LABS)
def graded(request, tmp_path_factory):
    """(the lab's test module, the grader's results), graded once per lab: on copies without
    the ungraded cells (timings, sweeps, plots), with the lab's FASTER parameters where it has
    them (fewer repeats and steps: the graded cells' figures are checked for form and against
    each other, never against a time)."""
    lab = lab_module(request.param)
    tmp = tmp_path_factory.mktemp(f"{request.param}-class")
    faster = getattr(lab, "FASTER", None)
    results = lab_grading.grade_trimmed(
        lab.LAB, lab.STUDENT, lab.WRONG, lab.UNGRADED, tmp, overrides=faster
    )
    return lab, results


@pytest.mark.slow
@pytest.mark.timeout(1800)  # grading the class (the fixture) runs inside the first test of a lab
def test_right_answers_score_every_automatic_point(graded):
    lab, results = graded
    # AUTO, which the assertions read, is every automatic test of the lab at its points
    assert lab.AUTO == automatic_points(lab.LAB), (lab.LAB.name, lab.AUTO)
    lab_grading.assert_right_answers_score_every_point(results, lab.WRONG, lab.AUTO, lab.MANUAL)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # run alone, it grades the class itself
def test_each_plausible_wrong_answer_loses_its_points_and_only_those(graded):
    lab, results = graded
    lab_grading.assert_wrong_answers_lose_their_points(results, lab.WRONG, lab.AUTO)
