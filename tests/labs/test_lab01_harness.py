"""helpers/labs/lab01_harness.py: the runs lab 01 times and the α–β prediction it prints.

Real runs at one and two ranks (a few steps of a small MLP) feed the prediction; the sweep is
made up, so the fit's verdict is known: an exact α–β line is usable or misses, and noise that
no line describes makes it unusable, with nothing predicted from it.
"""

from __future__ import annotations

import pytest

from helpers.labs import lab01_harness
from helpers.workloads import data

SETTING = {"model_name": "mlp", "in_shape": (1, 8, 8), "hidden": 32, "depth": 2, "lr": 0.05,
           "device": "cpu", "bucket_cap_mb": 0.01, "memory_budget": "16MB"}  # fmt: skip
WARMUP, STEPS, BATCH = 1, 3, 16


@pytest.fixture(scope="module")
def runs():
    digits = data.load("digits").tensors
    return {(ws, BATCH): [lab01_harness.run_config(SETTING, digits, (ws, BATCH), STEPS, WARMUP, "gloo")]
            for ws in (1, 2)}  # fmt: skip


def sweep(alpha: float, beta: float, noise=None) -> list[dict]:
    sizes = [2**k for k in range(12, 23, 2)]
    seconds = [alpha + s / beta for s in sizes]
    if noise is not None:
        seconds = [t * f for t, f in zip(seconds, noise, strict=True)]
    return [
        {"world_size": 2, "bytes": s, "seconds": t} for s, t in zip(sizes, seconds, strict=True)
    ]


@pytest.mark.slow
def test_a_run_reports_its_steps_and_ddp_its_buckets(runs):
    plain, ddp = runs[1, BATCH][0], runs[2, BATCH][0]
    assert len(plain) == 1 and len(ddp) == 2
    assert len(plain[0]["timing"]) == WARMUP + STEPS and plain[0]["buckets"] == []
    n_params = sum(p.numel() for p in lab01_harness.make_model(SETTING).parameters())
    assert sum(ddp[0]["buckets"]) == 4 * n_params  # every gradient, in buckets of 0.01 MB
    assert all(s["sent_bytes"] == 4 * n_params for s in ddp[0]["comm"])


@pytest.mark.slow
def test_the_prediction_is_judged_against_the_measured_range(runs):
    exact = lab01_harness.alpha_beta(sweep(1e-4, 1e9), runs, [1, 2], BATCH, WARMUP)
    verdict = exact["verdicts"][2]
    assert verdict.verdict in ("usable", "misses")  # R² = 1: the range decides
    lo, hi = min(exact["measured"][2]), max(exact["measured"][2])
    step = next(p["step"] for p in exact["predicted"] if p["world_size"] == 2)
    assert (verdict.verdict == "usable") == (lo <= step <= hi)
    rows = lab01_harness.alpha_beta_rows(exact, [1, 2])
    assert [r["predicted step (s)"] is not None for r in rows] == [True, True]
    # no line describes these times: unusable, and nothing is predicted or plotted from it
    noisy = sweep(1e-4, 1e9, noise=[9.0, 0.1, 7.0, 0.2, 5.0, 0.1])
    unusable = lab01_harness.alpha_beta(noisy, runs, [1, 2], BATCH, WARMUP)
    assert unusable["verdicts"][2].verdict == "unusable"
    row = lab01_harness.alpha_beta_rows(unusable, [1, 2])[1]
    assert row["predicted step (s)"] is None and row["β algbw (GB/s)"] == "not measured"
    predicted, measured = lab01_harness.plotted(
        unusable, [1, 2], {(1, BATCH): False, (2, BATCH): False}, BATCH
    )
    assert [p["world_size"] for p in predicted] == [1] and len(measured) == 2


def test_the_device_refuses_a_batch_over_its_budget_and_says_so(capsys):
    digits = data.load("digits").tensors
    assert lab01_harness.fits_one_device(SETTING, digits, 32)
    tiny = {**SETTING, "memory_budget": "64KB"}
    assert not lab01_harness.fits_one_device(tiny, digits, 512)
    assert "batch 512" in capsys.readouterr().out
