"""Lab 01 end to end: its student version is graded like a student's, correct and unfinished."""

from __future__ import annotations

import shutil

import nbformat
import pytest

from course.grade import Limits, grade
from course.syllabus import REPO, load_syllabus

LAB = REPO / "solutions" / "lab01_ddp_scaling.ipynb"
AUTO = {
    "test_shard_indices": 2,
    "test_average_gradients": 3,
    "test_speedup_table": 2,
    "test_bytes_theory": 2,
    "test_resnet18_prediction": 2,
}
MANUAL = {"answer_gap", "answer_gradients", "answer_slower"}


def test_the_unfinished_student_version_says_what_to_do():
    student = nbformat.read(REPO / "labs" / "lab01_ddp_scaling.ipynb", as_version=4)
    stubs = [c.source for c in student.cells if "NotImplementedError" in c.source]
    # shard_indices, average_gradients, speedup_table, bytes_theory (two functions), the prediction
    assert len(stubs) == 5
    assert all("replace this line with your solution" in s for s in stubs)
    assert not any(
        "BEGIN HIDDEN TESTS" in c.source or "BEGIN SOLUTION" in c.source for c in student.cells
    )


@pytest.mark.slow
def test_grading_the_solution_and_the_unfinished_lab(tmp_path):
    subs = tmp_path / "subs"
    subs.mkdir()
    shutil.copy(LAB, subs / "perfect.ipynb")  # the solution is a perfect submission
    shutil.copy(REPO / "labs" / "lab01_ddp_scaling.ipynb", subs / "untouched.ipynb")
    quick = next(e for e in load_syllabus() if e.path == LAB).parameters("quick")
    results = grade(
        LAB,
        subs,
        tmp_path / "out",
        jobs=2,
        parameters=quick,
        progress=False,
        limits=Limits(cell_timeout=120, budget=300),
    )
    perfect, untouched = results["perfect"], results["untouched"]
    assert perfect.status == "graded" and untouched.status == "graded", (
        perfect.reason,
        untouched.reason,
    )
    assert {g: perfect.scores[g] for g in AUTO} == {g: float(p) for g, p in AUTO.items()}, (
        perfect.errors
    )
    assert perfect.total == sum(AUTO.values()) == 11
    assert all(perfect.scores[g] is None for g in MANUAL)  # written answers wait for a person
    assert untouched.total == 0.0
    assert "NotImplementedError" in untouched.errors["test_shard_indices"]
