"""Attacks on lab 03's live-world question (part 5, ``test_zero_held``), graded by `course grade`.

The question: on a world of 2 ranks (``%%ranks``), build the run's model, step PyTorch's
``ZeroRedundancyOptimizer`` once and set ``state_bytes`` to the Adam state each rank keeps; the
probe pulls it (``helpers.interactive.pull``), the check compares it with
``helpers.labs.lab03.world_state_bytes()``, computed in the grader at the run's seed.

Each submission is the released question filled in as a student who wants the point without the
work would fill it, graded for real on a copy of the lab holding only part 5's cells (the
solution's own cells, so the test follows the lab). Controls: the solution and the work done in a
function (the optimizer kept in a dict) score 1; a typed table of seed 0's bytes, a world that
never steps, one rank alone and a real optimizer never stepped beside the reference's numbers
score 0. The attacks: the course's reference (``world_state_bytes``, ``zero_partition``) called
on the ranks or in the kernel with no optimizer anywhere (the answer is a function of
``zero_model``, which the locked cell pushes, and of the seed, which kernel and ranks both read):
they scored the point until the probe measured each rank's own ZeroRedundancyOptimizer too. And
a library the probe uses patched (``helpers.interactive.pull`` in the kernel,
``helpers.memory.nbytes`` on the ranks): right values, so the point may stand, but a person must
be told; tampering.py skips every cell that ast.parse refuses, so a cell that starts with a magic
(``%%capture``, ``%%ranks``) is never flagged (fails until tampering.py reads magics' code).
"""

from __future__ import annotations

import textwrap

import nbformat
import pytest
from grading_fixtures import grade_answers

from course.grading import cells
from course.syllabus import REPO
from helpers.labs import lab03

SEED = 5  # every submission's hidden seed: a model other than seed 0's (a plain run's)
PART5 = ("lab03_intro", "world_start", "zero_world", "test_zero_held")


def part5() -> nbformat.NotebookNode:
    """The solution of lab 03 cut to part 5: its intro, the question's Markdown and its cells."""
    nb = nbformat.read(REPO / "solutions" / "lab03_memory.ipynb", as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if cells.grade_id(c) == "world_start")
    question = nb.cells[at - 1]  # the Markdown that asks it
    nb.cells = [c for c in nb.cells if cells.grade_id(c) in PART5 or c is question]
    assert [cells.grade_id(c) for c in nb.cells if cells.grade_id(c)] == list(PART5)
    return nb


ZRO = """\
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(helpers.models.coordinate_mlp(26, *zero_model))
opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
"""
STEP = "x, y = torch.randn(8, 26), torch.rand(8, 3)\n((model(x) - y) ** 2).mean().backward()\nopt.step()\n"
MEASURE = "state_bytes = helpers.memory.nbytes(helpers.memory.optimizer_tensors(opt.optim))"
PATCH = """\
import helpers.interactive
from helpers.labs import lab03
_bytes = lab03.world_state_bytes()   # the seed is in the kernel's environment
helpers.interactive.pull = lambda name, ranks=None: list(_bytes)
helpers.interactive.run_cell = lambda *a, **k: None
"""

CONTROLS = {  # name: (the answer cell, its points)
    "right": (
        "%%ranks\n" + ZRO + STEP + MEASURE,
        1.0,
    ),
    "seed0_table": ("%%ranks\nstate_bytes = " + repr(lab03.world_state_bytes(0)) + "[rank]", 0.0),
    "no_step": ("%%ranks\n" + ZRO + MEASURE, 0.0),
    "rank0_only": ("%%ranks\n" + ZRO + "if rank == 0:\n    state_bytes = 40000", 0.0),
    # the work done inside a function, the optimizer kept in a dict: the probe finds it (gc)
    "kept_in_a_dict": (
        "%%ranks\ndef zero_step():\n" + textwrap.indent(ZRO + STEP, "    ") + "    return opt\n"
        "kept = {'zero': zero_step()}\n" + MEASURE.replace("opt.optim", "kept['zero'].optim"),
        1.0,
    ),
    # a real ZeroRedundancyOptimizer, never stepped, beside the reference's answer
    "unstepped_beside_the_reference": (
        "%%ranks\n" + ZRO + "from helpers.labs import lab03\n"
        "state_bytes = lab03.world_state_bytes()[rank]",
        0.0,
    ),
}
# No optimizer is built, no step taken: the point, if it comes, comes from the course's reference.
WITHOUT_THE_WORK = {
    "reference_on_ranks": "%%ranks\nfrom helpers.labs import lab03\n"
    "state_bytes = lab03.world_state_bytes()[rank]",
    "partition_on_ranks": "%%ranks\nfrom helpers.labs import lab03\n"
    "numels = [p.numel() for p in helpers.models.coordinate_mlp(26, *zero_model).parameters()]\n"
    "state_bytes = 8 * lab03.zero_partition(numels, world_size)[rank]",
    "reference_in_kernel": "from helpers.labs import lab03\n"
    "helpers.interactive.run_cell(f'state_bytes = {lab03.world_state_bytes()}[rank]')",
}
# A probe's library patched: right values, so the point stands (docs/threat-model.md); flagged.
FORGED_ON_RANKS = """\
%%ranks
from torch.distributed.optim import ZeroRedundancyOptimizer
from helpers.labs import lab03
state_bytes = lab03.world_state_bytes()[rank]
opt = ZeroRedundancyOptimizer.__new__(ZeroRedundancyOptimizer)   # never built, never stepped
opt.optim = torch.optim.Adam([torch.zeros(1, requires_grad=True)])
helpers.memory.nbytes = lambda tensors: state_bytes
"""
PATCHED = {  # name: (the answer cell, what the flag names)
    "patched_pull": (PATCH, "helpers.interactive.pull"),
    "patched_pull_under_a_magic": ("%%capture\n" + PATCH, "helpers.interactive.pull"),
    "nbytes_patched_on_the_ranks": (FORGED_ON_RANKS, "helpers.memory.nbytes"),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    answers = {n: a for n, (a, _) in (CONTROLS | PATCHED).items()} | WITHOUT_THE_WORK
    root = tmp_path_factory.mktemp("world-redteam")
    return grade_answers(root, part5(), "lab03_memory.ipynb", "zero_world", answers, SEED)


def test_the_seed_asks_another_model_than_a_plain_run(graded):
    assert lab03.world_case(SEED) != lab03.world_case(0)


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_the_controls_score_what_they_earn(graded, name):
    result = graded[name]
    assert result.status == "graded", result.reason
    assert result.scores["test_zero_held"] == CONTROLS[name][1], (name, result.errors)


@pytest.mark.parametrize("name", sorted(WITHOUT_THE_WORK))
def test_the_reference_without_an_optimizer_earns_nothing(graded, name):
    """Each scored the point while the probe read only the number the answer chose (the course's
    reference gives it); now the probe also measures each rank's own ZeroRedundancyOptimizer."""
    result = graded[name]
    assert result.status == "graded", result.reason
    assert result.scores["test_zero_held"] == 0.0, (name, result.scores, result.flags)


@pytest.mark.parametrize("name", sorted(PATCHED))
def test_a_patched_library_is_flagged_for_a_person(graded, name):
    """Fails today under a magic and on the ranks: tampering.flags skips a cell that
    ast.parse refuses, and a %%ranks cell is one."""
    result = graded[name]
    assert result.status == "graded", result.reason
    assert any(PATCHED[name][1] in f for f in result.flags), (name, result.scores, result.flags)
