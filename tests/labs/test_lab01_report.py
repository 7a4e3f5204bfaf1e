"""helpers/labs/lab01_report.py and lab 01's three-way training: what its free cells show.

Real runs at one and two ranks (a few steps of a small MLP, the harness's own) feed the tables and
findings; the solution's answers (from the solution notebook) are the student's functions they
call. A report that lost a configuration or a repeat, mixed up the baseline, or computed the wire
bytes without the student's function fails here.
"""

from __future__ import annotations

import matplotlib
import nbformat
import pytest

from course.grading import cells
from course.syllabus import REPO
from helpers.labs import lab01_harness, lab01_report
from helpers.launcher.launch import launch
from helpers.measure import findings
from helpers.workloads import data

matplotlib.use("Agg")
LAB = REPO / "solutions" / "lab01_ddp_scaling.ipynb"
SETTING = {"model_name": "mlp", "in_shape": (1, 8, 8), "hidden": 32, "depth": 2, "lr": 0.05,
           "device": "cpu", "bucket_cap_mb": 0.01, "memory_budget": "16MB"}  # fmt: skip
WARMUP, STEPS, BATCH, REPEATS = 1, 2, 16, 2


def solution(gid: str, replace: tuple[str, str] | None = None) -> dict:
    """The solution's cell ``gid`` run with the lab's imports, under a module name no rank can
    import (its functions travel to the ranks by value, as a notebook's do)."""
    cell = next(c for c in nbformat.read(LAB, as_version=4).cells if cells.grade_id(c) == gid)
    source = cell.source if replace is None else cell.source.replace(*replace)
    namespace = {"__name__": "lab01_answer"}
    exec("import math\nimport torch\nimport torch.distributed as dist\n" + source, namespace)  # noqa: S102
    return namespace


@pytest.fixture(scope="module")
def runs():
    digits = data.load("digits").tensors
    configs = [(ws, BATCH) for ws in (1, 2)]
    return {c: [lab01_harness.run_config(SETTING, digits, c, STEPS, WARMUP, "gloo") for _ in range(REPEATS)]
            for c in configs}  # fmt: skip


def test_the_batches_double_up_to_the_largest_that_fits():
    assert lab01_report.doublings(None) == []
    assert lab01_report.doublings(32) == [32]
    assert lab01_report.doublings(256) == [32, 64, 128, 256]


@pytest.mark.slow
def test_the_tables_have_every_configuration_and_repeat_and_the_students_wire_bytes(runs):
    over = {c: False for c in runs}
    epochs = lab01_report.epoch_times(runs, 1437, WARMUP)
    assert list(epochs) == list(runs) and all(len(v) == REPEATS for v in epochs.values())
    assert lab01_report.runs_line(runs, over) == f"2 configurations × {REPEATS} repeats done"
    findings.family(1)
    (line,) = lab01_report.scaling_findings(epochs, over)
    assert (
        "epoch time at per-rank batch 16" in str(line) and len(findings.current().comparisons) == 1
    )
    ring = solution("bytes_theory")["ring_bytes_per_rank"]
    rows = lab01_report.comm_rows(runs, WARMUP, over, ring)
    grads = 4 * sum(p.numel() for p in lab01_harness.make_model(SETTING).parameters())
    assert [(r["world_size"], r["bytes/step"]) for r in rows] == [(1, 0.0), (2, grads)]
    assert rows[1]["wire bytes/rank"] == ring(grads, 2) == grads and rows[0]["hidden"] is None
    assert (
        lab01_report.overlap_step(runs, [1, 2], [BATCH], over) == runs[2, BATCH][0][0]["timing"][-1]
    )
    assert lab01_report.overlap_step(runs, [1, 2], [BATCH], {**over, (2, BATCH): True}) is None


@pytest.mark.slow
def test_one_device_by_batch_is_a_table_an_order_and_a_plot(runs):
    one_device = {
        BATCH: [run[0] for run in runs[1, BATCH]],
        2 * BATCH: [run[0] for run in runs[1, BATCH]],
    }
    table = lab01_report.by_batch(one_device, 1437, WARMUP)
    assert list(table["batch size"]) == [BATCH, 2 * BATCH]
    assert (table["min"] <= table["median"]).all() and (table["median"] <= table["max"]).all()
    findings.family(1)
    assert "epoch time" in str(lab01_report.batch_order(one_device, 1437, WARMUP))
    ax = lab01_report.plot_by_batch(table, "16MB")
    assert ax.get_title().startswith("One device (16MB, 1 core)")


@pytest.mark.slow
def test_three_ways_agree_with_the_solution_and_not_with_a_sum_never_divided():
    digits = data.load("digits").tensors
    for replace, agree in ((None, True), (("p.grad /= size", "pass"), False)):
        average = solution("average_gradients", replace)["average_gradients"]
        per_rank = launch(lab01_harness.train_three_ways, average, SETTING, digits, 2, 8,
                          world_size=2, backend="gloo", output="none")  # fmt: skip
        diffs = lab01_harness.largest_differences(per_rank)
        assert len(diffs) == 2
        assert all((d["vs_ddp"] < 1e-5 and d["vs_one_process"] < 1e-5) == agree for d in diffs), (
            diffs
        )


def test_a_budget_line_names_every_rank_and_oversubscription():
    budgets = [
        {"threads": 1, "cores": [0], "oversubscribed": True},
        {"threads": 1, "cores": [0], "oversubscribed": True},
    ]
    line = lab01_report.budget_line(2, budgets)
    assert (
        line
        == "world size 2: rank 0: 1 thread(s) on cores [0], rank 1: 1 thread(s) on cores [0]  (oversubscribed)"
    )
