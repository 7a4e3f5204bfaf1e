"""helpers/labs/lab06_runs.py and lab06_report.py: lab 06's runs, launched for real at small
sizes, and what its tables and findings make of them.

The student's functions are passed in: the tests pass recording stand-ins and check that the
runs' data reached them and their answers reached the tables. The family the lab declares
(``comparisons``) is checked against the verdicts its report really prints.
"""

from __future__ import annotations

import json
import math
import statistics

import matplotlib
import pandas as pd
import pytest

from helpers.labs import lab06_report, lab06_runs
from helpers.measure import findings
from helpers.workloads import data

matplotlib.use("Agg")  # plt.show() draws nothing: the figures stay for the tests to read
SQUEEZENET = 740_554  # squeezenet1_0's parameters with a 10-class head


def gradient_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def time_to_target(history, target):
    seconds = 0.0
    for row in history:
        seconds += row["seconds"]
        if row["train loss"] < target:
            return row["epoch"], seconds
    return None


@pytest.fixture(scope="module")
def zoo_runs():
    sizes = {"image": 32, "batch": 2, "steps": 2, "warmup": 1}
    return lab06_runs.zoo(["squeezenet1_0"], 2, 1, "gloo", **sizes)


@pytest.fixture(scope="module")
def digits():
    return data.load("digits"), data.load("digits", train=False)


def test_the_family_is_the_verdicts_the_report_prints():
    """zoo_findings, ttt_findings and the ViT's compare on made-up repeats (every configuration
    reaching the target) make exactly the comparisons ``comparisons`` declares."""
    models, batches = ["a", "b", "c"], [32, 128]
    declared = lab06_runs.comparisons(models, batches)
    assert declared == 25  # what lab 06's quick profile declares: 3 + 3 * 3 + 2 * 6 + 1
    findings.family(declared)
    fake = {"step": [1.0, 1.1, 1.2], "compute": [0.8, 0.9, 1.0], "exposed": [0.1, 0.1, 0.2],
            "share": [0.1, 0.2, 0.1]}  # fmt: skip
    repeats = {(m, n): fake for m in models for n in (1, 2)}
    table = pd.DataFrame([{"model": m, "parameters": i} for i, m in enumerate(models)])
    lab06_report.zoo_findings(repeats, table, 2)
    history = [{"epoch": e, "train loss": 1.0 / e, "seconds": 0.1 * e} for e in (1, 2, 3)]
    runs = {(n, b): [history] * 3 for b in batches for n in (1, 2)}
    lab06_report.ttt_findings(runs, time_to_target, 0.5, 3)
    vit = {"accuracy": 0.5, "seconds": 1.0, "epoch seconds": [0.5, 0.2, 0.3]}
    lab06_report.vit_shown({1: vit, 2: vit})
    assert len(findings.current().comparisons) == declared
    findings.family()


@pytest.mark.slow
def test_the_zoo_times_every_step_by_its_slowest_rank(zoo_runs):
    assert list(zoo_runs) == [("squeezenet1_0", 1), ("squeezenet1_0", 2)]
    one, two = zoo_runs["squeezenet1_0", 1][0], zoo_runs["squeezenet1_0", 2][0]
    assert len(one) == 1 and len(two) == 2 and len(two[0]["records"]) == 1 + 2
    assert one[0]["bytes/step"] == [] and set(two[0]["bytes/step"]) == {4 * SQUEEZENET}
    slowest = lab06_runs.slowest_steps(two)
    assert [s["total"] for s in slowest] == [
        max(r["records"][i]["total"] for r in two) for i in range(3)
    ]


@pytest.mark.slow
def test_the_zoo_goes_through_the_students_comm_share_and_gradient_bytes(zoo_runs, capsys):
    seen = []

    def comm_share(records, skip):  # a stand-in: what it was given, and a share of its own
        seen.append((len(records), skip))
        return 0.25

    repeats = lab06_runs.zoo_repeats(zoo_runs, comm_share, 1)
    assert seen == [(3, 1), (3, 1)]  # every repeat's slowest steps, the warm-up to skip
    steps = lab06_runs.slowest_steps(zoo_runs["squeezenet1_0", 2][0])[1:]
    assert repeats["squeezenet1_0", 2]["step"] == [statistics.median(s["total"] for s in steps)]
    table = lab06_report.zoo_table(zoo_runs, repeats, gradient_bytes, 32, 2)
    assert capsys.readouterr().out == ""  # the bytes DDP moved are the gradients': nothing said
    assert list(table["MB/step"]) == [0.0, 4 * SQUEEZENET / 1e6]
    assert list(table["comm share"]) == [0.25, 0.25] and list(table.parameters) == [SQUEEZENET] * 2
    lab06_report.zoo_table(zoo_runs, repeats, lambda model: 12, 32, 2)
    assert "your gradient_bytes says 12" in capsys.readouterr().out
    lab06_report.zoo_plot(table, 2, 2, 32)
    axes = matplotlib.pyplot.gcf().axes
    assert [ax.get_yscale() for ax in axes] == ["linear", "log"] and len(axes[1].patches) == 2


@pytest.mark.slow
def test_the_runs_to_a_target_stop_below_it(digits):
    runs = lab06_runs.to_target([64], 2, 1, "gloo", digits, lr=0.05, target=0.6, max_epochs=4)
    assert list(runs) == [(1, 64), (2, 64)]
    for (history,) in runs.values():
        losses = [e["train loss"] for e in history]
        assert all(loss >= 0.6 for loss in losses[:-1])  # stopped at the first epoch below
        assert losses[-1] < 0.6 or len(history) == 4
    rows = lab06_report.ttt_rows(runs, lambda h, t: (2, 1.5), 0.6, 2)
    assert [(r["epochs to target"], r["seconds to target"]) for r in rows] == [("2", 1.5)] * 2
    never = lab06_report.ttt_rows(runs, lambda h, t: None, 0.6, 2)
    assert never[0]["epochs to target"] == "never" and math.isnan(never[0]["seconds to target"])


def test_the_findings_name_the_runs_that_never_reach_the_target():
    findings.family(12)
    history = [{"epoch": e, "train loss": 1.0, "seconds": 0.1 * e} for e in (1, 2, 3)]
    runs = {(n, 32): [history] * 3 for n in (1, 2)}
    text = lab06_report.ttt_findings(runs, time_to_target, 0.5, 3).data
    assert "Not below 0.5 within 3 epochs: 1 rank(s) x 32, 2 rank(s) x 32." in text
    assert "seconds to a training loss" not in text  # nothing reached it: nothing to order
    findings.family()


@pytest.mark.slow
def test_the_vit_trains_the_same_global_batch_on_two_ranks(digits):
    from helpers.launcher.launch import launch

    ranks = launch(lab06_runs.vit_run, *digits, 2, world_size=2, backend="gloo", output="none")
    assert ranks[0]["accuracy"] == ranks[1]["accuracy"]  # one model, the same on both ranks
    r = ranks[0]
    assert len(r["epoch seconds"]) == 2 and r["seconds"] == pytest.approx(sum(r["epoch seconds"]))
    assert 0.0 <= r["accuracy"] <= 1.0


def test_without_a_gpu_per_rank_nccl_is_not_run_and_the_seed_is_shown(capsys):
    if lab06_runs.gpus() >= 2:
        pytest.skip("this node runs NCCL")
    assert lab06_runs.backends(2, None, None, 1) is None
    table = lab06_report.gloo_vs_nccl(None)
    assert "GPU(s) here: NCCL runs only on CUDA tensors" in capsys.readouterr().out
    assert list(table.backend) == ["TCP (gloo)", "NCCL"]
    ran = {"gloo": {"accuracy": 0.9, "epoch seconds": [9.0, 1.0, 3.0, 2.0]}}
    assert lab06_report.gloo_vs_nccl(ran).to_dict("records") == [
        {"backend": "gloo", "test accuracy": 0.9, "epoch s (median)": 2.0}
    ]


@pytest.mark.slow
def test_the_sweep_reads_only_the_files_its_points_wrote(tmp_path, capsys):
    stale = tmp_path / "squeezenet1_0-n2-b2.json"
    stale.write_text(json.dumps({"from": "an earlier sweep"}))
    point = {"image": 32, "steps": 2, "warmup": 1, "backend": "gloo"}
    results, failed = lab06_runs.sweep("squeezenet1_0", [2], 2, folder=tmp_path, **point)
    assert failed == [] and "2 of 2 runs" in capsys.readouterr().out
    table = lab06_report.sweep_table(results)
    assert list(table["world size"]) == [1, 2]
    assert list(table["MB/step"]) == [0.0, 4 * SQUEEZENET / 1e6]  # the stale file was replaced
    assert all(table["images/s"] > 0)
    lab06_report.sweep_plot(table, "squeezenet1_0")
    assert len(matplotlib.pyplot.gcf().axes[0].lines) == 2


def test_a_claim_takes_the_repeats_its_spread_asks_for():
    findings.family(4)
    text = lab06_report.claim_repeats(
        {("m", 1): {"step": [1.0, 1.2, 0.9]}, ("m", 2): {"step": [2.0]}}, 0.05
    ).data
    one, two = text.splitlines()
    assert one.startswith("- **m**, 1 rank(s)") and "repeats each" in one
    assert two.endswith("no spread measured (one run)")
    findings.family()
