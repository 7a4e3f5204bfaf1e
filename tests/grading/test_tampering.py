"""A student's cell that rebinds what a lab's locked cells gave is flagged for a person
(course/grading/tampering.py): no score changes, the gradebook's ``flags`` column and the
feedback's notes say which cell and what. Found by a red-team pass of issue 41: a run helper
redefined to return a reference from helpers.labs scored 9 of 11 in lab 02 and 10 of 10 in lab
07, right values made another way, which no check can tell from the student's own."""

from __future__ import annotations

import nbformat
import pytest

from course.grading import tampering
from course.grading.assemble import assemble
from course.syllabus import REPO

LABS = sorted((REPO / "solutions").glob("lab*.ipynb"))
LAB02 = REPO / "solutions" / "lab02_build_ddp.ipynb"


def notes(flags: list[str]) -> list[str]:
    return [f for f in flags if "a person will read it" in f]


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_the_solution_and_the_blank_lab_are_not_flagged(lab):
    source = nbformat.read(lab, as_version=4)
    blank = nbformat.read(REPO / "labs" / lab.name, as_version=4)
    assert notes(assemble(source, source)[1]) == []
    assert notes(assemble(source, blank)[1]) == []


def with_cell(after_gid: str, code: str):
    """The blank lab 02 with a cell of the student's right after the cell ``after_gid``."""
    nb = nbformat.read(REPO / "labs" / LAB02.name, as_version=4)
    at = next(
        i
        for i, c in enumerate(nb.cells)
        if c.metadata.get("nbgrader", {}).get("grade_id") == after_gid
    )
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(code))
    return nb


FLAGGED = {
    "a locked helper defined again": (
        "dp_step",
        "def dp_run(*a, **k):\n    return {}",
        "redefines dp_run",
    ),
    "assigned": ("dp_step", "dp_run = lambda *a, **k: {}", "redefines dp_run"),
    "imported over it": (
        "dp_step",
        "from helpers.labs.lab02 import dp_reference as dp_run",
        "redefines dp_run",
    ),
    "a module's function patched": (
        "lab02_setup",
        "helpers.launch = lambda *a, **k: []",
        "assigns helpers.launch",
    ),
    "through globals()": ("dp_step", "globals()['dp_run'] = print", "calls globals()"),
    "through setattr": ("lab02_setup", "setattr(helpers, 'launch', print)", "calls setattr"),
    "the profiler hook switched off": (
        "lab02_setup",
        "import sys\nsys.setprofile(None)",
        "calls sys.setprofile",
    ),
    "an audit hook": (
        "lab02_setup",
        "import sys\nsys.addaudithook(print)",
        "calls sys.addaudithook",
    ),
    # a harness in helpers.labs is found at call time: its module's dict is the way round
    # "assigns": a subscript store, through vars() or __dict__
    "a harness module's dict": (
        "lab02_setup",
        "from helpers.labs import lab02_harness as h\nvars(h)['dp_run'] = print",
        "calls vars(...)",
    ),
    "a harness module's __dict__": (
        "lab02_setup",
        "from helpers.labs import lab02_harness as h\nh.__dict__.update(dp_run=print)",
        "reaches __dict__",
    ),
    # the hook a test watches, handed over, and the record its closure holds emptied
    "the profiler hook's record": (
        "lab02_setup",
        "import sys\nfor c in sys.getprofile().__closure__:\n    c.cell_contents.clear()",
        "reaches __closure__",
    ),
    "a frame's locals": (
        "lab02_setup",
        "import sys\nsys._getframe(1).f_locals.clear()",
        "calls sys._getframe",
    ),
}


@pytest.mark.parametrize("case", FLAGGED, ids=str)
def test_a_cell_that_rebinds_what_the_lab_gave_is_flagged(case):
    after, code, what = FLAGGED[case]
    source = nbformat.read(LAB02, as_version=4)
    (note,) = notes(assemble(source, with_cell(after, code))[1])
    assert what in note and "a cell of yours" in note, note


@pytest.mark.parametrize(
    "code",
    [
        "import torch\nfrom torch import nn\nimport helpers.labs",  # the lab's imports again
        "for r in range(3):\n    print(r)",  # a name the lab's own unlocked cells reuse
        "def my_helper(x):\n    return x + 1\nmodel_copy = make_model()",
        "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(2, 2)",
    ],
)
def test_a_students_own_code_is_not_flagged(code):
    source = nbformat.read(LAB02, as_version=4)
    assert notes(assemble(source, with_cell("dp_step", code))[1]) == []


def test_the_names_a_locked_cell_binds_are_known():
    names = tampering.locked_names(nbformat.read(LAB02, as_version=4))
    assert {"dp_run", "scratch_ddp_runs", "accumulation_runs", "global_batch"} <= set(names)
