"""helpers/labs/lab07_report.py: lab 07's tables of what the student's code moved and kept.

The solution's answers (taken from the solution notebook, as tests/labs/test_lab07_reference.py
takes them) run on real gloo ranks at small sizes, and each table must hold what the course's
formulas say of them: a ring that sends its K and V once per step, an SP region that keeps a
t-th of its input, the planner's layouts as ``layout.plan`` lists them. So a table that lost a
rank, a column or a formula fails here, not only when the lab is recorded.
"""

from __future__ import annotations

import contextlib
import io
import math
import re

import matplotlib
import nbformat
import pytest

from course.grading import cells
from course.syllabus import REPO
from helpers.labs import lab07_report, lab07_runs
from helpers.launcher.launch import launch
from helpers.parallel import context, layout, moe

matplotlib.use("Agg")

LAB = REPO / "solutions" / "lab07_transformers_at_scale.ipynb"
MARKS = re.compile(r"^[ \t]*### (BEGIN|END) SOLUTION[ \t]*\n?", re.M)
IMPORTS = """import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.parallel import context, moe
from helpers.parallel.context import attention_with_lse, positions
"""


def solution(*gids: str) -> dict:
    """The namespace of the solution's cells ``gids``, run in order under a module name no rank
    can import, so their functions travel to the ranks by value, as a notebook's do."""
    by_id = {cells.grade_id(c): c.source for c in nbformat.read(LAB, as_version=4).cells}
    namespace = {"__name__": "lab07_report_answer"}
    for gid in gids:
        exec(IMPORTS + MARKS.sub("", by_id[gid]), namespace)  # noqa: S102 - the solution's cells
    return namespace


def shown(fn, *args):
    """What ``fn(*args)`` returns, and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = fn(*args)
    return result, out.getvalue()


@pytest.mark.slow
def test_the_ring_table_counts_one_message_of_k_and_v_per_step():
    ring = solution("merge", "ring_attention")["ring_attention"]
    table, printed = shown(lab07_report.ring_table, ring, 2, [4, 8], 2, 4)
    assert printed == "your ring on 2 ranks, 2 heads of 4, one sequence:\n"
    assert list(table.index) == [4, 8]
    assert list(table["messages / rank"]) == [1, 1]  # n − 1 steps send
    for s in (4, 8):
        assert (
            table.loc[s, "bytes sent / rank"]
            == context.ring_bytes(1, 2, s, 4, 2)
            == 2 * 2 * s // 2 * 4 * 4
        )
        assert table.loc[s, "peak bytes, 2 ranks (theory)"] == context.peak_bytes(1, 2, s, 4, 2)
        assert table.loc[s, "peak bytes, one process (theory)"] == context.peak_bytes(1, 2, s, 4, 1)
    fig = lab07_report.plot_ring(table, 2)
    counted = [line for line in fig.axes[0].lines if line.get_label() == "your ring, counted"]
    assert list(counted[0].get_ydata()) == list(table["bytes sent / rank"])


@pytest.mark.slow
def test_the_work_table_finds_the_last_rank_doing_twice_the_first_contiguous():
    per_rank = launch(lab07_runs.work_run, 8, 2, 4, world_size=2, backend="gloo", output="none")
    work, printed = shown(lab07_report.work_table, per_rank, 8, 2)
    for lay in context.LAYOUTS:  # the lecture's ring computes what the formula says, rank by rank
        assert list(work[f"{lay}, measured"]) == list(work[f"{lay}, theory"])
    # whole (4 × 4) blocks at or below the diagonal: rank 1 attends two blocks to rank 0's one
    assert list(work["contiguous, measured"]) == [2 * 16, 2 * 32]
    zigzag = list(work["zigzag, measured"])
    assert zigzag[0] == zigzag[1] < 2 * 32  # one early chunk and one late on each rank: even
    assert f"contiguous 64, zigzag {zigzag[0]:,} ({64 / zigzag[0]:.2f}×)" in printed
    assert len(lab07_report.plot_work(work, 8).axes[0].patches) == 4  # 2 layouts × 2 ranks


@pytest.mark.slow
def test_the_moe_table_counts_the_rows_that_leave_a_rank_and_the_drops_at_capacity():
    dispatch = solution("dispatch_combine")["dispatch"]
    table, printed = shown(lab07_report.moe_table, dispatch, 2, [16], 0.5, 4, 4, 2)
    assert printed.startswith("your dispatch, 2 ranks, 4 experts, top-2, tokens of width 4")
    room, capped = table.loc[(16, math.inf)], table.loc[(16, 0.5)]
    assert room["dropped / rank"] == 0 and room["capacity"] == 16
    assert capped["capacity"] == moe.capacity(16, 4, 2, 0.5) == 4
    # 32 assignments a rank, 4 experts of capacity 4: at least half of them dropped
    assert capped["dropped / rank"] >= 16
    assert capped["bytes sent / rank"] < room["bytes sent / rank"]  # what is dropped is not sent
    for row in (room, capped):
        assert row["moe.all_to_all_bytes"] == moe.all_to_all_bytes(16, 4, 2, 2)
        assert row["sent / uniform"] == row["bytes sent / rank"] / row["moe.all_to_all_bytes"]
        assert 2 * row["bytes sent / rank"] % (4 * 4) == 0  # whole rows of 4 float32s, 2 ranks
    fig = lab07_report.plot_moe(table, 0.5, 4, 2, 2)
    assert len(fig.axes[0].lines) == 3


@pytest.mark.slow
def test_the_memory_table_finds_sequence_parallelism_keeping_a_tth_of_the_input():
    sp_region = solution("sp_region")["sp_region"]
    per_rank = launch(lab07_runs.activation_run, sp_region, [4, 8], 4, 8, world_size=2,
                      backend="gloo", output="none")  # fmt: skip
    table, printed = shown(lab07_report.memory_table, per_rank, [4, 8], 4, 8)
    assert (
        printed
        == "bytes saved for backward per rank (the largest rank), h = 4, ffn = 8, 2 ranks:\n"
    )
    for name in lab07_report.REGIONS:
        assert list(table[f"{name}, measured"]) == list(table[f"{name}, theory"]), name
    assert list(table["TP − SP"]) == [4 * s * 4 // 2 for s in (4, 8)]  # the input TP keeps whole
    assert len(lab07_report.plot_memory(table, 4, 8, 2).axes[0].lines) == 6


def test_the_layouts_are_the_planners_with_and_without_sequence_parallelism():
    model = layout.Model(layers=32, h=4096, heads=32)
    cluster = layout.Cluster(gpus=16, gpus_per_node=8, memory_bytes=80e9, intra_bw=300, inter_bw=25)
    extra, printed = shown(lab07_report.layouts, model, cluster, 32768, 128)
    for s in (32768, 2 * 32768):
        for sp in (False, True):
            plan = layout.plan(model, cluster, s, 128, zero1=True, sp=sp, recompute="selective")
            head = f"s = {s}, {'with' if sp else 'without'} sequence parallelism: "
            assert f"{head}{int(plan['fits'].sum())} of {len(plan)} layouts fit" in printed
    assert printed.startswith("6.44 billion parameters (12·L·h²), 128 sequences a step, 16 GPUs")
    assert len(extra) >= 1 and (extra > 0).all()  # the backward regather costs something everywhere
    assert f"{extra.min():+.0%} to {extra.max():+.0%}" in printed
