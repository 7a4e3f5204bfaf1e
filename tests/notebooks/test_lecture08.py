"""Lecture 08 as committed: every figure it printed beside the theory recomputed here from its
parameters cell (activation bytes by the formula, TP / SP collectives and bytes, ring attention's
bytes and work per rank, the MoE's capacity and all-to-all bytes, the layouts' bytes and the
planner's choice, the simulated bubbles), the timing said by findings and never nbval-checked;
and the plots it introduces (plots.activation_parts, plots.attention_work) drawing what they are
given.

(It runs under papermill and nbval with the whole syllabus in test_course_run and test_check.)
"""

from __future__ import annotations

import functools
import re

import matplotlib
import nbformat
import numpy as np
import pytest
from recorded import outputs as recorded_outputs

from course.syllabus import REPO
from helpers import plots
from helpers.parallel import context as cp
from helpers.parallel import layout
from helpers.parallel import moe as moe_lib
from helpers.parallel import pipeline as pp
from helpers.parallel import transformer as tf

matplotlib.use("Agg")

PATH = REPO / "lectures" / "08_transformers_at_scale.ipynb"


@functools.cache
def _nb():
    return nbformat.read(PATH, as_version=4)


@functools.cache
def _out() -> str:
    return recorded_outputs(_nb())


@functools.cache
def _params() -> dict:
    cell = next(c for c in _nb().cells if "parameters" in c.metadata.get("tags", []))
    values: dict = {}
    exec(cell.source, values)
    return values


def test_lecture08_checks_what_is_exact_and_never_a_timing():
    code = [c for c in _nb().cells if c.cell_type == "code"]
    checked = [c for c in code if "nbval-check-output" in c.metadata.get("tags", [])]
    # formulas, equalities with one process, collectives, bytes, peaks, work, the planner, the
    # bubbles and the exercises' checks: deterministic
    assert len(checked) >= 20
    for cell in checked:
        assert "perf_counter" not in cell.source and "findings.compare" not in cell.source
    hidden = [c for c in code if c.metadata.get("jupyter", {}).get("source_hidden")]
    assert len(hidden) == 6  # one answer per exercise, collapsed
    timing = next(c for c in code if "findings.compare" in c.source)
    assert "repeats" in code[code.index(timing) - 2].source  # the launch: interleaved repeats


def test_activation_bytes_are_the_formula_and_the_papers_terms():
    p, out = _params(), _out()
    b, h, heads = p["batch"], p["h"], p["heads"]
    assert f"saved bytes = the formula, submodule by submodule, at s = {p['seqs']}: True" in out
    for s in p["seqs"]:
        total = int(sum(tf.activation_bytes_cpu_by_part(s, b, h, heads).values()))
        assert re.search(rf"\n{s}\s+{total}\s+{total}\s", out), s  # measured, formula
    square = 5 * p["gpt_heads"] * p["gpt_seq"] / p["gpt_h"]
    assert f"34 + 5as/h = 34 + {square:g}: the s² terms are {square / (34 + square):.0%}" in out
    per_layer = tf.activation_bytes(p["gpt_seq"], 1, p["gpt_h"], p["gpt_heads"], tp=8, sp=True)
    assert f"{per_layer / 1e9:.3f}" in out
    s = p["time_seq"]
    none = sum(tf.activation_bytes_cpu_by_part(s, b, h, heads).values())
    sel = sum(tf.activation_bytes_cpu_by_part(s, b, h, heads, recompute="selective").values())
    assert f"{int(none):,} bytes saved without recomputation, {int(sel):,} with selective" in out
    assert f"1 + s/(18h + 3s) = {1 + s / (18 * h + 3 * s):.3f}×" in out
    assert "selective / none, round by round" in out and f"{p['repeats']} repeats" in out
    for width, a in [(p["gpt_h"], p["gpt_heads"]), (h, heads)]:
        assert f"half of a layer's activations at s = {34 * width / (5 * a):g}" in out


def test_tensor_and_sequence_parallel_block_equal_the_dense_one_with_the_theorys_bytes():
    p, out = _params(), _out()
    s, b, h, heads = p["tp_seq"], p["batch"], p["h"], p["heads"]
    for name in ("tensor parallel", "tensor + sequence parallel"):
        assert (
            f"{name}, 2 ranks: output, input gradient and all 12 parameter gradients equal" in out
        )
    assert "TP  forward: all_reduce, all_reduce" in out
    assert "TP + SP  forward: all_gather, reduce_scatter, all_gather, reduce_scatter" in out
    assert "TP + SP    grads: all_reduce" in out
    fg = {sp: tf.comm_bytes_per_block(s, b, h, 2, sp, itemsize=8)["fg_total"] for sp in (0, 1)}
    assert fg[0] == fg[1]
    assert f"{fg[0]:,.0f} bytes as all-reduces, {fg[1]:,.0f} as all-gathers" in out
    sp_block = tf.comm_bytes_per_block(s, b, h, 2, True, itemsize=8)
    assert re.search(
        rf"grads\s+all_reduce\s+1\s+{int(sp_block['grads']['all_reduce']['bytes'])}", out
    )
    for kw in ({}, {"tp": 2}, {"tp": 2, "sp": True}):
        total = int(sum(tf.activation_bytes_cpu_by_part(s, b, h, heads, itemsize=8, **kw).values()))
        assert re.search(rf"\s{total}\s+{total}\s", out), kw  # measured per rank, formula
    one = 96 * 4 * 2 * 7 / 8 * 2048 * 12288 * 2  # the exercise: GPT-3, t = 8, 16-bit
    assert f"{one / 1e9:.1f} GB sent per rank per micro-batch" in out


def test_ring_attention_is_exact_and_its_bytes_and_work_are_the_theorys():
    p, out = _params(), _out()
    b, heads, d = p["batch"], p["heads"], p["head_dim"]
    worlds = p["ring_worlds"] if p["mesh_live"] else [n for n in p["ring_worlds"] if n <= 2]
    assert "equal to one process's attention: True" in out
    for n in worlds:
        for s in p["ring_seqs"]:
            sent = cp.ring_bytes(b, heads, s, d, n)
            assert re.search(rf"\s{n - 1}\s+{sent}\s+{sent}\n", out), (n, s)
    n, s = max(worlds), max(p["ring_seqs"])
    for causal, lay in [(False, "contiguous"), (True, "contiguous"), (True, "zigzag")]:
        work = [b * heads * w for w in cp.work_per_rank(s, n, causal, lay)]
        assert re.search(r"\s+".join(map(str, work)), out), (causal, lay)
    assert f"slowest / mean = 2n/(n+1) = {2 * n / (n + 1):.3f}" in out
    for m in worlds:  # the peak's theory printed beside the measured one
        theory = cp.peak_bytes(b, heads, s, d, 1) / cp.peak_bytes(b, heads, s, d, m)
        assert f"theory {theory:.2f} (n² = {m * m}" in out


def test_expert_parallelism_is_the_one_process_layer_and_its_bytes_are_the_theorys():
    p, out = _params(), _out()
    assert "equal the one-process layer on each rank's tokens: True" in out
    cap = moe_lib.capacity(p["moe_tokens"], p["experts"], p["top_k"], p["capacity_factor"])
    assert f"= {cap} assignments per expert and rank" in out
    uniform = moe_lib.all_to_all_bytes(p["moe_tokens"], p["moe_d"], 2, p["top_k"], itemsize=8)
    assert out.count(f"{uniform:,.0f} each (all_to_all_bytes)") == 2
    assert "bytes per all-to-all = theory, both routings: True" in out
    assert out.count("all_to_all_single") == 5  # counts, dispatch, combine; two reversed
    assert out.count("= E x sum_i f_i P_i") == 2
    assert "drops 0, one assignment less drops" in out  # the exercise


def test_layouts_end_at_one_process_and_the_planner_chooses_from_its_table():
    p, out = _params(), _out()
    assert (
        "the same weights as one process, bytes and activations per rank = the planner's: True"
        in out
    )
    layers, width, heads = p["layout_shape"]
    table = layout.plan(
        layout.Model(layers, width, heads), layout.Cluster(2, 2, 1e9, 100, 10),
        p["layout_seq"], p["layout_batch"], micro_batch=p["layout_batch"] // 2, precision="fp32", itemsize=8,
        activation_kw={"dropout": False, "norm_stats": True},
    )  # fmt: skip
    row = table[(table.dp == 2) & (table.tp == 1)].iloc[0]
    assert re.search(rf"2 x 1\s+2\s+True\s+0\s+0\s+{int(row.dp_bytes)}\s+{int(row.dp_bytes)}", out)
    model = layout.Model(p["gpt_layers"], p["gpt_h"], p["gpt_heads"], p["gpt_vocab"])
    cluster = layout.Cluster(
        p["gpus"], p["gpus_per_node"], p["gpu_memory"], p["intra_bw"], p["inter_bw"]
    )
    for name, kw in [
        ("no recomputation", {}),
        ("sequence parallel + selective recomputation", {"sp": True, "recompute": "selective"}),
    ]:
        plan = layout.plan(model, cluster, p["gpt_seq"], p["gpt_batch"], **kw)
        best = plan.iloc[0]
        assert (
            f"{name}: {int(plan.fits.sum())} of {len(plan)} layouts fit "
            f"{p['gpu_memory'] / 1e9:g} GB; chosen (first row): dp = {best.dp}, tp = {best.tp}, "
            f"pp = {best.pp}"
        ) in out
        assert best.fits and best.tp_within_node


def _bubble_table(out: str) -> dict:
    """{(p, m): [1F1B, interleaved v=2, interleaved v=4, ZB-H1]} from the printed table."""
    text = out.split("at all 9 settings: True", 1)[1]
    rows, p = {}, None
    for line in text.splitlines():
        numbers = line.split()
        if len(numbers) not in (5, 6) or not all(re.fullmatch(r"[\d.]+", x) for x in numbers):
            continue  # the header lines
        if len(numbers) == 6:
            p = int(numbers.pop(0))
        rows[p, int(numbers[0])] = [float(x) for x in numbers[1:]]
        if len(rows) == 9:
            return rows
    return rows


def test_the_simulated_bubbles_printed_are_the_formulas():
    rows = _bubble_table(_out())
    assert len(rows) == 9
    for (p, m), (one, v2, v4, zb) in rows.items():
        assert one == pytest.approx(pp.bubble_fraction(p, m), abs=5e-5)
        assert v2 == pytest.approx(pp.bubble_fraction_interleaved(p, m, 2), abs=5e-5)
        assert v4 == pytest.approx(pp.bubble_fraction_interleaved(p, m, 4), abs=5e-5)
        assert zb == pytest.approx(pp.bubble_fraction_zb_h1(p, m), abs=5e-5)
        assert zb < one and v4 < v2 < one


def test_the_gpu_cell_says_what_it_would_do_without_gpus():
    source = "\n".join(c.source for c in _nb().cells if c.cell_type == "code")
    assert "torch.cuda.device_count()" in source and "helpers.device()" in source
    out = _out()
    assert (
        "GPU(s) here. On a node with 2 or more" in out or "ring attention = one GPU's: True" in out
    )


# -- the plots it introduces ----------------------------------------------------------------


def test_plots_activation_parts_stacks_each_label_s_parts_with_the_scores_hatched():
    by_label = {f"s = {s}": tf.activation_bytes_cpu_by_part(s, 2, 16, 2) for s in (8, 16, 32)}
    ax = plots.activation_parts(by_label, title="t")
    bars = [b for b in ax.patches if b.get_gid() in ("part", "scores")]
    n_parts = len(by_label["s = 8"])
    assert len(bars) == 3 * n_parts
    tops = {}
    for bar in bars:
        tops[bar.get_x()] = max(tops.get(bar.get_x(), 0), bar.get_y() + bar.get_height())
    totals = [sum(parts.values()) / 1e6 for parts in by_label.values()]
    assert sorted(tops.values()) == pytest.approx(totals)  # each bar's top: the label's total
    scores = [b for b in ax.patches if b.get_gid() == "scores"]
    assert len(scores) == 3 and all(b.get_hatch() == "//" for b in scores)
    squares = [by_label[k]["attention: softmax output"] / 1e6 for k in by_label]
    assert [b.get_height() for b in scores] == pytest.approx(squares)
    assert ax.get_title() == "t"
    matplotlib.pyplot.close(ax.figure)


@pytest.mark.parametrize(
    "n,lay,causal", [(4, "contiguous", False), (4, "contiguous", True), (2, "zigzag", True)]
)
def test_plots_attention_work_colours_each_score_by_its_querys_rank(n, lay, causal):
    s = 16
    ax = plots.attention_work(s, n, lay, causal)
    (image,) = ax.get_images()
    grid = np.ma.filled(image.get_array(), np.nan)
    assert grid.shape == (s, s)
    for r in range(n):  # a rank's rows are its query positions, in the layout's order
        mine = cp.positions(r, n, s // n, lay).tolist()
        assert all(np.nanmax(grid[q]) == r for q in mine)
    counts = [int(np.sum(grid == r)) for r in range(n)]
    assert sum(counts) == (s * (s + 1) // 2 if causal else s * s)
    if lay == "zigzag" or not causal:
        assert len(set(counts)) == 1  # balanced
    else:
        assert counts == sorted(counts) and counts[0] < counts[-1]
    assert str(counts) in ax.get_title()
    matplotlib.pyplot.close(ax.figure)
