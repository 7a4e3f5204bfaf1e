"""Grading a lab like a class would hand it in: the solution, the untouched student version, and
submissions built from plausible wrong answers. Shared by the tests of every lab."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import nbformat

from course.grade import grade
from course.grading import cells
from course.grading.results import Limits
from course.syllabus import load_syllabus


def wrong_submissions(wrong: dict, halves: int = 0) -> dict[str, dict[str, str]]:
    """{name: {solution grade_id: wrong source}} from ``wrong`` = {grade_id: (test, [variants])}.

    Submission ``wrong{v}`` holds variant v of every question that has one (right where it has
    none: a question with fewer variants is right in the last submissions, so a wrong answer
    elsewhere is seen not to cost its points). The first ``halves`` variants are instead split
    in two submissions, ``wrong{v}a`` and ``wrong{v}b``, each wrong in every other question and
    right in the rest: a wrong answer must cost only its own points. Every variant is graded
    once, in as few submissions as that allows (grading a class is most of the suite's time).
    The price: in a submission wrong everywhere, a wrong answer that broke what another
    question's test relies on would hide whether that question's own wrong answer is caught;
    the halves, and the last submissions where short lists of variants have run out, show
    the questions' tests independent of each other."""
    subs = {}
    order = list(wrong)
    most = max(len(variants) for _, variants in wrong.values())
    for v in range(most):
        for parity in (0, 1) if v < halves else (None,):
            chosen = {
                gid: textwrap.dedent(wrong[gid][1][v]).strip()
                for i, gid in enumerate(order)
                if (parity is None or i % 2 == parity) and v < len(wrong[gid][1])
            }
            if chosen:
                subs[f"wrong{v}{'' if parity is None else 'ab'[parity]}"] = chosen
    return subs


def write_submission(lab: Path, path: Path, replace: dict[str, str]) -> None:
    nb = nbformat.read(lab, as_version=4)
    for cell in nb.cells:
        gid = cells.grade_id(cell)
        if gid in replace:
            cell.source = replace[gid]
    nbformat.write(nb, path)


def trimmed(path: Path, folder: Path, markers: tuple) -> Path:
    """A copy of notebook ``path`` in ``folder`` without the code cells that contain one of
    ``markers`` (ungraded timing, sweep and plot cells: grading a class is faster without them)."""
    nb = nbformat.read(path, as_version=4)
    keep = [
        c for c in nb.cells if not (c.cell_type == "code" and any(m in c.source for m in markers))
    ]
    assert len(nb.cells) - len(keep) == len(markers), "every ungraded cell named is found once"
    nb.cells = keep
    out = folder / path.name
    nbformat.write(nb, out)
    return out


def override(path: Path, values: dict) -> None:
    """Set ``values`` in a cell after the notebook's parameters cell, as papermill injects them."""
    if not values:
        return
    nb = nbformat.read(path, as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    source = "\n".join(f"{name} = {value!r}" for name, value in values.items())
    nb.cells.insert(
        at + 1, nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    )
    nbformat.write(nb, path)


def grade_class(
    lab: Path,
    student: Path,
    wrong: dict,
    tmp: Path,
    halves: int = 0,
    overrides: dict | None = None,
    limits: Limits | None = None,
    entry: Path | None = None,
) -> dict:
    """Grade the solution (perfect), the student version (untouched) and every wrong submission.

    ``entry``: the syllabus path whose quick profile applies (default ``lab``; a trimmed copy of
    a lab in a temporary folder names its original)."""
    subs = tmp / "subs"
    subs.mkdir()
    shutil.copy(lab, subs / "perfect.ipynb")  # the solution is a perfect submission
    shutil.copy(student, subs / "untouched.ipynb")
    for name, replace in wrong_submissions(wrong, halves).items():
        write_submission(lab, subs / f"{name}.ipynb", replace)
    quick = next(e for e in load_syllabus() if e.path == (entry or lab)).parameters("quick")
    return grade(
        lab,
        subs,
        tmp / "out",
        jobs=2,
        parameters={**quick, **(overrides or {})},
        progress=False,
        limits=limits or Limits(cell_timeout=120, budget=400),
    )


def grade_trimmed(
    lab: Path, student: Path, wrong: dict, ungraded: tuple, tmp: Path, **kwargs
) -> dict:
    """``grade_class`` on copies of the lab and its student version without the ``ungraded``
    cells (timing, sweeps, plots), with the quick profile of ``lab`` itself."""
    (tmp / "lab").mkdir(), (tmp / "student").mkdir()
    return grade_class(
        trimmed(lab, tmp / "lab", ungraded),
        trimmed(student, tmp / "student", ungraded),
        wrong,
        tmp,
        entry=lab,
        **kwargs,
    )


def assert_wrong_answers_lose_their_points(graded: dict, wrong: dict, auto: dict, halves=0):
    for name, replace in wrong_submissions(wrong, halves).items():
        result = graded[name]
        assert result.status == "graded", (name, result.reason)
        wrong_tests = {wrong[gid][0] for gid in replace}
        for test, points in auto.items():
            want = 0.0 if test in wrong_tests else float(points)
            assert result.scores[test] == want, (name, test, result.scores, result.errors)


def assert_perfect_scores_all_and_untouched_none(graded: dict, auto: dict, manual: set) -> None:
    perfect, untouched = graded["perfect"], graded["untouched"]
    assert perfect.status == "graded" and untouched.status == "graded", (
        perfect.reason,
        untouched.reason,
    )
    assert {g: perfect.scores[g] for g in auto} == {g: float(p) for g, p in auto.items()}, (
        perfect.errors
    )
    assert perfect.total == sum(auto.values())
    assert all(perfect.scores[g] is None for g in manual)  # written answers wait for a person
    assert untouched.total == 0.0


def assert_wrong_answers_are_wrong(lab: Path, wrong: dict, auto: dict) -> None:
    """Every automatic test has wrong answers; each replaces a solution cell and differs from it
    and from the other variants (a "wrong" answer equal to the solution tests nothing)."""
    solution = {cells.grade_id(c): c.source for c in nbformat.read(lab, as_version=4).cells}
    assert {test for test, _ in wrong.values()} == set(auto)
    for gid, (_, variants) in wrong.items():
        assert gid in solution, gid
        assert len({v.strip() for v in variants}) == len(variants), gid
        assert all(v.strip() != solution[gid].strip() for v in variants), gid


def assert_student_version_has_stubs(student: Path, stubs: int) -> None:
    """The released lab: ``stubs`` cells that raise NotImplementedError, no solution and no hidden
    test left in it."""
    nb = nbformat.read(student, as_version=4)
    assert sum("NotImplementedError" in c.source for c in nb.cells) == stubs
    assert not any("BEGIN HIDDEN" in c.source or "BEGIN SOLUTION" in c.source for c in nb.cells)
