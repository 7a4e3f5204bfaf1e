"""Bandwidth definitions (nccl-tests) against hand-computed cases, and the α-β fit."""

import numpy as np
import pytest

from helpers.measure import bandwidth as bw
from helpers.measure.costmodel import predict_scaling, predict_step


@pytest.mark.parametrize(
    "op, n, factor",
    [
        ("all_reduce", 2, 1.0),
        ("all_reduce", 4, 1.5),
        ("all_reduce", 8, 1.75),
        ("all_gather", 4, 0.75),
        ("reduce_scatter", 2, 0.5),
        ("all_to_all", 8, 0.875),
        ("gather", 4, 0.75),
        ("broadcast", 8, 1.0),
        ("reduce", 4, 1.0),
        ("send_recv", 2, 1.0),
        ("all_reduce", 1, 0.0),
    ],
)
def test_bus_factor(op, n, factor):
    assert bw.bus_factor(op, n) == pytest.approx(factor)


def test_algbw_and_busbw_in_gb_per_second():
    # 1e9 bytes in 0.5 s is 2 GB/s of algorithm bandwidth; a 4-rank all-reduce needs 1.5x on the bus.
    assert bw.algbw(1e9, 0.5) == pytest.approx(2.0)
    assert bw.busbw("all_reduce", 1e9, 0.5, 4) == pytest.approx(3.0)
    assert bw.busbw("all_gather", 4e6, 1e-3, 4) == pytest.approx(3.0)  # S = full output
    assert (
        bw.buffer_bytes("all_gather", 1000, 4) == 4000
        and bw.buffer_bytes("all_reduce", 1000, 4) == 1000
    )


def test_ring_wire_bytes():
    assert bw.ring_allreduce_wire_bytes(400, 4) == 600
    assert bw.ring_allreduce_wire_bytes(400, 1) == 0


def test_fit_recovers_alpha_and_beta_from_exact_and_noisy_timings():
    sizes = np.array([2**k for k in range(10, 26, 2)], dtype=float)
    alpha, beta = 50e-6, 2.5e9
    fit = bw.fit_alpha_beta(sizes, alpha + sizes / beta)
    assert fit.alpha == pytest.approx(alpha, rel=1e-6) and fit.beta == pytest.approx(beta, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0) and fit.beta_gbps == pytest.approx(2.5)
    noisy = (alpha + sizes / beta) * np.random.default_rng(0).uniform(0.95, 1.05, sizes.size)
    fit = bw.fit_alpha_beta(sizes, noisy)
    assert fit.alpha == pytest.approx(alpha, rel=0.15) and fit.beta == pytest.approx(beta, rel=0.1)
    assert fit.r2 > 0.99


def test_fit_refuses_nonsense():
    with pytest.raises(ValueError, match="at least two"):
        bw.fit_alpha_beta([1], [1.0])
    with pytest.raises(ValueError, match="positive"):
        bw.fit_alpha_beta([1, 2], [1.0, 0.0])


def test_cost_model_limits():
    # Free communication: the step is the compute.
    assert predict_step(1, 2, 0.5, [100, 100], 0.0, 1e30)["step"] == pytest.approx(3.5)
    # One bucket can only start when backward is over: all of it is exposed.
    p = predict_step(1, 2, 0.5, [1000], alpha=0.1, beta=1000.0)
    assert p["exposed_comm"] == pytest.approx(1.1) and p["step"] == pytest.approx(4.6)
    # Two buckets: the first hides behind the second half of backward, the second is exposed.
    p = predict_step(0, 2, 0, [1000, 1000], alpha=0.0, beta=1000.0)
    assert p["comm"] == pytest.approx(2.0) and p["exposed_comm"] == pytest.approx(1.0)
    # Without overlap everything is exposed.
    assert predict_step(0, 2, 0, [1000, 1000], 0.0, 1000.0, overlap=False)[
        "exposed_comm"
    ] == pytest.approx(2.0)


def test_cost_model_scaling_needs_a_fit_per_world_size():
    fit = bw.AlphaBeta(alpha=0.0, beta=1000.0, r2=1.0)
    rows = predict_scaling({"forward": 1, "backward": 2, "optimizer": 0}, [1000], {2: fit}, [1, 2])
    assert [r["step"] for r in rows] == [pytest.approx(3.0), pytest.approx(4.0)]
    with pytest.raises(KeyError, match="no α-β fit for world size 4"):
        predict_scaling({"forward": 1, "backward": 2, "optimizer": 0}, [1000], {2: fit}, [4])


# --- lecture 01's ring α-β reading and the measured spread ------------------------------------


def test_ring_terms_are_the_fit_read_two_ways():
    # t = 2(n-1)·α_link + 2(n-1)/n·S/B is a line a + S/β with a = 2(n-1)α_link, B = β·2(n-1)/n.
    n, link_latency, link_bw = 4, 100e-6, 3e9
    sizes = np.array([2**k for k in range(2, 25, 2)], dtype=float)
    times = bw.ring_allreduce_time(sizes, n, link_latency, link_bw)
    fit = bw.fit_alpha_beta(sizes, times, n=n)
    assert bw.ring_steps("all_reduce", n) == 6 and bw.ring_steps("all_gather", n) == 3
    assert fit.alpha == pytest.approx(6 * link_latency, rel=1e-6)
    assert fit.link_latency == pytest.approx(link_latency, rel=1e-6)
    assert fit.busbw_gbps == pytest.approx(3.0, rel=1e-6)  # B: the busbw limit
    assert fit.algbw_gbps == pytest.approx(3.0 / 1.5, rel=1e-6)  # β = B / (2(n-1)/n)
    assert fit.algbw_gbps == fit.beta_gbps
    # at large S the busbw computed from the fit approaches B; at small S, latency dominates
    big, small = 2.0**40, 4.0
    assert bw.busbw("all_reduce", big, fit.predict(big), n) == pytest.approx(3.0, rel=1e-3)
    assert fit.predict(small) == pytest.approx(6 * link_latency, rel=1e-3)
    assert fit.as_dict()["busbw_GBps"] == pytest.approx(3.0)


def _record(n, nbytes, med, lo, hi, over=False):
    return {
        "op": "all_reduce",
        "world_size": n,
        "bytes": nbytes,
        "seconds": med,
        "min_s": lo,
        "max_s": hi,
        "mean_call_s": hi,
        "calls": 45,
        "repeats": 3,
        "algbw_GBps": nbytes / med / 1e9,
        "busbw_GBps": nbytes / med / 1e9 * bw.bus_factor("all_reduce", n),
        "oversubscribed": over,
    }


def test_spread_rows_and_plot_mark_oversubscribed_points():
    import matplotlib

    matplotlib.use("Agg")
    import helpers

    recs = [_record(2, s, 1e-4 + s / 1e9, 0.9e-4 + s / 1e9, 3e-3 + s / 1e9) for s in (8, 2**20)]
    recs += [_record(4, s, 1e-3 + s / 5e8, 1e-3, 5e-3 + s / 5e8, over=True) for s in (16, 2**20)]
    rows = helpers.bench.spread_rows(recs)
    assert [r["n"] for r in rows] == ["2", "2", "4 (oversubscribed)", "4 (oversubscribed)"]
    assert rows[0]["median (ms)"] == pytest.approx(0.1, abs=1e-3)
    assert rows[0]["min–max of rounds (ms)"] == "0.090–3.000"
    fits = {
        ("all_reduce", n): bw.fit_alpha_beta(
            [r["bytes"] for r in recs if r["world_size"] == n],
            [r["seconds"] for r in recs if r["world_size"] == n],
            n=n,
        )
        for n in (2, 4)
    }
    left, right = helpers.plots.alpha_beta(recs, fits)
    labels = [t.get_text() for t in left.get_legend().get_texts()]
    assert any("n=4 (oversubscribed" in t for t in labels)
    assert not any("n=2 (oversubscribed" in t for t in labels)
    hollow = [c for c in left.get_lines() if c.get_markerfacecolor() == "none"]
    assert hollow, "oversubscribed points are drawn hollow"
    limits = [t.get_text() for t in right.get_legend().get_texts() if "limit B" in t.get_text()]
    assert limits == [
        f"n={n}: fit's limit B = {fits[('all_reduce', n)].busbw_gbps:.2f} GB/s" for n in (2, 4)
    ]


def test_benchmark_spread_measures_medians_with_spread_against_theory():
    import helpers

    sizes = [4, 2**12, 2**24]
    recs = helpers.bench.benchmark_spread("all_reduce", sizes, world_sizes=(2,), repeats=3)
    assert [r["bytes"] for r in recs] == [8, 4096, 2**24]  # S rounded to whole elements per rank
    for r in recs:
        assert r["repeats"] == 3 and r["calls"] >= 3 * 15
        assert r["min_s"] <= r["seconds"] <= r["max_s"]  # the pooled median lies within the rounds
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 1.0)  # 2(n-1)/n = 1 at n = 2
        assert r["oversubscribed"] is helpers.world.oversubscribed(2)
    # theory: 16 MiB costs more than 8 bytes, and no collective on one host beats a memcpy
    assert recs[-1]["seconds"] > recs[0]["seconds"]
    memcpy = helpers.memcpy_bandwidth([2**24], target_s=0.02)[0]["algbw_GBps"]
    assert recs[-1]["busbw_GBps"] < memcpy
    fit = bw.fit_alpha_beta([r["bytes"] for r in recs], [r["seconds"] for r in recs], n=2)
    assert fit.alpha >= 0 and 0 < fit.busbw_gbps < memcpy


def test_benchmark_spread_flags_a_world_larger_than_the_cores(monkeypatch):
    import helpers

    monkeypatch.setattr(helpers.world, "cpu_count", lambda: 1)  # 2 ranks on "1 core"
    (rec,) = helpers.bench.benchmark_spread("all_reduce", [4], world_sizes=(2,), repeats=1)
    assert rec["oversubscribed"] is True
