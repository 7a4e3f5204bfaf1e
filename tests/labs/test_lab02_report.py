"""helpers/labs/lab02_report.py and lab 02's compression runs: what its free cells show.

The solution's answers (from the solution notebook) are the student's code the report calls, on
real runs at small sizes: the timing of both DDPs and of the solution's DataParallel, the counted
epochs, the accumulation and the compression hooks. A table that lost an implementation, a
batch or a seed, a byte count the student's function did not compute, or a hook whose bytes
disagree with ``hook_bytes`` fails here.
"""

from __future__ import annotations

import matplotlib
import nbformat
import pytest

from course.grading import cells
from course.syllabus import REPO
from helpers import plots
from helpers.labs import lab02_harness, lab02_report
from helpers.measure import findings

matplotlib.use("Agg")
LAB = REPO / "solutions" / "lab02_build_ddp.ipynb"
SMALL = {
    "steps": 2,
    "warmup": 1,
    "batch_size": 8,
    "cap_mb": 0.01,
    "lr": 0.05,
    "hidden": 16,
    "depth": 2,
}


def solution(*gids: str) -> dict:
    """The solution's cells ``gids`` run with the lab's imports, under a module name no rank can
    import (its classes and functions travel to the ranks by value, as a notebook's do)."""
    source = {cells.grade_id(c): c.source for c in nbformat.read(LAB, as_version=4).cells}
    namespace = {"__name__": "lab02_answer"}
    exec("import contextlib\nimport copy\nimport math\nimport torch\nimport torch.distributed as dist\n"  # noqa: S102
         "from torch import nn\nloss_fn = nn.CrossEntropyLoss()\n"
         + "\n".join(source[g] for g in gids if g != "dp_step")  # the locked cell's helpers need the lab
         + "\n" + source["dp_step"].split("def dp_run")[0], namespace)  # fmt: skip
    return namespace


@pytest.fixture(scope="module")
def answers():
    return solution("dp_primitives", "scratch_ddp", "epoch_bytes", "dp_step")


@pytest.mark.slow
def test_the_timing_table_has_every_implementation_and_two_comparisons(answers):
    def run(impl):
        return lab02_harness.run_impl(
            impl, answers["ScratchDDP"], answers["dp_step"], 2, "gloo", **SMALL
        )

    runs = {impl: [run(impl), run(impl)] for impl in lab02_harness.IMPLS}
    findings.family(2)
    table, lines = lab02_report.timing(runs, 2)
    assert list(table["implementation"]) == list(lab02_harness.IMPLS)
    assert lines[0].endswith("(medians of 2 repeats each)")
    assert ["ScratchDDP" in str(lines[1]), "your DataParallel" in str(lines[2])] == [True, True]
    assert len(findings.current().comparisons) == 2
    lab02_report.plot_overlaps(runs, plots.overlap)
    assert [ax.get_title().split(":")[0] for ax in matplotlib.pyplot.gcf().axes] == [
        "torch DDP",
        "ScratchDDP",
    ]


def test_the_dataparallel_timeline_draws_the_students_step(answers):
    lab02_report.dp_timeline(answers["dp_step"], 2, 8, 16, 2)
    assert (
        "One step of your DataParallel, 2 thread-devices"
        in matplotlib.pyplot.gcf().axes[0].get_title()
    )


@pytest.mark.slow
def test_bytes_by_phase_are_the_students_formula_on_counted_epochs(answers):
    from helpers.launcher.launch import launch

    measured = {b: launch(lab02_harness.counted_epoch, b, world_size=2, backend="gloo", output="none")[0]
                for b in (128, 512)}  # fmt: skip
    table, line = lab02_report.bytes_by_phase(measured, answers["epoch_bytes"], 256, 2)
    assert list(table.index) == [128, 512] and line.startswith("rank 0 of 2: 719 samples per epoch")
    for b, m in measured.items():
        assert table.loc[b, ("per epoch", "all-reduce")] == m["counted"]["all-reduce"]
        assert table.loc[b, ("per step", "backward")] == 4


def test_the_no_sync_line_says_once_against_k_times():
    line = lab02_report.no_sync_line({"all-reduced per step": [100, 100]}, k=4)
    assert line.startswith("with no_sync: 100 bytes all-reduced per step; without it,")


@pytest.mark.slow
def test_compression_runs_check_their_bytes_and_the_findings_compare_with_fp32(monkeypatch):
    monkeypatch.setattr(lab02_harness, "SETTINGS", [("none", 0), ("fp16", 0)])
    rows = lab02_harness.compression_runs([0, 1], 1, 0.05, 16, 1, 2, "gloo")
    assert [(r["hook"], r["seed"]) for r in rows] == [
        ("none", 0),
        ("none", 1),
        ("fp16", 0),
        ("fp16", 1),
    ]
    assert rows[0]["bytes/step"] == 2 * rows[2]["bytes/step"]
    results, summary = lab02_report.compression_tables(rows)
    assert list(summary["hook"]) == ["none", "fp16"] and list(summary.columns[-3:]) == [
        "median",
        "min",
        "max",
    ]
    findings.family(1)
    lines = lab02_report.compression_findings(results)
    assert lines[0] == "fp16: 2.0× fewer bytes than fp32" and "test accuracy" in lines[1]
    lab02_report.plot_compression(summary, 1, 2, [0, 1])
    assert matplotlib.pyplot.gcf().axes[0].get_xlabel() == "bytes all-reduced per step (log)"
