"""`course release`: the student version of a solution notebook, and the errors of bad authoring."""

from __future__ import annotations

import subprocess
import sys

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from course.grading import cells
from course.kernel import KERNELSPEC
from course.release import release, student_version


def nbg(gid, **kw):
    return {
        "nbgrader": {
            "grade_id": gid,
            "schema_version": 3,
            "grade": False,
            "solution": False,
            "locked": False,
            **kw,
        }
    }


TEST = (
    "got = shard(4, 0, 2)\n### BEGIN HIDDEN TESTS\n"
    "# hidden inputs fixed: a toy, whose cases the tests spell out\n"
    "more = shard(5, 1, 2)\n### END HIDDEN TESTS\n"
    "# --- check ---\nassert got == [0, 2]\n### BEGIN HIDDEN TESTS\nassert more == [1, 3]\n"
    "### END HIDDEN TESTS"
)


def solution_notebook():
    return new_notebook(
        metadata={"kernelspec": KERNELSPEC},
        cells=[
            new_markdown_cell("# Lab", metadata=nbg("intro", locked=True)),
            new_code_cell("world_size = 2", metadata={"tags": ["parameters"]}),
            new_code_cell(
                "def shard(n, rank, size):\n    ### BEGIN SOLUTION\n    return list(range(rank, n, size))\n"
                "    ### END SOLUTION",
                metadata=nbg("shard", solution=True),
                execution_count=3,
                outputs=[nbformat.v4.new_output("stream", text="x\n")],
            ),
            new_code_cell(TEST, metadata=nbg("test_shard", grade=True, points=2)),
            new_markdown_cell(
                "It scales because...", metadata=nbg("why", solution=True, grade=True, points=1)
            ),
        ],
    )


def test_student_version_stubs_solutions_hides_tests_clears_outputs_and_locks():
    student = student_version(solution_notebook())
    code = student.cells[2]
    assert (
        code.source
        == 'def shard(n, rank, size):\n    raise NotImplementedError("shard: replace this line with your solution")'
    )
    assert code.outputs == [] and code.execution_count is None
    assert student.cells[3].source == "got = shard(4, 0, 2)\n# --- check ---\nassert got == [0, 2]"
    assert student.cells[4].source == "YOUR ANSWER HERE"
    from nbgrader.utils import compute_checksum  # nbgrader's own, to check ours against

    for cell in student.cells:  # graded, solution and locked cells carry nbgrader's checksum
        i = cells.info(cell)
        if i.get("grade") or i.get("solution") or i.get("locked"):
            assert i["checksum"] == compute_checksum(cell) == cells.nbgrader_checksum(cell)
            assert i["cell_type"] == cell.cell_type


def test_release_is_deterministic_and_idempotent(tmp_path):
    src = tmp_path / "lab.ipynb"
    nbformat.write(solution_notebook(), src)
    a = release(src, tmp_path / "a.ipynb").read_bytes()
    b = release(src, tmp_path / "b.ipynb").read_bytes()
    assert a == b
    again = release(tmp_path / "a.ipynb", tmp_path / "c.ipynb").read_bytes()  # releasing a release
    assert again == a


def test_the_stub_raises_a_clear_not_implemented_error():
    student = student_version(solution_notebook())
    namespace = {}
    exec(student.cells[2].source, namespace)
    with pytest.raises(NotImplementedError, match="shard: replace this line with your solution"):
        namespace["shard"](4, 0, 2)


def test_cell(source):
    """A mutation: the graded test cell's source replaced by ``source``."""
    return lambda nb: nb.cells[3].__setitem__("source", source)


test_cell.__test__ = False  # a helper, not a test


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda nb: nb.cells[2].__setitem__("source", "### BEGIN SOLUTION\nx = 1"),
            "is never closed",
        ),
        (
            lambda nb: nb.cells[2].__setitem__("source", "x = 1\n### END SOLUTION"),
            "without a '### BEGIN SOLUTION'",
        ),
        (
            lambda nb: nb.cells[3].metadata.nbgrader.__setitem__("grade_id", "shard"),
            "grade_id 'shard' is already used by cell 2",
        ),
        (lambda nb: nb.cells[3].metadata.nbgrader.pop("points"), "a graded cell needs points"),
        (
            lambda nb: nb.cells.append(new_code_cell("y = 1", metadata={"tags": ["parameters"]})),
            "2 cells are tagged 'parameters'",
        ),
        (
            lambda nb: nb.cells[3].metadata.nbgrader.__setitem__("grade_id", "has space"),
            "letters, digits",
        ),
        # The probe / check convention of graded test cells (course.grading.cells.validate_test).
        (
            test_cell("assert shard(4, 0, 2) == [0, 2]"),
            r"exactly one '# --- check ---' line, found 0",
        ),
        (
            test_cell("got = shard(4, 0, 2)\n# --- check ---\n# --- check ---\nassert got"),
            "found 2",
        ),
        (
            test_cell("got = 1\n### BEGIN HIDDEN TESTS\n# --- check ---\n### END HIDDEN TESTS"),
            "inside hidden tests",
        ),
        (
            test_cell("got = shard(4, 0, 2)\nassert got\n# --- check ---\nassert got == [0, 2]"),
            "the probe asserts on line 2: move every assertion below",
        ),
        (
            test_cell("x = 1\nnp.testing.assert_equal(x, 1)\n# --- check ---\nassert x"),
            "the probe asserts on line 2",
        ),
        (
            test_cell("got = shard(4, 0, 2)\n# --- check ---\nassert shard(5, 1, 2) == [1, 3]"),
            "the check reads shard, which its probe does not assign",
        ),
        (
            test_cell(
                "### BEGIN HIDDEN TESTS\n# hidden inputs fixed: a toy\nmore = shard(5, 1, 2)\n"
                "### END HIDDEN TESTS\n# --- check ---\nassert more == [1, 3]"
            ),
            r"the check reads more \(as released, hidden tests left out\)",
        ),
        (
            test_cell(
                "import math\ngot = shard(4, 0, 2)\n# --- check ---\nassert math.isfinite(got[0])"
            ),
            "the check reads math, which the probe imports or defines",
        ),
        (test_cell("%time got = shard(4, 0, 2)\n# --- check ---\nassert got"), "plain Python"),
        # Checks the probe's data can empty (issue 30): a submission that sends [] or {} would
        # pass them without the work.
        (
            test_cell(
                "got = [shard(4, 0, 2)]\n# --- check ---\nfor g in got:\n    assert g == [0, 2]"
            ),
            "check line 1: a loop over got",
        ),
        (
            test_cell("oks = [shard(4, 0, 2) == [0, 2]]\n# --- check ---\nassert all(oks)"),
            "a loop over oks",
        ),
        (
            test_cell(
                "got = [shard(4, 0, 2)]\n# --- check ---\n"
                "assert list(zip(got, [[0, 2]])) == [([0, 2], [0, 2])]"
            ),
            r"zip\(...\) without strict=True",
        ),
        (
            test_cell(
                "got = {4: shard(4, 0, 2)}\n# --- check ---\nwant = {4: [0, 2]}\n"
                "### BEGIN HIDDEN TESTS\nwant[5] = [0, 2, 4]\n### END HIDDEN TESTS\n"
                "for n in want:\n    assert got[n] == want[n], (got[n], want[n])"
            ),
            "a visible part of the check can show n, want, which a hidden part set",
        ),
        (  # through a loop variable: lab 01's test before the rule
            test_cell(
                "got = {4: shard(4, 0, 2)}\n# --- check ---\nwant = {4: [0, 2]}\n"
                "### BEGIN HIDDEN TESTS\nwant.update({5: [0, 2, 4]})\n### END HIDDEN TESTS\n"
                "for n, expected in want.items():\n"
                "    assert got[n] == expected, f'gave {got[n]}, expected {expected}'"
            ),
            "a visible part of the check can show expected, n, which a hidden part set",
        ),
    ],
)
def test_authoring_errors_say_where_and_what(mutate, message):
    nb = solution_notebook()
    mutate(nb)
    with pytest.raises(cells.FormatError, match=message):
        student_version(nb)


@pytest.mark.parametrize(
    "check",
    [
        # the check's own cases, zipped strictly with the answers
        "for want, g in zip([[0, 2]], got, strict=True):\n    assert g == want",
        # the length asserted before the loop
        "assert len(got) == 1\nfor g in got:\n    assert g == [0, 2]",
        # a whole value compared
        "assert got == [[0, 2]]",
        # a visible line after the hidden part that reads only the probe's data
        "assert got == [[0, 2]]\n### BEGIN HIDDEN TESTS\nassert got[0][0] == 0\n"
        "### END HIDDEN TESTS\nprint(got)",
    ],
)
def test_checks_that_hold_against_any_probe_data_are_accepted(check):
    nb = solution_notebook()
    test_cell(f"got = [shard(4, 0, 2)]\n# --- check ---\n{check}")(nb)
    student_version(nb)  # no FormatError


# A hidden probe's inputs must come from the run's seed, or the cell says why they cannot
# (issue 41: lab 02's fixed hidden inputs were printed into a feedback page and tabled).
SEEDED = (
    "got = shard(4, 0, 2)\n### BEGIN HIDDEN TESTS\nimport os, random\n"
    "_rng = random.Random(int(os.environ.get('COURSE_HIDDEN_SEED', '0')))\n"
    "_n = _rng.randint(3, 40)\nmore = {_n: shard(_n, 1, 2)}\n### END HIDDEN TESTS\n"
    "# --- check ---\nassert got == [0, 2]\n### BEGIN HIDDEN TESTS\nimport os, random\n"
    "_rng = random.Random(int(os.environ.get('COURSE_HIDDEN_SEED', '0')))\n"
    "_n = _rng.randint(3, 40)\nassert more == {_n: list(range(1, _n, 2))}\n### END HIDDEN TESTS"
)


def hidden_probe(lines: str) -> str:
    """The test cell with ``lines`` as its hidden probe (fixed inputs: more = shard(5, 1, 2))."""
    return TEST.replace("# hidden inputs fixed: a toy, whose cases the tests spell out\n", lines)


@pytest.mark.parametrize(
    "probe, message",
    [
        ("", "cell 3 .test_shard.: the hidden probe's inputs are fixed"),
        (
            "# hidden inputs fixed:\n",
            "'# hidden inputs fixed:' in the hidden probe gives no reason",
        ),
        ("# hidden inputs fixed:    \n", "gives no reason"),
        # named in a comment only, the seed draws nothing
        (
            "# the seed, COURSE_HIDDEN_SEED, is not read here\n",
            "the hidden probe's inputs are fixed",
        ),
        ("# helpers.labs.hidden_seed() is not called here\n", "inputs are fixed"),
    ],
)
def test_a_hidden_probe_with_fixed_inputs_and_no_reason_is_refused(tmp_path, probe, message):
    nb = solution_notebook()
    test_cell(hidden_probe(probe))(nb)
    with pytest.raises(cells.FormatError, match=message) as refused:
        student_version(nb)
    assert "COURSE_HIDDEN_SEED" in str(refused.value)  # what to do: draw from the seed...
    assert "'# hidden inputs fixed: <why>'" in str(refused.value)  # ...or say why not
    # `course release` names the notebook; `course grade` refuses the same source
    src = tmp_path / "solutions" / "lab.ipynb"
    src.parent.mkdir()
    nbformat.write(nb, src)
    proc = release_cli(src.parent, tmp_path / "labs")
    assert proc.returncode == 2 and "lab.ipynb: cell 3 (test_shard): " in proc.stderr, proc.stderr
    assert not (tmp_path / "labs" / "lab.ipynb").exists()
    from course.grade import grade

    (tmp_path / "subs").mkdir()
    with pytest.raises(cells.FormatError, match=message):
        grade(src, tmp_path / "subs", tmp_path / "out", progress=False)


@pytest.mark.parametrize(
    "source",
    [
        SEEDED,  # drawn from the run's seed
        SEEDED.replace("import os, random", "import random\nfrom helpers import labs").replace(
            "int(os.environ.get('COURSE_HIDDEN_SEED', '0'))", "labs.hidden_seed()"
        ),  # the same, read through helpers.labs
        hidden_probe("# hidden inputs fixed: runs on ranks, their sizes are the lab's\n"),
        # no hidden probe at all: only hidden expectations
        "got = shard(4, 0, 2)\n# --- check ---\nassert got == [0, 2]\n"
        "### BEGIN HIDDEN TESTS\nassert got[1] == 2\n### END HIDDEN TESTS",
    ],
)
def test_a_hidden_probe_drawn_from_the_seed_or_fixed_with_a_reason_is_accepted(source):
    nb = solution_notebook()
    test_cell(source)(nb)
    student = student_version(nb)  # no FormatError
    assert "COURSE_HIDDEN_SEED" not in student.cells[3].source  # the hidden part is gone


def release_cli(solutions, labs):
    cmd = [
        sys.executable,
        "-m",
        "course",
        "release",
        "--solutions",
        str(solutions),
        "--labs",
        str(labs),
    ]
    return subprocess.run(cmd, capture_output=True, text=True)


def test_cli_release_writes_the_lab(tmp_path):
    src = tmp_path / "solutions" / "lab.ipynb"
    src.parent.mkdir()
    nbformat.write(solution_notebook(), src)
    out = tmp_path / "labs"
    proc = release_cli(src.parent, out)
    assert proc.returncode == 0, proc.stderr
    assert "NotImplementedError" in (out / "lab.ipynb").read_text()
    bad = tmp_path / "solutions" / "bad.ipynb"
    nb = solution_notebook()
    nb.cells[2].source = "### BEGIN SOLUTION"
    nbformat.write(nb, bad)
    proc = release_cli(src.parent, out)
    assert (
        proc.returncode == 2
        and "bad.ipynb: cell 2 (shard): '### BEGIN SOLUTION' on line 1 is never closed"
        in proc.stderr
    )


def test_committed_labs_are_exactly_a_fresh_release_of_solutions(tmp_path):
    from course.release import release_all
    from course.syllabus import REPO

    fresh = {
        p.relative_to(tmp_path): p.read_bytes() for p in release_all(REPO / "solutions", tmp_path)
    }
    committed = {
        p.relative_to(REPO / "labs"): p.read_bytes()
        for p in (REPO / "labs").rglob("*.ipynb")
        if not {".ipynb_checkpoints", "build"} & set(p.relative_to(REPO / "labs").parts)
    }
    assert committed.keys() == fresh.keys(), (
        "labs/ and solutions/ hold different notebooks: run `course release`"
    )
    for name in fresh:
        assert committed[name] == fresh[name], f"labs/{name} is stale: run `course release`"


def test_the_check_reads_only_what_the_probe_assigns():
    assert cells.exports(TEST) == ["got", "more"]
    source = (
        "x = f(1)\nfor n in range(3):\n    y = f(n)\nunused = 5\n# --- check ---\nimport math\n"
        "def near(a, b):\n    return math.isclose(a, b)\nassert near(x, 1) and [v for v in [y]] == [2]"
    )
    assert cells.exports(source) == ["x", "y"]  # neither unused, nor what the check binds


def test_cli_release_refuses_a_test_without_its_check_line(tmp_path):
    nb = solution_notebook()
    nb.cells[3].source = "assert shard(4, 0, 2) == [0, 2]"
    (tmp_path / "solutions").mkdir()
    nbformat.write(nb, tmp_path / "solutions" / "lab.ipynb")
    proc = release_cli(tmp_path / "solutions", tmp_path / "labs")
    assert proc.returncode == 2, proc.stderr
    assert "lab.ipynb: cell 3 (test_shard): a graded test cell needs exactly one" in proc.stderr
    assert "above it the probe" in proc.stderr and not (tmp_path / "labs" / "lab.ipynb").exists()


def test_cli_grade_refuses_a_lab_whose_tests_break_the_convention(tmp_path, capsys):
    from course import cli

    nb = solution_notebook()
    nb.cells[3].source = "got = shard(4, 0, 2)\nassert got == [0, 2]"  # no check line
    nbformat.write(nb, tmp_path / "lab.ipynb")
    (tmp_path / "subs").mkdir()
    code = cli.main(
        [
            "grade",
            str(tmp_path / "lab.ipynb"),
            str(tmp_path / "subs"),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert (
        code == 2
        and "a graded test cell needs exactly one '# --- check ---'" in capsys.readouterr().err
    )


def test_release_leaves_out_what_a_lab_wrote_into_build(tmp_path):
    """A solution run from solutions/ writes build/ there (lab 06's sweep points): those
    notebooks are outputs, not labs, and must not be released."""
    import shutil

    from course.release import release_all
    from course.syllabus import REPO

    src = tmp_path / "solutions"
    (src / "build" / "sweep").mkdir(parents=True)
    shutil.copy(REPO / "solutions" / "lab04_pipeline_tensor.ipynb", src)
    shutil.copy(
        REPO / "helpers" / "measure" / "notebooks" / "step_benchmark.ipynb", src / "build" / "sweep"
    )
    written = release_all(src, tmp_path / "labs")
    assert [p.relative_to(tmp_path / "labs").as_posix() for p in written] == [
        "lab04_pipeline_tensor.ipynb"
    ]
