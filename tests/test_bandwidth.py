"""Bandwidth definitions (nccl-tests) against hand-computed cases, and the α-β fit."""

import numpy as np
import pytest

from helpers import bandwidth as bw
from helpers.costmodel import predict_scaling, predict_step


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
