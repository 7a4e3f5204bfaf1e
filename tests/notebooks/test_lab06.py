"""Lab 06 end to end: graded like a student's — unfinished, and plausibly wrong.

The wrong answers are the ones a student would write: gradient bytes that count frozen parameters,
or the state dict (buffers too), or 4 bytes whatever the dtype, or elements instead of bytes, or a
tied weight twice, or a layer as frozen as its first parameter, or the course's own function; a
communication share from all communication instead of the exposed part, a mean, warm-up kept,
skip ignored, a ratio of medians or of sums; a time to target that ignores the target asked,
accepts a loss equal to the target, counts only the crossing epoch's seconds or those before it,
numbers epochs from 0, takes the last crossing, reports the end of training when the target is
never reached, or rounds the seconds. The zoo, the training runs, the ViT, the sweep and the plots
grade nothing and are left out. The grader (tests/notebooks/test_class_grading.py) grades the
first wrong answer of every question in two halves, each the released lab filled in (each wrong in
every other question: a wrong answer costs its own points and only those); every wrong answer is
also checked in one kernel against its question's test cell, hidden parts included, and so is each
unfinished cell of the released lab (lab_grading.wrong_answer_verdicts).
"""

from __future__ import annotations

import lab_grading
import pytest

from course.syllabus import REPO

LAB = REPO / "solutions" / "lab06_benchmarking.ipynb"
STUDENT = REPO / "labs" / "lab06_benchmarking.ipynb"
AUTO = {"test_gradient_bytes": 1, "test_comm_share": 1, "test_time_to_target": 2}
MANUAL = {"answer_time_to_target", "answer_zoo", "answer_report"}


def gradient_bytes(expr: str) -> str:
    return f"def gradient_bytes(model):\n    return {expr}\n"


def comm_share(body: str) -> str:
    return f"def comm_share(records, skip):\n    {body}\n"


def time_to_target(body: str) -> str:
    return f"def time_to_target(history, target):\n{body}\n"


WRONG = {
    "gradient_bytes": (
        "test_gradient_bytes",
        [
            gradient_bytes("sum(p.numel() * p.element_size() for p in model.parameters())"),
            gradient_bytes(
                "sum(t.numel() * t.element_size() for t in model.state_dict().values())"
            ),
            gradient_bytes("4 * sum(p.numel() for p in model.parameters() if p.requires_grad)"),
            gradient_bytes("sum(p.numel() for p in model.parameters() if p.requires_grad)"),
            gradient_bytes(
                "sum(p.numel() * p.element_size() for m in model.modules() "
                "for p in m.parameters(recurse=False) if p.requires_grad)"
            ),  # a tied weight counted in both modules
            "import helpers\n"
            + gradient_bytes("helpers.comm.gradient_bytes(model)"),  # the course's
            # the course's, imported before the test (it unbound only helpers.comm's name)
            "from helpers.measure.comm import gradient_bytes",
        ],
    ),
    "comm_share": (
        "test_comm_share",
        [
            comm_share(
                'return statistics.median(r["comm_s"] / r["total"] for r in records[skip:])'
            ),
            comm_share(
                'return statistics.mean(r["exposed_comm_s"] / r["total"] for r in records[skip:])'
            ),
            comm_share(
                'return statistics.median(r["exposed_comm_s"] / r["total"] for r in records)'
            ),
            comm_share(
                'return statistics.median(r["exposed_comm_s"] for r in records[skip:]) / '
                'statistics.median(r["total"] for r in records[skip:])'
            ),
            comm_share(
                'return sum(r["exposed_comm_s"] for r in records[skip:]) / '
                'sum(r["total"] for r in records[skip:])'
            ),
            comm_share(
                'return statistics.median(r["exposed_comm_s"] / r["total"] for r in records[1:])'
            ),
            comm_share(
                'return statistics.median(1 - r["compute"] / r["total"] for r in records[skip:])'
            ),
        ],
    ),
    "time_to_target": (
        "test_time_to_target",
        [
            time_to_target(  # a loss equal to the target accepted
                """    seconds = 0.0
    for row in history:
        seconds += row["seconds"]
        if row["train loss"] <= target:
            return row["epoch"], seconds
    return None"""
            ),
            time_to_target(  # only the crossing epoch's seconds
                """    for row in history:
        if row["train loss"] < target:
            return row["epoch"], row["seconds"]
    return None"""
            ),
            time_to_target(  # epochs numbered from 0
                """    seconds = 0.0
    for i, row in enumerate(history):
        seconds += row["seconds"]
        if row["train loss"] < target:
            return i, seconds
    return None"""
            ),
            time_to_target(  # the last crossing
                """    hit, seconds = None, 0.0
    for row in history:
        seconds += row["seconds"]
        if row["train loss"] < target:
            hit = (row["epoch"], seconds)
    return hit"""
            ),
            time_to_target(  # never reached: the end of training reported instead of None
                """    seconds = 0.0
    for row in history:
        seconds += row["seconds"]
        if row["train loss"] < target:
            break
    return row["epoch"], seconds"""
            ),
            time_to_target(  # the seed's threshold, whatever target is asked
                """    seconds = 0.0
    for row in history:
        seconds += row["seconds"]
        if row["train loss"] < 0.04:
            return row["epoch"], seconds
    return None"""
            ),
            time_to_target(  # the seconds before the crossing epoch
                """    seconds = 0.0
    for row in history:
        if row["train loss"] < target:
            return row["epoch"], seconds
        seconds += row["seconds"]
    return None"""
            ),
        ],
    ),
}
# the measurements, the sweep and the plots grade nothing: a class is graded without them
UNGRADED = (
    "lab06_runs.zoo(",
    "lab06_report.zoo_plot(",
    "lab06_report.zoo_findings(",  # the findings printed from the timing cells left out above
    "lab06_runs.to_target(",
    "lab06_report.ttt_plot(",
    "lab06_report.ttt_findings(",
    "lab06_runs.vit_run",
    "lab06_runs.backends(",
    "lab06_runs.sweep(",
    "lab06_report.sweep_table(",
    "lab06_report.claim_repeats(",
)


# Found by a student-like pass written without reading the tests (issue 31): right on the fixed
# cases, wrong on the input space the hidden tests now sweep (cases drawn from the run's seed).
SWEPT = {
    "gradient_bytes": [
        # 2 bytes for half precision, 4 for anything else: float64 counted at half its size
        r'''
def gradient_bytes(model):
    """Bytes of gradient DDP all-reduces per step for ``model``."""
    size = {torch.float16: 2, torch.bfloat16: 2}      # half precision: 2 bytes; everything else fp32
    return sum(p.numel() * size.get(p.dtype, 4) for p in model.parameters() if p.requires_grad)
''',
        # frozen or not by layer, read from its first parameter: a layer that trains its bias and
        # not its weight (or the other way round) is counted whole or not at all
        r'''
def gradient_bytes(model):
    """Bytes of gradient DDP all-reduces per step for ``model``."""
    seen, total = set(), 0
    for layer in model.modules():
        params = [p for p in layer.parameters(recurse=False) if id(p) not in seen]   # a tied weight once
        seen.update(id(p) for p in params)
        if params and params[0].requires_grad:        # a frozen layer sends nothing
            total += sum(p.numel() * p.element_size() for p in params)
    return total
''',
    ],
    "comm_share": [
        # no step after skip: falls back to every record, the warm-up's share reported as the run's
        r'''
def comm_share(records, skip):
    """Median over the steps after ``skip`` of exposed communication / step time."""
    steps = records[skip:] or records             # a run too short to skip: keep what there is
    return statistics.median(r["exposed_comm_s"] / r["total"] for r in steps)
''',
    ],
    "time_to_target": [
        # the seconds rounded to the millisecond, as a timer shows them: right on sums like 4.5 s
        time_to_target(
            """    seconds = 0.0
    for row in history:
        seconds += row["seconds"]
        if row["train loss"] < target:
            return row["epoch"], round(seconds, 3)
    return None"""
        ),
    ],
}
for _gid, _more in SWEPT.items():
    WRONG[_gid][1].extend(_more)


def test_every_question_has_wrong_answers_that_differ_from_the_solution():
    lab_grading.assert_wrong_answers_are_wrong(LAB, WRONG, AUTO)


def test_the_unfinished_student_version_says_what_to_do():
    lab_grading.assert_student_version_has_stubs(STUDENT, 3)


def test_the_sweep_point_notebook_writes_what_it_measured(tmp_path):
    """The papermill sweep's point notebook, run as the lab runs it: its JSON has the bytes of
    theory and a time per step (a quick model, one rank and two)."""
    import json

    import papermill as pm

    from helpers.measure import zoo

    for n in (1, 2):
        out = tmp_path / f"n{n}.json"
        pm.execute_notebook(
            zoo.POINT,
            tmp_path / f"n{n}.ipynb",
            kernel_name="multigpu-course",
            parameters={"model": "squeezenet1_0", "world_size": n, "steps": 2, "out": str(out)},
            progress_bar=False,
            extra_arguments=["--IPKernelApp.log_level=CRITICAL"],
        )
        r = json.loads(out.read_text())
        assert r["params"] == 740_554 and len(r["step seconds"]) == 2
        assert r["bytes/step"] == ([4 * 740_554] * 2 if n == 2 else [])
        assert all(s > 0 for s in r["step seconds"])


verdict_run, test_replaying_the_locked_helpers_of_another_seed_scores_nothing = (
    lab_grading.verdict_and_replay(LAB, STUDENT, WRONG, UNGRADED, AUTO)
)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the verdict kernel (the fixture) runs inside the first test
def test_each_plausible_wrong_answer_fails_its_test_cell(verdict_run):
    lab_grading.assert_each_wrong_answer_fails_its_test(verdict_run[1], WRONG)
