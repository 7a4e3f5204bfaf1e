"""helpers/labs/lab04_report.py: what lab 04's free cells show, from real runs of the solution.

The solution's answers (taken from the solution notebook) run on gloo ranks through the harness at
small sizes; the report must show what they computed: the student's bubble formula in the theory
column, the student's measured bubble in the measured one, one GPipe-against-1F1B comparison per
m and one per pair of ways (the family the lab declares), and the schedules' held micro-batches.
"""

from __future__ import annotations

import matplotlib
import nbformat
import pytest

from course.grading import cells
from course.syllabus import REPO
from helpers import plots
from helpers.labs import lab04_harness, lab04_report
from helpers.measure import findings
from helpers.parallel import pipeline as pp

matplotlib.use("Agg")
LAB = REPO / "solutions" / "lab04_pipeline_tensor.ipynb"


def solution(*gids: str) -> dict:
    """The namespace of the solution's cells ``gids`` with the lab's imports, under a module name no
    rank can import: its functions travel to the ranks by value, as a notebook's do."""
    source = {cells.grade_id(c): c.source for c in nbformat.read(LAB, as_version=4).cells}
    namespace = {"__name__": "lab04_answer"}
    exec("import time\nimport torch\nimport torch.distributed as dist\nfrom torch import nn\n"  # noqa: S102
         + "\n".join(source[g] for g in gids), namespace)  # fmt: skip
    return namespace


def test_the_mlp_line_counts_the_lab_models_parameters():
    assert lab04_report.mlp_line(4, 8, 2) == (
        "the MLP: 4 layers of 8, 288 parameters; cut into 2 stages of 2 layers"
    )


@pytest.mark.slow
def test_the_bubble_table_and_findings_show_the_students_measurement_of_a_real_run():
    ns = solution("pipeline_step", "bubble_fraction", "measured_bubble")
    micro, repeats = [1, 2], 2
    timed = {(kind, m): lab04_harness.timed_runs(ns["pipeline_step"], kind, m, repeats, 0.004, 0.008, 2)
             for kind in ("gpipe", "1f1b") for m in micro}  # fmt: skip
    values = {c: [ns["measured_bubble"](events) for events in steps] for c, steps in timed.items()}
    table = lab04_report.bubble_table(values, ns["bubble_fraction"], 2)
    assert list(table.index) == [(k, 2, m) for k in ("gpipe", "1f1b") for m in micro]
    assert list(table["theory"]) == [1 / 2, 1 / 3] * 2
    assert list(table["max"]) == [max(values[c]) for c in values]
    findings.family(len(micro))
    lines = lab04_report.bubble_findings(values, ns["bubble_fraction"], 2, micro)
    assert [f.verdict == "value" for f in lines] == [True, True, False] * len(micro)
    assert "bubble at m = 2" in str(lines[-1]) and len(findings.current().comparisons) == len(micro)
    lab04_report.plot_timeline(
        timed["gpipe", 2][0], ns["measured_bubble"], 2, [4, 8], 2, plots.pipeline
    )
    axes = matplotlib.pyplot.gcf().axes
    assert axes[1].get_title().startswith("measured with your engine: bubble 0.")


def test_the_memory_table_holds_what_the_students_schedules_hold():
    ns = solution("schedules")
    peaks = {"GPipe": [800, 600], "1F1B": [400, 600]}
    table = lab04_report.memory_table(peaks, ns["gpipe_order"], ns["one_f_one_b_order"], 2, 4)
    assert list(table["micro-batches held, GPipe"]) == [4, 4]
    assert list(table["micro-batches held, 1F1B"]) == [
        pp.in_flight(pp.one_f_one_b(2, 4, s)) for s in (0, 1)
    ]
    assert list(table["1F1B / GPipe"]) == [0.5, 1.0]
    lab04_report.plot_schedules(ns["gpipe_order"], ns["one_f_one_b_order"], plots.pipeline)
    titles = [ax.get_title() for ax in matplotlib.pyplot.gcf().axes]
    want = [f"{k}, p = 4, m = 6 (your schedule, laid out in time): idle" for k in ("GPipe", "1F1B")]
    assert [t.split(" 33%")[0] for t in titles] == want  # each schedule's bubble, (4-1)/(6+4-1)


def test_the_comparison_is_each_pair_of_ways_and_the_bytes_break_even():
    def rank(times, sent):
        return {"times": times, "kept": {"parameters": 4e6, "gradients": 4e6}, "activations": 1e6,
                "sent": sent}  # fmt: skip

    per_way = {"DP": [rank([0.010, 0.011, 0.012], 8e6)] * 2, "PP": [rank([0.02, 0.021, 0.022], 1e5)] * 2,
               "TP": [rank([0.010, 0.0115, 0.013], 2e6)] * 2}  # fmt: skip
    table, steps = lab04_report.comparison(per_way)
    assert list(table.index) == ["DP", "PP", "TP"] and steps["PP"] == [0.02, 0.021, 0.022]
    findings.family(3)
    lines = lab04_report.comparison_findings(steps, table, 256, 1)
    compared = [f for f in lines if isinstance(f, findings.Finding)]
    assert len(compared) == 3 and len(findings.current().comparisons) == 3
    assert lines[-1].endswith("They are equal at a batch of about 1,024.")
