"""A small nbgrader-format assignment and submissions to grade (good, wrong, hostile, broken).

Shared by tests/grading/test_grade.py and benchmarks/grading_bench.py. The assignment is plain Python
(no ranks), so nbgrader's own autograder can grade it too.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from course.kernel import KERNELSPEC
from course.release import student_version

POINTS = {"test_square": 2, "test_mean": 3, "test_noisy": 1}  # auto-graded; "why" (1) is manual


def meta(gid, **kw):
    base = {
        "grade_id": gid,
        "schema_version": 3,
        "grade": False,
        "solution": False,
        "locked": False,
    }
    return {"nbgrader": {**base, **kw}}


def source() -> nbformat.NotebookNode:
    return new_notebook(
        metadata={"kernelspec": KERNELSPEC, "language_info": {"name": "python"}},
        cells=[
            new_markdown_cell("# Problem set 1", metadata=meta("intro", locked=True)),
            new_code_cell(
                "import math\nimport sys\nimport warnings", metadata=meta("imports", locked=True)
            ),
            new_code_cell(
                "def square(x):\n    ### BEGIN SOLUTION\n    return x * x\n    ### END SOLUTION",
                metadata=meta("square", solution=True),
            ),
            new_code_cell(
                "square_3 = square(3)\n### BEGIN HIDDEN TESTS\n# hidden inputs fixed: a toy, whose scores the tests know\n"
                "square_more = [square(-4), square(0.5)]\n"
                "### END HIDDEN TESTS\n# --- check ---\nassert square_3 == 9, square_3\n"
                "### BEGIN HIDDEN TESTS\nassert square_more == [16, 0.25], square_more\n"
                "### END HIDDEN TESTS",
                metadata=meta("test_square", grade=True, points=2),
            ),
            new_code_cell(
                "def mean(xs):\n    ### BEGIN SOLUTION\n    return sum(xs) / len(xs)\n    ### END SOLUTION",
                metadata=meta("mean", solution=True),
            ),
            new_code_cell(
                "inputs = [[1, 2, 3], [5], [-1, 1]]\n"
                "### BEGIN HIDDEN TESTS\n# hidden inputs fixed: a toy, whose scores the tests know\n"
                "inputs.append([2, 4, 6, 8])\n### END HIDDEN TESTS\n"
                "means = [mean(xs) for xs in inputs]\n# --- check ---\nimport math\n"
                "want = [2.0, 5.0, 0.0]\n"
                "### BEGIN HIDDEN TESTS\nwant.append(5.0)\n### END HIDDEN TESTS\n"
                "assert len(means) == len(want), means\n"
                "right = sum(math.isclose(got, w) for got, w in zip(means, want, strict=True))\n"
                "3 * right / len(want)",
                metadata=meta("test_mean", grade=True, points=3),
            ),
            new_code_cell(
                "warnings.warn('a harmless library warning')\nprint('noise on stderr', file=sys.stderr)\n"
                "square_2 = square(2)\n# --- check ---\nassert square_2 == 4",
                metadata=meta("test_noisy", grade=True, points=1),
            ),
            new_markdown_cell(
                "Why is the square never negative?",
                metadata=meta("why", solution=True, grade=True, points=1),
            ),
        ],
    )


def release(folder: Path) -> tuple[Path, nbformat.NotebookNode]:
    """Write the source as folder/source/ps1.ipynb; return its path and the student version."""
    path = folder / "source" / "ps1.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(source(), path)
    return path, student_version(source())


def answer(student, square="return x * x", mean="return sum(xs) / len(xs)"):
    nb = nbformat.from_dict(student)
    for cell in nb.cells:
        gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        if gid == "square":
            cell.source = f"def square(x):\n    {square}"
        elif gid == "mean":
            cell.source = f"def mean(xs):\n    {mean}"
        elif gid == "why":
            cell.source = "A real number times itself is never negative."
    return nb


def cell_index(nb, gid):
    return next(
        i
        for i, c in enumerate(nb.cells)
        if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == gid
    )


def plain_submissions(student) -> dict[str, nbformat.NotebookNode]:
    """Honest submissions with known scores (the nbgrader cross-check uses these)."""
    subs = {
        "correct": answer(student),
        "wrong_square": answer(student, square="return x * 3"),
        "partial_mean": answer(student, mean="return sum(xs) / 3"),  # right for 2 of 4 cases
        "unanswered": nbformat.from_dict(student),
    }
    return subs


EXPECTED = {  # total auto-graded points of each plain submission
    "correct": 6.0,
    "wrong_square": 3.0,  # test_square and test_noisy (square(2) == 4) fail; test_mean passes
    "partial_mean": 2 + 1.5 + 1,  # mean right for 2 of the 4 cases: 3 * 2/4 partial credit
    "unanswered": 0.0,
}


def write(folder: Path, subs: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, nb in subs.items():
        if isinstance(nb, bytes):
            (folder / name).write_bytes(nb)
        elif isinstance(nb, str):
            (folder / name).write_text(nb)
        else:
            nbformat.write(nb, folder / f"{name}.ipynb")
    return folder


def grade_answers(root: Path, lab: nbformat.NotebookNode, name: str, gid: str, answers: dict, seed):
    """Grade each of ``answers`` ({submission: source}) written into the cell ``gid`` of the
    student version of ``lab`` (a solution, often cut to one part, saved as ``name``), for real:
    one slot, generous limits, the hidden cases of ``seed``. {submission: Result}."""
    from course.grade import grade
    from course.grading import cells
    from course.grading.results import Limits

    source = root / "source" / name
    source.parent.mkdir(parents=True)
    nbformat.write(lab, source)
    student = student_version(lab)
    subs = {}
    for sub, code in answers.items():
        nb = nbformat.from_dict(student)
        next(c for c in nb.cells if cells.grade_id(c) == gid).source = code
        subs[sub] = nb
    limits = Limits(cell_timeout=120, budget=300)
    return grade(
        source, write(root / "subs", subs), root / "out", jobs=1, progress=False, limits=limits,
        hidden_seed=seed,
    )  # fmt: skip


def raw(nb) -> str:
    return json.dumps(nb)


def nbgrader_grade(
    workdir: Path, subs_answers: dict, source_nb=None
) -> dict[str, dict[str, float]]:
    """Grade with nbgrader's own generate_assignment + autograde; per-question scores.

    ``subs_answers`` maps a student to a function student_notebook -> submission, so each tool
    grades the same answers written into its own release of the assignment.
    """
    import subprocess
    import sys

    from nbgrader.api import Gradebook

    root = workdir / "nbgrader-course"
    (root / "source" / "ps1").mkdir(parents=True, exist_ok=True)
    nbformat.write(source_nb or source(), root / "source" / "ps1" / "ps1.ipynb")
    (root / "nbgrader_config.py").write_text(
        f"c = get_config()\nc.CourseDirectory.root = {str(root)!r}\nc.ExecutePreprocessor.timeout = 120\n"
    )
    nbgrader = [sys.executable, "-m", "nbgrader"]
    import os

    # nbgrader runs `alembic` by name: the environment's bin must be on PATH.
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }

    def run(*args):
        return subprocess.run([*nbgrader, *args], cwd=root, capture_output=True, text=True, env=env)

    done = run("generate_assignment", "ps1", "--force")
    if done.returncode:
        raise RuntimeError(
            f"nbgrader generate_assignment failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    released = nbformat.read(root / "release" / "ps1" / "ps1.ipynb", as_version=4)
    for name, make in subs_answers.items():
        path = root / "submitted" / name / "ps1" / "ps1.ipynb"
        path.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(make(released), path)
    done = run("autograde", "ps1", "--force", "--create")
    if done.returncode:
        raise RuntimeError(
            f"nbgrader autograde failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    out = {}
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        for name in subs_answers:
            sub = gb.find_submission_notebook("ps1", "ps1", name)  # notebook, assignment, student
            out[name] = {g.name: g.score for g in sub.grades}
    return out


ANSWERS = {  # the honest submissions, as functions of a released notebook
    "correct": lambda nb: answer(nb),
    "wrong_square": lambda nb: answer(nb, square="return x * 3"),
    "partial_mean": lambda nb: answer(nb, mean="return sum(xs) / 3"),
    "unanswered": lambda nb: nbformat.from_dict(nb),
}


def user_exists(name: str) -> bool:
    """Whether the local user ``name`` exists (the exchange tests make and remove real users)."""
    import pwd

    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


@pytest.fixture(scope="module", name="lab")
def exchange_lab(tmp_path_factory):
    """(the tiny lab's solution, its released version labs/ps1.ipynb, the student notebook), for
    the exchange tests: `from grading_fixtures import exchange_lab` gives them the fixture "lab"."""
    root = tmp_path_factory.mktemp("exchange-lab")
    src, student = release(root)
    released = root / "labs" / "ps1.ipynb"
    released.parent.mkdir()
    nbformat.write(student, released)
    return src, released, student
