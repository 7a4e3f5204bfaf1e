"""Repeats, spread, whole batches, overlap and the device-model plots (helpers.scaling, timing)."""

from __future__ import annotations

import matplotlib
import pytest
import torch

import helpers
from helpers.measure import scaling, timing

matplotlib.use("Agg")


def test_repeats_are_interleaved_round_robin():
    calls = []
    out = scaling.interleave(["a", "b", "c"], lambda c: calls.append(c) or len(calls), repeats=2)
    assert calls == ["a", "b", "c", "a", "b", "c"]  # not a, a, b, b, c, c
    assert out == {"a": [1, 4], "b": [2, 5], "c": [3, 6]}
    with pytest.raises(ValueError, match="repeats must be a whole number >= 1"):
        scaling.interleave(["a"], len, repeats=0)
    with pytest.raises(ValueError, match="duplicates"):
        scaling.interleave(["a", "a"], len)


def test_a_runs_step_time_is_the_slowest_rank_per_step_then_the_median():
    rank0 = [{"total": t} for t in (9.0, 1.0, 1.0, 5.0)]  # step 0 is warm-up
    rank1 = [{"total": t} for t in (9.0, 2.0, 1.5, 1.0)]
    # steps 1..3: max over ranks = 2.0, 1.5, 5.0 -> median 2.0 (the mean would be 2.83)
    assert scaling.step_seconds([rank0, rank1], skip=1) == 2.0
    with pytest.raises(ValueError, match="all of them warm-up"):
        scaling.step_seconds([rank0], skip=4)


def test_spread_and_median_step_resist_one_slow_step():
    assert timing.spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}
    records = [
        {"step": i, "total": t, "oversubscribed": False} for i, t in enumerate([5, 1, 1, 1, 9])
    ]
    assert timing.median_step(records, skip=1)["total"] == 1
    assert timing.mean_step(records, skip=1)["total"] == 3
    assert "oversubscribed" not in timing.median_step(records)  # a flag is not averaged
    with pytest.raises(ValueError, match="at least once"):
        timing.spread([])


def test_epoch_time_counts_the_last_partial_step_as_its_fraction():
    assert scaling.epoch_seconds(0.5, 1000, 100, 2) == pytest.approx(2.5)  # 5 steps of 200
    assert scaling.epoch_seconds(1.0, 1437, 512, 2) == pytest.approx(1437 / 1024)
    assert scaling.steps_per_epoch(1437, 512, 2) == 2


def test_batches_are_whole_and_cycle_and_too_large_a_batch_is_an_error():
    shard = torch.arange(10)
    got = [b.tolist() for b in scaling.shard_batches(shard, 4, 5)]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]
    with pytest.raises(ValueError, match="a batch of 512 does not fit in this rank's shard of 10"):
        list(scaling.shard_batches(shard, 512, 1))
    with pytest.raises(ValueError, match="at least 1"):
        list(scaling.shard_batches(shard, 0, 1))


def wide_ddp(bucket_cap_mb):
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]), bucket_cap_mb=bucket_cap_mb)
    rec = helpers.CommRecorder().register(ddp)
    timer = helpers.StepTimer(comm=rec)
    for _ in range(4):
        timer.start()
        loss = ddp(torch.randn(64, 256)).pow(2).mean()
        timer.mark("forward")
        loss.backward()
        timer.mark("backward")
        timer.stop()
    rec.close()
    return timer.records


def test_overlap_is_measured_on_one_clock_with_the_buckets():
    records = helpers.launch(wide_ddp, 0.2, world_size=2)[0]  # 4 × 263 KB: a bucket per layer
    last = records[-1]
    assert len(last["buckets"]) == 4  # DDP rebuilds buckets after step 0
    (_, start, _), (_, _, end) = last["spans"][0], last["spans"][-1]
    assert end - start == pytest.approx(last["total"])
    assert all(start <= s <= e <= end + 1e-3 for s, e in last["buckets"])
    frac = timing.overlap_fraction(records, skip=1)
    assert 0.0 <= frac <= 1.0
    comm = sum(r["comm_s"] for r in records[1:])
    assert frac == pytest.approx(1 - sum(r["exposed_comm_s"] for r in records[1:]) / comm)
    ax = helpers.plots.overlap(last)
    assert len(ax.collections) == len(last["spans"]) + 4 and "4 buckets" in ax.get_title()


def test_overlap_fraction_without_communication_is_zero():
    assert timing.overlap_fraction([{"comm_s": 0.0, "exposed_comm_s": 0.0}] * 3) == 0.0


def test_speedup_plot_draws_the_spread_and_marks_oversubscribed_points():
    rows = [
        {"world_size": 1, "batch_size": 8, "speedup": 1.0, "speedup_lo": 0.9, "speedup_hi": 1.1},
        {"world_size": 2, "batch_size": 8, "speedup": 1.6, "speedup_lo": 1.4, "speedup_hi": 1.7},
        {
            "world_size": 4,
            "batch_size": 8,
            "speedup": 1.2,
            "speedup_lo": 0.8,
            "speedup_hi": 1.5,
            "oversubscribed": True,
        },
    ]
    ax = helpers.plots.speedup(rows)
    (bars,) = ax.containers
    segments = bars.lines[2][0].get_segments()  # the vertical error bars, one per point
    ends = [y for seg in segments for y in (seg[0][1], seg[1][1])]
    assert ends == pytest.approx([0.9, 1.1, 1.4, 1.7, 0.8, 1.5])
    texts = [t.get_text() for t in ax.texts]
    assert "oversubscribed" in texts and "80%" in texts and "100%" in texts
    assert "30%" not in texts  # the oversubscribed point gets no efficiency label
    assert any("oversubscribed" in t.get_text() for t in ax.get_legend().get_texts())


def test_speedup_plot_labels_the_shared_baseline_once():
    rows = [
        {"world_size": n, "batch_size": b, "speedup": s}
        for b, pairs in ((16, ((1, 1.0), (2, 0.5))), (512, ((1, 1.0), (2, 1.5))))
        for n, s in pairs
    ]
    texts = [t.get_text() for t in helpers.plots.speedup(rows).texts]
    assert sorted(texts) == ["100%", "25%", "75%"]  # not one "100%" per line, stacked at n = 1


def test_speedup_plot_names_the_batch_per_rank():
    rows = [{"world_size": n, "batch_size": 16, "speedup": s} for n, s in ((1, 1.0), (2, 0.5))]
    legend = [t.get_text() for t in helpers.plots.speedup(rows).get_legend().get_texts()]
    assert "per-rank batch=16" in legend


def test_cost_model_uses_each_world_sizes_own_compute():
    from helpers.measure.bandwidth import AlphaBeta

    fit = AlphaBeta(alpha=0.0, beta=1e9, r2=1.0)
    compute = {
        1: {"forward": 1.0, "backward": 2.0, "optimizer": 0.5},
        2: {"forward": 1.5, "backward": 3.0, "optimizer": 0.5},  # slower when sharing the node
    }
    rows = helpers.costmodel.predict_scaling(compute, [10**9], {2: fit}, [1, 2])
    assert rows[0]["step"] == 3.5 and rows[0]["comm"] == 0.0
    # one bucket of 1 GB at 1 GB/s starts when backward ends: 1 s exposed
    assert rows[1]["step"] == pytest.approx(1.5 + 3.0 + 1.0 + 0.5)
    assert rows[1]["compute_from"] == "compute measured at world size 2"
    with pytest.raises(KeyError, match="no measured compute for world size 4"):
        helpers.costmodel.predict_scaling(compute, [1], {2: fit, 4: fit}, [1, 2, 4])


def test_digits_shifted_is_nine_real_copies_moved_by_a_pixel():
    base = helpers.data.load("digits")
    big = helpers.data.load("digits-shifted")
    n = len(base)
    assert len(big) == 9 * n and torch.equal(big.tensors[1][:n], base.tensors[1])
    x = base.tensors[0]
    assert torch.equal(big.tensors[0][4 * n : 5 * n], x)  # (dy, dx) = (0, 0)
    right = big.tensors[0][5 * n : 6 * n]  # (dy, dx) = (0, 1): moved one pixel right
    assert torch.equal(right[..., 1:], x[..., :-1]) and not right[..., 0].any()
    test = helpers.data.load("digits", train=False)
    assert len(helpers.data.shifted(test)) == 9 * len(test)  # copies stay in their split
