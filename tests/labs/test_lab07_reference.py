"""helpers/labs/lab07.py, lab07_runs.py and lab07_checks.py: lab 07's hidden cases, the harness
its locked cells hand the student's code to, and the checks that judge what it returned.

Every run's hidden cases meet the edges of every dimension. The harness runs the solution's
answers (taken from the solution notebook) on real gloo ranks, and the lab's own checks judge
what it returned: the solution passes, a plausible wrong answer fails with the check's reason,
and the course's finished version is caught by the call hook. So a harness that lost a field, a
message or a rank, or a check that stopped checking, fails here, not only in the lab's
end-to-end tests (tests/notebooks/test_lab07.py).
"""

from __future__ import annotations

import re

import nbformat
import pytest

from course.grading import cells
from course.syllabus import REPO
from helpers.labs import lab07, lab07_checks, lab07_runs
from helpers.launcher.launch import launch
from helpers.parallel import context, moe

LAB = REPO / "solutions" / "lab07_transformers_at_scale.ipynb"
MARKS = re.compile(r"^[ \t]*### (BEGIN|END) SOLUTION[ \t]*\n?", re.M)
IMPORTS = """import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.parallel import context, moe
from helpers.parallel.context import attention_with_lse, positions
"""


def answer(gid: str, namespace: dict | None = None, **replace: str) -> dict:
    """The namespace of the solution's cell ``gid`` (markers removed, ``replace`` applied), run
    with the lab's imports under a module name no rank can import: its functions travel to the
    ranks by value, as a notebook's do. ``namespace``: run into it (the ring uses the merge)."""
    cell = next(c for c in nbformat.read(LAB, as_version=4).cells if cells.grade_id(c) == gid)
    source = MARKS.sub("", cell.source)
    for old, new in replace.items():
        assert old in source, old
        source = source.replace(old, new)
    namespace = namespace if namespace is not None else {"__name__": "lab07_answer"}
    exec(IMPORTS + source, namespace)
    return namespace


def test_every_run_draws_every_edge_of_every_dimension():
    """Every run's hidden cases meet the edges SWEPT's answers are wrong at, whatever its seed:
    a size of 1 beside a larger one in every dimension, a rank with no token beside a rank that
    keeps exactly one assignment, 2, 3 and 4 ranks; and only cases the harnesses can run."""
    for seed in range(300):
        merge_edges(lab07.merge_cases(seed))
        ring_edges(lab07.ring_cases(seed))
        moe_edges(lab07.moe_cases(seed))
        sp_edges(lab07.sp_cases(seed))


def merge_edges(cases: list) -> None:  # (b, heads, s, d, split, mask, scale, seed, queries)
    for dim in (0, 1, 3, 8):  # b, heads, d, query rows
        sizes = [case[dim] for case in cases]
        assert min(sizes) == 1 and max(sizes) >= 2, (dim, cases)
    assert all(1 <= split < s and 1 <= rows <= s for _, _, s, _, split, *_, rows in cases)
    assert any(split in (1, s - 1) for _, _, s, _, split, *_ in cases), cases  # a one-key block
    assert {case[5] for case in cases} == {"none", "causal", "anti-causal"}, cases
    assert {case[6] for case in cases} == {1.0, 300.0}, cases


def ring_edges(cases: list) -> None:  # (n, s, causal, d, seed, b, heads)
    assert sorted(n for n, *_ in cases) == [2, 3, 4] and all(s % n == 0 for n, s, *_ in cases)
    batches = [case[5] for case in cases]
    assert min(batches) == 1 and max(batches) >= 2, cases
    assert any(causal and heads != 2 for _, _, causal, *_, heads in cases), cases
    assert min(case[6] for case in cases) == 1 and {False, True} == {case[2] for case in cases}
    chunks = [(s // n, d) for n, s, _, d, *_ in cases]
    assert any(c == 1 for c, _ in chunks) and any(c >= 2 and d == 1 for c, d in chunks), cases
    assert (1, 1) not in chunks, cases  # one token and d = 1: no matrix product to see overlap


def moe_edges(cases: list) -> None:  # (n, tokens, top_k, factor, n_experts, seed, d)
    assert all(E % n == 0 and 1 <= k <= E for n, _, k, _, E, *_ in cases), cases
    assert sorted(E // n for n, _, _, _, E, *_ in cases) == [1, 2, 3], cases
    assert {k for _, _, k, *_ in cases} >= {1, 2}, cases
    # rank 0 has no token (keeps nothing), rank 1 one token, whose one choice it keeps
    (_, _, _, factor, E, *_), *_ = [case for case in cases if case[1:3] == (0, 1)]
    assert moe.capacity(1, E, 1, factor) >= 1
    widths = [case[6] for case in cases]
    assert min(widths) == 1 and max(widths) >= 2, cases


def sp_edges(cases: list) -> None:  # (n, s, b, h, ffn, seed)
    assert all(s % n == 0 and ffn % n == 0 for n, s, _, _, ffn, _ in cases), cases
    sizes = [(s // n, b, h, ffn // n) for n, s, b, h, ffn, _ in cases]
    for dim in range(4):  # tokens per rank, batch, width, hidden features per rank
        assert min(size[dim] for size in sizes) == 1 and max(size[dim] for size in sizes) >= 2
    assert len({n for n, *_ in cases}) == 2 and {n for n, *_ in cases} <= {2, 3, 4}, cases


def test_the_merge_check_passes_the_solution_and_fails_an_average():
    right = answer("merge")["merge"]
    cases = [(1, 2, 6, 4, 2, "none", 1.0, 0), (2, 2, 6, 4, 3, "causal", 300.0, 4)]
    for case in cases + lab07.merge_cases(3):
        lab07_checks.check_merge(case, lab07_runs.merge_case(right, *case))
    average = answer(
        "merge", **{"return w_a * out_a + w_b * out_b, lse": "return (out_a + out_b) / 2, lse"}
    )
    with pytest.raises(AssertionError, match="out is off by"):
        lab07_checks.check_merge(cases[0], lab07_runs.merge_case(average["merge"], *cases[0]))
    # the course's own merge is caught by the call hook
    finished = lab07_runs.merge_case(context.merge, *cases[0])
    with pytest.raises(AssertionError, match="write merge yourself"):
        lab07_checks.check_merge(cases[0], finished)


def ring_runs(ring, n, s, causal, d=4, seed=0, b=1, heads=2):
    return launch(lab07_runs.ring_run, ring, s, causal, d, seed, b, heads, world_size=n,
                  backend="gloo", output="none", timeout=60)  # fmt: skip


@pytest.mark.slow
def test_the_ring_harness_counts_the_solution_right_and_a_ring_that_waits_first_wrong():
    right = answer("ring_attention", answer("merge"))["ring_attention"]
    for case in [(2, 8, True), (3, 6, False, 4, 0, 1, 3)]:
        per_rank = ring_runs(right, *case)
        lab07_checks.check_ring(per_rank, *case)
    assert per_rank[0]["sends"] == [[1, 2 * 3 * 2 * 4 * 4]] * 2  # K and V of one block, twice
    attend = (
        "        if mask is None or mask.any():               # a block wholly in the future adds nothing\n"
        "            out, lse = merge(out, lse, *attention_with_lse(q, kv[0], kv[1], mask))\n"
    )
    wait = "        if step < n - 1:\n            for work in works:\n                work.wait()\n"
    # right values, but each block received before the one held is attended: no overlap
    waits = answer("ring_attention", answer("merge"), **{attend + wait: wait + attend})[
        "ring_attention"
    ]
    with pytest.raises(AssertionError, match="attended while the next one travelled"):
        lab07_checks.check_ring(ring_runs(waits, 2, 8, False), 2, 8, False)


@pytest.mark.slow
def test_the_moe_harness_and_check_pass_the_solution_and_fail_swapped_splits():
    right = answer("dispatch_combine")
    case = (3, 7, 2, 0.75, 6, 2)
    run = (lab07_runs.moe_run, right["dispatch"], right["combine"], *case[1:])
    lab07_checks.check_moe(launch(*run, world_size=3, backend="gloo", output="none"), *case)
    swapped = answer("dispatch_combine", **{"back * gate[:, None]": "back"})  # no gates
    run = (lab07_runs.moe_run, swapped["dispatch"], swapped["combine"], *case[1:])
    with pytest.raises(AssertionError, match="the output differs from moe.MoE's"):
        lab07_checks.check_moe(launch(*run, world_size=3, backend="gloo", output="none"), *case)


@pytest.mark.slow
def test_the_sp_harness_counts_the_calls_of_a_region_that_keeps_the_gathered_input():
    right = answer("sp_region")["sp_region"]
    case = (2, 8, 2, 4, 8, 0)
    per_rank = launch(
        lab07_runs.sp_run, right, *case[1:], world_size=2, backend="gloo", output="none"
    )
    lab07_checks.check_sp_dense(per_rank, *case)
    lab07_checks.check_sp_collectives(per_rank, *case)
    keeps_full = answer(
        "sp_region",
        **{"ctx.save_for_backward(shard, weight)\n        return F.linear(all_gather_s(shard), weight, bias)":
           "full = all_gather_s(shard)\n        ctx.save_for_backward(full, weight)\n"
           "        return F.linear(full, weight, bias)",
           "shard, weight = ctx.saved_tensors": "full, weight = ctx.saved_tensors",
           "full = all_gather_s(shard)                              # gathered again": "# kept",
           },
    )["sp_region"]  # fmt: skip
    per_rank = launch(
        lab07_runs.sp_run, keeps_full, *case[1:], world_size=2, backend="gloo", output="none"
    )
    lab07_checks.check_sp_dense(per_rank, *case)  # right values: only what it keeps is wrong
    with pytest.raises(AssertionError, match="all-gathers the kept shard again"):
        lab07_checks.check_sp_collectives(per_rank, *case)
