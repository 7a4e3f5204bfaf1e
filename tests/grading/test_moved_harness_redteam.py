"""Attacks on the harness moved into ``helpers.labs.lab07_runs``: lab 07's merge question, graded.

The question asks a student to *write* the merge of two partial attentions; the course has it
finished (``helpers.parallel.context.merge``). The locked harness runs the answer through
``lab07_runs.merge_case``, which runs it under ``helpers.labs.finished.finished_calls`` (a call
hook, in the student's kernel) and returns the course's functions it called; the check fails an
answer that called one. Since the move, that hook is a global of an importable module the
kernel holds, found at call time, and its record is a set the hook's closure holds: both are
the student's to reach. Each submission is the released question filled in as a student who
wants the points without the work would fill it, graded for real on a copy of the lab cut to
part 1 (the solution's own cells, so the test follows the lab).

Controls: the solution scores 2; the course's merge called plainly scores 0; the hook's
function replaced by ``lab07_runs.finished_calls = ...`` scores 2 but is flagged for a person.
The attacks, each flagged for a person (course.grading.tampering): the hook replaced through the
module's dict, and the hook's own record emptied by the answer through ``sys.getprofile()``.
"""

from __future__ import annotations

import nbformat
import pytest
from grading_fixtures import grade_answers

from course.grading import cells
from course.syllabus import REPO

SEED = 5  # a hidden seed other than the public 0
PART1 = ("lab07_setup", "merge", "merge_harness", "test_merge")

# the course's merge, under the answer's name: the question is to write it
COURSE = "merge = context.merge"
PASSTHROUGH = "lambda fn, finished, *a, **k: (fn(*a, **k), [])"

CONTROLS = {  # name: (the answer cell, its points, flagged)
    "course_merge": (COURSE, 0.0, False),
    "hook_replaced_by_attribute": (
        f"lab07_runs.finished_calls = {PASSTHROUGH}\n{COURSE}",
        2.0,  # right values made another way: the point stands, a person reads the flag
        True,
    ),
}
ATTACKS = {  # name: the answer cell; each scores 0 or is flagged
    # a store into the module's dict is a subscript, not `module.name = ...`: vars() is flagged,
    # and so is `lab07_runs.__dict__[...] = ...` (tampering.SUSPECT_ATTRIBUTES)
    "hook_replaced_through_vars": (
        f"from helpers.labs import lab07_runs as _r\nvars(_r)['finished_calls'] = {PASSTHROUGH}\n{COURSE}"
    ),
    # finished_calls notes the course's calls in a set its hook's closure holds; sys.getprofile()
    # hands the hook to the answer, which empties the set after calling the course's merge.
    # sys.getprofile and __closure__ are flagged (the hook itself cannot hide what it holds)
    "hook_record_emptied": (
        "import sys\n\n"
        "def merge(out_a, lse_a, out_b, lse_b):\n"
        "    out = context.merge(out_a, lse_a, out_b, lse_b)\n"
        "    for cell in sys.getprofile().__closure__ or ():\n"
        "        if isinstance(cell.cell_contents, set):\n"
        "            cell.cell_contents.clear()\n"
        "    return out"
    ),
}


def part1() -> nbformat.NotebookNode:
    """The solution of lab 07 cut to part 1: its intro, parameters, set-up and the merge question."""
    nb = nbformat.read(REPO / "solutions" / "lab07_transformers_at_scale.ipynb", as_version=4)
    keep = list(nb.cells[:2])  # the intro and the parameters cell
    at = next(i for i, c in enumerate(nb.cells) if cells.grade_id(c) == "merge")
    keep += [c for c in nb.cells if cells.grade_id(c) in PART1 or c is nb.cells[at - 1]]
    nb.cells = keep
    assert [cells.grade_id(c) for c in nb.cells if cells.grade_id(c)][-4:] == list(PART1)
    return nb


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    solution = next(c.source for c in part1().cells if cells.grade_id(c) == "merge")
    answers = {"right": solution} | {n: a for n, (a, _, _) in CONTROLS.items()} | ATTACKS
    root = tmp_path_factory.mktemp("moved-harness-redteam")
    return grade_answers(root, part1(), "lab07_transformers_at_scale.ipynb", "merge", answers, SEED)


def test_the_solution_scores_the_merge(graded):
    result = graded["right"]
    assert result.status == "graded", result.reason
    assert result.scores["test_merge"] == 2.0, result.errors
    assert result.flags == [], result.flags


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_the_controls_score_what_they_earn_and_are_flagged_as_they_should(graded, name):
    points, flagged = CONTROLS[name][1:]
    result = graded[name]
    assert result.status == "graded", result.reason
    assert result.scores["test_merge"] == points, (name, result.errors)
    assert bool(result.flags) == flagged, (name, result.flags)


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_the_course_merge_behind_a_silenced_hook_earns_nothing_or_is_flagged(graded, name):
    result = graded[name]
    assert result.status == "graded", result.reason
    assert result.scores["test_merge"] == 0.0 or result.flags, (name, result.scores, result.flags)
