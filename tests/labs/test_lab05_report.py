"""helpers.labs.lab05_report: lab 05's tables, plots and findings say what the rows hold, make
only the comparisons the lab declares, and refuse a part 1 check that does not hold."""

from __future__ import annotations

import matplotlib
import pytest
import torch

from helpers.labs import lab05_report
from helpers.measure import findings

matplotlib.use("Agg")


@pytest.fixture(autouse=True)
def judged_alone():
    """Each test's comparisons in a family of their own, judged alone at 0.1."""
    findings.family()
    yield
    findings.family()


def run(method, batch, seed, test, train=None, failed=False, lr=0.05, steps=4):
    """A sweep's row as lab05_runs makes it (two epochs, ``steps`` losses)."""
    curve = [{"epoch": e, "train loss": 1.0 / e, "lr": lr} for e in (1, 2)]
    return {"method": method, "global batch": batch, "seed": seed, "micro x k": "8 x 2",
            "steps": steps, "train loss": 0.5, "train accuracy": test if train is None else train,
            "test accuracy": test, "seconds": 1.0, "failed": failed, "curve": curve,
            "losses": [1.0] * steps}  # fmt: skip


SEEDS = (0, 1, 2)


def rows(method, batch, accuracies, **kw):
    return [run(method, batch, s, a, **kw) for s, a in zip(SEEDS, accuracies, strict=True)]


def texts(items) -> list[str]:
    return [getattr(i, "text", None) or i.data for i in items]


def test_the_family_line_says_when_the_seeds_are_too_few_and_what_more_would_cost():
    family = findings.family(11)  # lab 05's quick profile: 5 repeats a side
    line = lab05_report.repeats_line(family, [0, 1, 2], 5)
    assert line.startswith("11 comparisons declared") and "at least 5 repeats" in line
    assert "the sweeps' seeds: 3, too few" in line and "5 would take 1.7x the time" in line
    assert "part 1's timing repeats: 5\n" in line + "\n"


def test_part_1_shows_the_same_update_and_refuses_one_that_differs():
    state = {"w": torch.ones(3)}
    one = {"state": state, "bytes/step": 0}
    same = {(64, 1): {"state": {"w": torch.ones(3) + 1e-7}, "bytes/step": 40}}
    table = lab05_report.same_update(one, same, 2, 40).data
    assert list(table["run"]) == ["1 process, 1 x 128 (the reference)", "2 ranks, 1 x 64"]
    assert table["all-reduced bytes/step"].tolist() == [0, 40]
    with pytest.raises(AssertionError, match="differs from one process"):
        lab05_report.same_update(
            one, {(64, 1): {"state": {"w": torch.zeros(3)}, "bytes/step": 40}}, 2, 40
        )
    with pytest.raises(AssertionError, match="once a step"):
        lab05_report.same_update(one, {(16, 4): {"state": state, "bytes/step": 160}}, 2, 40)


def test_part_1_compares_the_largest_micro_batch_with_the_smallest_only():
    times = {256: [0.6, 0.61, 0.62], 64: [1.0, 1.1, 1.2], 16: [2.2, 2.3, 2.4]}
    (found,) = lab05_report.timing_findings(times, 512, 2)
    assert found.verdict == "256 x 1 better" and "16 x 16" in found.text
    assert len(findings.current().comparisons) == 1
    table = lab05_report.timing_table(times, 512, 2, oversubscribed=True)
    assert table.data["k"].tolist() == [1, 4, 16] and table.data["median"].tolist() == [
        0.61,
        1.1,
        2.3,
    ]
    assert "oversubscribed" in table.caption


def test_part_2_makes_three_comparisons_at_the_smallest_and_largest_batch():
    fixed = (rows("fixed lr", 32, [0.97, 0.96, 0.95], train=None) + rows("fixed lr", 128, [0.9] * 3)
             + rows("fixed lr", 2048, [0.3, 0.35, 0.4]))  # fmt: skip
    found = lab05_report.batch_findings(fixed, [32, 128, 2048])
    assert [f.verdict for f in found] == ["batch 32 better", "batch 32 better", "indistinguishable"]
    assert "test accuracy, fixed lr" in found[0].text and "training accuracy" in found[1].text
    assert "accuracy at batch 2048" in found[2].text
    assert len(findings.current().comparisons) == 3


def test_part_3_compares_warmup_with_none_at_each_batch_and_names_the_failed_runs():
    scaled = (rows("scaled lr", 512, [0.5, 0.6, 0.1], failed=False) + rows("scaled + warmup", 512, [0.8] * 3)
              + rows("scaled lr", 2048, [0.1] * 3, failed=True) + rows("scaled + warmup", 2048, [0.1] * 3))  # fmt: skip
    found = lab05_report.schedule_findings(scaled, [512, 2048])
    assert len(found) == 3 and len(findings.current().comparisons) == 2
    assert "batch 512" in found[0].text and "batch 2048" in found[1].text
    said = texts(found)[2]
    assert said.startswith("Runs that failed to train: scaled lr at batch 2048, seed 0;")
    assert "seed 2." in said and "warmup" not in said
    assert lab05_report.failed_runs([]) == "Runs that failed to train: none."


def test_part_4_compares_lars_twice_at_each_of_the_two_largest_and_shares_what_each_won_back():
    results = (rows("fixed lr", 32, [0.9, 0.9, 0.9]) + rows("fixed lr", 512, [0.5, 0.5, 0.5])
               + rows("fixed lr", 2048, [0.3] * 3)
               + rows("scaled lr", 512, [0.5, 0.6, 0.7], lr=0.8) + rows("scaled lr", 2048, [0.1] * 3, lr=3.2)
               + rows("scaled + warmup", 512, [0.6] * 3) + rows("scaled + warmup", 2048, [0.1] * 3)
               + rows("LARS + warmup", 512, [0.8, 0.8, 0.8]) + rows("LARS + warmup", 2048, [0.6] * 3))  # fmt: skip
    found = lab05_report.lars_findings(results, [32, 128, 512, 2048], 0.5, 0.02)
    assert len(findings.current().comparisons) == 4
    compared = [f for f in found if getattr(f, "record", None)]
    assert [f.record["what"] for f in compared] == ["test accuracy at batch 512"] * 2 + [
        "test accuracy at batch 2048"
    ] * 2
    assert [f.record["names"] for f in compared] == [
        ["LARS + warmup", "fixed lr"],
        ["LARS + warmup", "scaled + warmup"],
    ] * 2
    shares = {
        f.text.split("**")[1]: f.numbers["median"]
        for f in found
        if getattr(f, "verdict", "") == "value"
    }
    # LARS at 512 won back (0.8 - 0.5) / (0.9 - 0.5) = 75 % of what fixed lr lost
    assert shares[
        "LARS + warmup at batch 512, share of fixed lr's lost accuracy won back"
    ] == pytest.approx(75)
    assert shares[
        "scaled lr at batch 2048, share of fixed lr's lost accuracy won back"
    ] == pytest.approx(-100 / 3)
    assert texts(found)[-1].startswith("Tuning: LARS ran at lr 0.5 and trust 0.02")
    assert "(up to 3.2 at batch 2048)" in texts(found)[-1]


def test_part_4_says_when_fixed_lr_lost_nothing_to_win_back():
    results = [
        r
        for b in (128, 2048)
        for m in ("scaled + warmup", "LARS + warmup")
        for r in rows(m, b, [0.6] * 3)
    ]
    results += (
        rows("fixed lr", 32, [0.5] * 3)
        + rows("fixed lr", 128, [0.4] * 3)
        + rows("fixed lr", 2048, [0.4, 0.6, 0.4])
    )
    said = texts(lab05_report.lars_findings(results, [32, 128, 2048], 0.5, 0.02))
    assert "At batch 2048 fixed lr lost no accuracy against batch 32 on some seed" in " ".join(said)
    assert "Tuning" in said[-1] and "(at batch 2048)" in said[-1]


def test_the_table_aggregates_over_seeds_per_method_and_batch():
    table = lab05_report.table(
        rows("fixed lr", 32, [0.9, 0.8, 0.7]) + rows("fixed lr", 64, [0.5, 0.6, 0.4], failed=True)
    ).data
    assert table[
        ["global batch", "accuracy_median", "accuracy_min", "accuracy_max", "failed"]
    ].values.tolist() == [[32, 0.8, 0.7, 0.9, 0], [64, 0.5, 0.4, 0.6, 3]]


def test_the_loss_plots_draw_every_seed_a_colour_per_batch():
    import matplotlib.pyplot as plt

    fixed = rows("fixed lr", 32, [0.9] * 3) + rows("fixed lr", 128, [0.8] * 3)
    fig, axes = plt.subplots(1, 2)
    lab05_report.plot_losses(fixed, SEEDS, 0.05, 2, axes)
    assert len(axes[0].lines) == len(axes[1].lines) == 6
    assert [t.get_text() for t in axes[0].get_legend().get_texts()] == ["batch 32", "batch 128"]
    colours = {line.get_color() for line in axes[1].lines}
    assert len(colours) == 2 and axes[1].get_xscale() == "log"
    plt.close(fig)
