"""Hidden cases drawn from the grading run's seed (course.grading.seeds): a table of one run's
hidden inputs and answers, printed into its feedback and solved offline, scores 0 in the next
run, while a correct answer scores fully whatever the seed."""

from __future__ import annotations

import json
import random

import nbformat
import pytest
from grading_fixtures import KERNELSPEC, meta
from nbformat.v4 import new_code_cell, new_notebook

from course.grade import grade
from course.grading import cells, seeds

# The probe and the check each draw the cases from COURSE_HIDDEN_SEED (0 outside grading); the
# check looks its own cases up in the probe's data, never loops over what the probe sent.
TEST = """\
digits_10 = digit_sum(10)
### BEGIN HIDDEN TESTS
import os, random
_rng = random.Random(int(os.environ.get("COURSE_HIDDEN_SEED", "0")))
swept = {n: digit_sum(n) for n in [_rng.randrange(10**6) for _ in range(6)]}
### END HIDDEN TESTS
# --- check ---
assert digits_10 == 1, digits_10
### BEGIN HIDDEN TESTS
import os, random
_rng = random.Random(int(os.environ.get("COURSE_HIDDEN_SEED", "0")))
for n in [_rng.randrange(10**6) for _ in range(6)]:
    assert swept.get(n) == sum(map(int, str(n))), n
### END HIDDEN TESTS
"""
SOLUTION = "def digit_sum(n):\n    ### BEGIN SOLUTION\n    return sum(map(int, str(n)))\n    ### END SOLUTION"


def source() -> nbformat.NotebookNode:
    return new_notebook(
        metadata={"kernelspec": KERNELSPEC, "language_info": {"name": "python"}},
        cells=[
            new_code_cell(SOLUTION, metadata=meta("digit_sum", solution=True)),
            new_code_cell(TEST, metadata=meta("test_digit_sum", grade=True, points=2)),
            new_code_cell(
                "### BEGIN SOLUTION\nnotes = None\n### END SOLUTION",
                metadata=meta("notes", solution=True),
            ),
        ],
    )


def submission(body: str, notes: str = "notes = None") -> nbformat.NotebookNode:
    nb = source()
    nb.cells[0].source = "def digit_sum(n):\n" + body
    nb.cells[2].source = notes
    return nb


# A test cell's own output is the check's, in the feedback; what the student's code saw during
# the probe it keeps, and prints in a later cell of its own.
SPY = """\
    SEEN.append(n)
    return 1 if n == 10 else 0
SEEN = []
"""
SPY_NOTES = "for n in SEEN:\n    print('ASKED', n)"


def graded(tmp_path, subs: dict, seed: int, name: str) -> dict:
    lab = tmp_path / "lab.ipynb"
    nbformat.write(source(), lab)
    folder = tmp_path / f"subs-{name}"
    folder.mkdir()
    for student, nb in subs.items():
        nbformat.write(nb, folder / f"{student}.ipynb")
    return grade(lab, folder, tmp_path / f"out-{name}", hidden_seed=seed, progress=False)


def asked(result) -> list[int]:
    nb = nbformat.read(result.executed, as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    return [int(line.split()[1]) for line in text.splitlines() if line.startswith("ASKED ")]


def test_the_source_obeys_the_release_rules():
    cells.validate(source())  # the check loops over its own draws, not over the probe's data


def test_a_table_of_the_last_runs_hidden_cases_scores_nothing_in_the_next(tmp_path):
    first_run = random.randrange(1, 2**31)
    # Run 1: the spy prints every input it is called with; its feedback shows them.
    spy = graded(tmp_path, {"student": submission(SPY, SPY_NOTES)}, first_run, "spy")["student"]
    inputs = [n for n in asked(spy) if n != 10]
    assert spy.scores["test_digit_sum"] == 0.0 and len(inputs) == 6, (spy.errors, inputs)
    assert spy.hidden_seed == seeds.for_submission(seeds.run_seed(first_run), "student")
    # Offline, the student solves those inputs and submits the answers as a table.
    table = {n: sum(map(int, str(n))) for n in [10, *inputs]}
    body = f"    return {json.dumps({str(k): v for k, v in table.items()})}.get(str(n), 0)\n"
    subs = {"student": submission(body), "correct": source(), "forger": forger()}
    # The same seed again (what fixed hidden inputs amount to): the table passes...
    replay = graded(tmp_path, subs, first_run, "replay")
    assert replay["student"].scores["test_digit_sum"] == 2.0, replay["student"].errors
    # ...a new run's seed draws new cases: the table scores 0, a correct answer 2.
    fresh = graded(tmp_path, subs, first_run + 1, "fresh")
    assert fresh["student"].scores["test_digit_sum"] == 0.0
    assert fresh["student"].hidden_seed != replay["student"].hidden_seed
    assert fresh["correct"].scores["test_digit_sum"] == 2.0, fresh["correct"].errors
    # A kernel that sets the seed itself only asks itself the wrong questions: the check draws
    # from the grader's seed, and looks its own cases up.
    forged = fresh["forger"]
    assert forged.status == "graded" and forged.scores["test_digit_sum"] == 0.0, forged.reason
    assert "AssertionError" in forged.errors["test_digit_sum"]


def forger() -> nbformat.NotebookNode:
    """A table of seed 0's cases (a plain run's, anyone's to see), with the kernel's seed set to
    0 so that the probe asks exactly those."""
    rng = random.Random(0)
    table = {n: sum(map(int, str(n))) for n in [10] + [rng.randrange(10**6) for _ in range(6)]}
    return submission(
        "    import os\n    os.environ['COURSE_HIDDEN_SEED'] = '0'\n"
        f"    return {json.dumps({str(k): v for k, v in table.items()})}.get(str(n), 0)\n"
    )


@pytest.mark.parametrize("run", [1, 2, 3, 4, 5])
def test_seeds_differ_by_student_and_run_and_are_never_the_public_zero(run):
    key = seeds.run_seed(run)
    a, b = seeds.for_submission(key, "ann"), seeds.for_submission(key, "bob")
    assert a != b and a != seeds.for_submission(seeds.run_seed(run + 100), "ann")
    assert 0 < a < 2**31 and 0 < b < 2**31
    assert seeds.run_seed() != seeds.run_seed() and len(seeds.run_seed()) == 16  # 128 bits
