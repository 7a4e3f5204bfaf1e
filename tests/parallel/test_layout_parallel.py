"""helpers.parallel.layout: dp × tp on a DeviceMesh of 2 and 4 gloo ranks ends at the weights of
one process training on the whole batch; the planner's bytes and activation memory per rank are
those measured there; on a GPT-3-sized model it keeps tensor parallelism within a node."""

from __future__ import annotations

import functools

import pytest
import torch

import helpers
from helpers.parallel import layout

S, B, H, HEADS, LAYERS, STEPS = 8, 4, 16, 4, 2, 3  # B: the global batch
LAYOUTS = [(2, 1), (1, 2), (2, 2)]  # (dp, tp)


def _train(dp, tp):
    return layout.train_layout(dp, tp, STEPS, S, B, H, HEADS, layers=LAYERS)


def _two_ranks():  # both 2-rank layouts in one world: starting ranks is the slow part
    return {(2, 1): _train(2, 1), (1, 2): _train(1, 2)}


def _four_ranks():
    return {(2, 2): _train(2, 2)}


@functools.cache
def _launched(n):
    fn = _two_ranks if n == 2 else _four_ranks
    return helpers.launch(fn, world_size=n, output="none")


def _run(dp, tp):
    return [r[(dp, tp)] for r in _launched(dp * tp)]


@functools.cache
def _reference():
    return layout.train_reference(STEPS, S, B, H, HEADS, layers=LAYERS)


@pytest.mark.parametrize("dp,tp", LAYOUTS)
def test_the_layout_ends_at_the_reference_parameters(dp, tp):
    runs = _run(dp, tp)
    got, want = layout.dense_parameters(runs), _reference()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
    for r in runs:  # every dp replica holds the same shards as replica 0
        twin = next(q for q in runs if q["dp_rank"] == 0 and q["tp_rank"] == r["tp_rank"])
        for name, p in r["params"].items():
            torch.testing.assert_close(p, twin["params"][name], msg=name)


@pytest.mark.parametrize("dp,tp", LAYOUTS)
def test_the_planner_predicts_the_measured_bytes_and_activations(dp, tp):
    table = layout.plan(
        layout.Model(LAYERS, H, HEADS), layout.Cluster(dp * tp, dp * tp, 1e9, 100, 10), S, B,
        micro_batch=B // dp, precision="fp32", itemsize=8,
        activation_kw={"dropout": False, "norm_stats": True},  # what the CPU saves, in float64
    )  # fmt: skip
    row = table[(table.dp == dp) & (table.tp == tp) & (table.pp == 1)].iloc[0]
    assert row.micro_batches == 1 and row.pp_bytes == 0 and row.bubble == 0
    for r in _run(dp, tp):
        assert r["comm"] == {"tp": row.tp_bytes, "dp": row.dp_bytes}
        assert r["activations"] == row.activation_bytes
    assert (row.tp_bytes > 0) == (tp > 1) and (row.dp_bytes > 0) == (dp > 1)


# -- the planner on paper: GPT-3 175B on 1536 GPUs (Narayanan et al. 2021, Table 1) -----------

GPT3 = layout.Model(layers=96, h=12288, heads=96, vocab=51200)
# Narayanan et al.'s cluster: 8 A100s (80 GB) a node, NVLink inside, InfiniBand between
SELENE = layout.Cluster(1536, 8, memory_bytes=80e9, intra_bw=300, inter_bw=25)


@functools.cache
def _gpt3():
    return layout.plan(GPT3, SELENE, seq=2048, global_batch=1536)


def test_gpt3_does_not_fit_without_tensor_parallelism_and_fits_with_tp8_in_a_node():
    table = _gpt3()
    assert not table[table.tp == 1].fits.any()  # activations alone: 96 layers × 2.9 GB
    assert table[table.tp == 8].fits.any()
    best = table.iloc[0]
    assert best.fits and best.tp == 8 and best.tp_within_node
    assert layout.transformer_params(GPT3.layers, GPT3.h, GPT3.vocab) == pytest.approx(
        175e9, rel=0.01
    )


def test_layouts_with_tp_across_nodes_rank_after_tp_within_a_node():
    fit = _gpt3()[_gpt3().fits]
    assert fit.tp_within_node.any() and not fit.tp_within_node.all()
    assert list(fit.tp_within_node) == sorted(fit.tp_within_node, reverse=True)
    assert fit.comm_seconds.is_monotonic_increasing


def test_invalid_input_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="divisible by gpus_per_node"):
        layout.Cluster(12, 8, 80e9, 300, 25)
    with pytest.raises(ValueError, match="at least 1"):
        layout.Cluster(0, 8, 80e9, 300, 25)
    with pytest.raises(ValueError, match="no layout"):
        # 2 GPUs: 3 heads refuse tp = 2, 3 layers pp = 2, a batch of 5 dp = 2
        layout.plan(layout.Model(3, 15, 3), layout.Cluster(2, 2, 1e9, 100, 10), 8, 5)
    with pytest.raises(TypeError, match="layout.Model"):
        layout.plan((96, 12288, 96), SELENE, 2048, 1536)  # the old tuple: told what to pass
