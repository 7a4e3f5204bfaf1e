"""helpers/labs/lab04_harness.py and lab04's check helpers: the runners lab 04's cells hand the
student's code to, and the assertions its checks make, one case each.

The solution's answers (taken from the solution notebook) run on real gloo ranks through the
runners, and lab 04's own check helpers judge what came back: the solution passes; an answer that
calls the course's finished code, or reports a schedule it did not follow, fails.
"""

from __future__ import annotations

import re

import nbformat
import pytest

from course.grading import cells
from course.syllabus import REPO
from helpers.labs import lab04, lab04_harness
from helpers.parallel import pipeline as pp

LAB = REPO / "solutions" / "lab04_pipeline_tensor.ipynb"
MARKS = re.compile(r"^[ \t]*### (BEGIN|END) SOLUTION[ \t]*\n?", re.M)


def answer(gid: str, extra: str = "") -> dict:
    """The namespace of the solution's cell ``gid`` (markers removed, ``extra`` appended), run
    with the lab's imports under a module name no rank can import: its functions and classes
    travel to the ranks by value, as a notebook's do."""
    cell = next(c for c in nbformat.read(LAB, as_version=4).cells if cells.grade_id(c) == gid)
    namespace = {"__name__": "lab04_answer"}
    exec("import time\nimport torch\nimport torch.distributed as dist\nfrom torch import nn\n"
         + MARKS.sub("", cell.source) + extra, namespace)  # fmt: skip
    return namespace


def test_the_schedule_check_passes_the_courses_schedules_and_fails_a_deadlock():
    for kind in ("gpipe", "1f1b"):
        for p, m in ((1, 1), (2, 3), (4, 2), (4, 8)):
            orders = [[list(op) for op in pp.SCHEDULES[kind](p, m, s)] for s in range(p)]
            lab04.assert_schedule(orders, kind, p, m)
    # every stage's backwards before its forwards: no stage can start
    backwards_first = [[["B", 0], ["F", 0]], [["B", 0], ["F", 0]]]
    with pytest.raises(AssertionError):
        lab04.assert_schedule(backwards_first, "gpipe", 2, 1)
    with pytest.raises(AssertionError, match="2 stages expected"):
        lab04.assert_schedule([[["F", 0], ["B", 0]]], "gpipe", 2, 1)


@pytest.mark.slow
def test_the_engine_runner_reports_what_the_solution_ran_and_the_course_engine_is_caught():
    step = answer("pipeline_step")["pipeline_step"]
    for case in (("gpipe", 2, 4), ("1f1b", 2, 1)):
        lab04.assert_like_one_process(lab04_harness.engine_runs(step, *case), *case)
    course = answer("pipeline_step", "\n\ndef pipeline_step(*args):\n"
                    "    from helpers.parallel import pipeline as pp\n"
                    "    r = pp.run(*args)\n    return r['loss'], r['events']\n")  # fmt: skip
    runs = lab04_harness.engine_runs(course["pipeline_step"], "gpipe", 2, 2)
    with pytest.raises(AssertionError, match="write pipeline_step yourself"):
        lab04.assert_like_one_process(runs, "gpipe", 2, 2)


@pytest.mark.slow
def test_the_tp_runner_reports_what_the_solution_ran_and_the_course_f_is_caught():
    tp_mlp = answer("tensor_parallel")["tp_mlp"]
    lab04.assert_like_dense(lab04_harness.tp_runs(tp_mlp, 2, 6, 8, 5), 2, 6, 8, 5)
    course_f = answer("tensor_parallel", "\nfrom helpers.parallel import tensor_parallel as _tp\n"
                      "CopyToParallel = _tp._CopyToParallel\n")  # fmt: skip
    runs = lab04_harness.tp_runs(course_f["tp_mlp"], 2, 6, 8, 5)
    with pytest.raises(AssertionError, match="write f, g and tp_mlp yourself"):
        lab04.assert_like_dense(runs, 2, 6, 8, 5)


@pytest.mark.slow
def test_the_three_ways_report_the_bytes_each_is_known_to_send():
    depth, width, batch, n = 4, 16, 16, 2
    per_way = {
        way: lab04_harness.launch(lab04_harness.compare, way, depth, width, batch, 1,
                                  world_size=n, backend="gloo", output="none")
        for way in lab04_harness.WAYS
    }  # fmt: skip
    params = depth * (width * width + width)
    assert {r["sent"] for r in per_way["DP"]} == {4 * params}  # the whole gradient, every rank
    # TP: an all-reduce of a (batch, width) activation forward per pair, backward for all but the first
    pairs = depth // 2
    assert {r["sent"] for r in per_way["TP"]} == {4 * batch * width * (2 * pairs - 1)}
    for way, per_rank in per_way.items():
        row, steps = lab04_harness.comparison_row(way, per_rank)
        assert row["way"] == way and len(steps) == 1 and row["MB sent / rank / step"] > 0
