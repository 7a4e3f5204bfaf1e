"""Lab 04 end to end: graded like a student's — unfinished, and plausibly wrong.

The wrong answers are the ones a student would write: a 1F1B warm-up one too long, or counted from
the wrong end, or left out, GPipe's backwards in reverse, a micro-batch forgotten; an engine whose
loss is not divided by m, whose received activations never ask for a gradient, that feeds micro-
batch 0 every time, that sends gradients the wrong way or not at all, or sends with a blocking
`send`, or times the wait in `recv` as compute, or gives each stage one role (first, middle or
last) and so fails on a single stage; the bubble as (p−1)/m or p/(m+p−1); a measured
bubble over each rank's own span, over the number of events, without the ranks, from time 0, from
the first and last event listed; a tensor-parallel MLP without the forward all-reduce, with the
bias added on every rank, without the backward all-reduce, all-reducing both ways, or averaging
instead of summing. The grader grades the first wrong answer of every question in two halves, each
the released lab filled in (each wrong in every other question: a wrong answer costs its own points
and only those); every wrong answer is also checked in one kernel against its question's test cell,
hidden parts included, and so is each unfinished cell of the released lab
(lab_grading.wrong_answer_verdicts). The ungraded timing, memory and comparison cells are left out.
"""

from __future__ import annotations

import lab_grading
import nbformat
import pytest

from course.grading import cells
from course.syllabus import REPO

LAB = REPO / "solutions" / "lab04_pipeline_tensor.ipynb"
STUDENT = REPO / "labs" / "lab04_pipeline_tensor.ipynb"
AUTO = {
    "test_schedules": 3,
    "test_pipeline_step": 4,
    "test_bubble_fraction": 1,
    "test_measured_bubble": 2,
    "test_tensor_parallel": 4,
}
MANUAL = {"answer_bubble", "answer_memory", "answer_comparison"}

GPIPE = """def gpipe_order(p, m, stage):
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
"""


def one_f_one_b(warm: str = "min(p - stage - 1, m)", gpipe: str = GPIPE) -> str:
    return (
        gpipe
        + f"""
def one_f_one_b_order(p, m, stage):
    warm = {warm}
    ops = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        ops += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    return ops + [("B", i) for i in range(b, m)]
"""
    )


ENGINE_RIGHT = {
    "input": """x = torch.empty(shape)
                dist.recv(x, src=rank - 1)
                x.requires_grad_()""",
    "micro": "x = inputs[i]",
    "loss": "out = loss_fn(out, targets[i]) / m",
    "send_grad": "pending.append(dist.isend(x.grad, dst=rank - 1))",
    "send_out": "sending = None if last else dist.isend(out.detach(), dst=rank + 1)",
}


def engine(**wrong) -> str:
    """pipeline_step, right except the parts given."""
    body = {**ENGINE_RIGHT, **wrong}
    return f"""
def pipeline_step(stage, order, inputs, targets, loss_fn, shape):
    rank, p = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == p - 1
    m = sum(1 for kind, _ in order if kind == "F")
    kept, pending, events, loss = {{}}, [], [], 0.0
    for kind, i in order:
        if kind == "F":
            if first:
                {body["micro"]}
            else:
                {body["input"]}
            start = time.perf_counter()
            out = stage(x)
            if last:
                {body["loss"]}
                loss += out.item()
            events.append({{"rank": rank, "op": "F", "micro": i, "start": start, "end": time.perf_counter()}})
            {body["send_out"]}
            kept[i] = (x, out, sending)
        else:
            x, out, sending = kept.pop(i)
            if sending is not None:
                sending.wait()
            grad = None
            if not last:
                grad = torch.empty_like(out)
                dist.recv(grad, src=rank + 1)
            start = time.perf_counter()
            out.backward(grad)
            events.append({{"rank": rank, "op": "B", "micro": i, "start": start, "end": time.perf_counter()}})
            if not first:
                {body["send_grad"]}
    for work in pending:
        work.wait()
    return (loss if last else None), events
"""


def timing_the_wait() -> str:
    """The engine with each event's clock started before the recv: waiting counted as compute."""
    out = engine()
    for before, after in (
        (
            "            if first:\n",
            "            start = time.perf_counter()\n            if first:\n",
        ),
        (
            "            start = time.perf_counter()\n            out = stage(x)",
            "            out = stage(x)",
        ),
        (
            "            grad = None\n",
            "            grad = None\n            start = time.perf_counter()\n",
        ),
        (
            "            start = time.perf_counter()\n            out.backward(grad)",
            "            out.backward(grad)",
        ),
    ):
        assert before in out, before
        out = out.replace(before, after, 1)
    return out


def fraction(expr: str) -> str:
    return f"def bubble_fraction(p, m):\n    return {expr}\n"


def measured(body: str) -> str:
    return f"def measured_bubble(events):\n    {body}\n"


TP_RIGHT = {
    "copy_back": """grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad""",
    "reduce_fwd": """x = x.contiguous()
        dist.all_reduce(x)
        return x""",
    "reduce_back": "return grad",
    "mlp": """hidden = torch.relu(nn.functional.linear(CopyToParallel.apply(x), w1_rows, b1_part))
    return ReduceFromParallel.apply(nn.functional.linear(hidden, w2_cols)) + b2""",
}


def tensor_parallel(**wrong) -> str:
    body = {**TP_RIGHT, **wrong}
    return f"""
class CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        {body["copy_back"]}

class ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        {body["reduce_fwd"]}

    @staticmethod
    def backward(ctx, grad):
        {body["reduce_back"]}

def tp_mlp(x, w1_rows, b1_part, w2_cols, b2):
    {body["mlp"]}
"""


WRONG = {
    "schedules": (
        "test_schedules",
        [
            one_f_one_b("min(p - stage, m)"),  # a warm-up one too long: one more micro-batch held
            one_f_one_b("min(stage, m)"),  # counted from the wrong end
            one_f_one_b("0"),  # no warm-up: every stage waits for each backward
            one_f_one_b(
                gpipe="""def gpipe_order(p, m, stage):
    return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]
"""
            ),  # GPipe's backwards last-in first-out
            one_f_one_b(
                gpipe="""def gpipe_order(p, m, stage):
    return [("F", i) for i in range(m - 1)] + [("B", i) for i in range(m - 1)]
"""
            ),  # a micro-batch forgotten
        ],
    ),
    "pipeline_step": (
        "test_pipeline_step",
        [
            engine(loss="out = loss_fn(out, targets[i])"),  # not divided by m
            engine(
                input="""x = torch.empty(shape)
                dist.recv(x, src=rank - 1)"""
            ),  # the received activation never asks for a gradient
            engine(micro="x = inputs[0]"),  # micro-batch 0 every time
            engine(send_grad="pass"),  # the gradient never sent back: stage 0 waits (timeout)
            engine(
                send_out="sending = None if last else dist.send(out.detach(), dst=rank + 1)",
                send_grad="dist.send(x.grad, dst=rank + 1)",
            ),  # blocking sends, and the gradients sent forward, to the wrong neighbour
            timing_the_wait(),  # the wait in recv timed as compute: the bubble would vanish
        ],
    ),
    "bubble_fraction": (
        "test_bubble_fraction",
        [
            f"def bubble_fraction(p, m):\n    return {wrong}"
            for wrong in ("(p - 1) / m", "p / (m + p - 1)", "(p - 1) / (m + p)", "1 / m")
        ],
    ),
    "measured_bubble": (
        "test_measured_bubble",
        [
            measured(
                """ranks = {e["rank"] for e in events}
    own = sum(max(e["end"] for e in events if e["rank"] == r) - min(e["start"] for e in events if e["rank"] == r) for r in ranks)
    return 1 - sum(e["end"] - e["start"] for e in events) / own"""
            ),  # each rank over its own span
            measured(
                """span = max(e["end"] for e in events) - min(e["start"] for e in events)
    return 1 - sum(e["end"] - e["start"] for e in events) / (len(events) * span)"""
            ),  # events counted instead of ranks
            measured(
                """span = max(e["end"] for e in events) - min(e["start"] for e in events)
    return 1 - sum(e["end"] - e["start"] for e in events) / span"""
            ),  # the ranks forgotten
            measured(
                """ranks = {e["rank"] for e in events}
    return 1 - sum(e["end"] - e["start"] for e in events) / (len(ranks) * max(e["end"] for e in events))"""
            ),  # the span from time 0
            measured(
                """ranks = {e["rank"] for e in events}
    return 1 - sum(e["end"] - e["start"] for e in events) / (len(ranks) * (events[-1]["end"] - events[0]["start"]))"""
            ),  # the events assumed in time order (they come grouped by rank)
        ],
    ),
    "tensor_parallel": (
        "test_tensor_parallel",
        [
            tensor_parallel(reduce_fwd="return x"),  # the row-parallel output never summed
            tensor_parallel(
                mlp="""hidden = torch.relu(nn.functional.linear(CopyToParallel.apply(x), w1_rows, b1_part))
    return ReduceFromParallel.apply(nn.functional.linear(hidden, w2_cols, b2))"""
            ),  # the bias added on every rank, before the sum
            tensor_parallel(copy_back="return grad"),  # the input's gradient never summed
            tensor_parallel(
                reduce_back="""grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad"""
            ),  # all-reduced both ways
            tensor_parallel(
                reduce_fwd="""x = x.contiguous()
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
        return x"""
            ),  # averaged, not summed
        ],
    ),
}
# The course's finished code called instead of written (the red team's answers, issue 41: they
# scored 14/14): right values, so only the call hook (helpers.labs.finished) fails them. The
# last of the schedules and of the measured bubble switch the hook off first.
FINISHED = {
    "schedules": [
        "from helpers import pipeline as pp\ngpipe_order = pp.gpipe\none_f_one_b_order = pp.one_f_one_b",
        """
import sys


def _unseen(f, *args):
    saved = sys.getprofile()
    sys.setprofile(None)
    try:
        return f(*args)
    finally:
        sys.setprofile(saved)


def gpipe_order(p, m, stage):
    return _unseen(pp.gpipe, p, m, stage)


def one_f_one_b_order(p, m, stage):
    return _unseen(pp.one_f_one_b, p, m, stage)
""",
    ],
    "pipeline_step": [
        """
def pipeline_step(stage, order, inputs, targets, loss_fn, shape):
    r = pp.run(stage, order, inputs, targets, loss_fn, shape)   # the course's engine
    return r["loss"], r["events"]
""",
    ],
    "bubble_fraction": ["bubble_fraction = pp.bubble_fraction"],
    "measured_bubble": [
        "measured_bubble = pp.bubble",
        """
import sys

_switch = sys.setprofile  # the real one, saved before the test's hook replaces it


def measured_bubble(events):
    saved = sys.getprofile()
    _switch(None)
    try:
        return pp.bubble(events)
    finally:
        _switch(saved)
""",
    ],
    "tensor_parallel": [
        """
from helpers.parallel import tensor_parallel as _tp

CopyToParallel, ReduceFromParallel = _tp._CopyToParallel, _tp._ReduceFromParallel


def tp_mlp(x, w1_rows, b1_part, w2_cols, b2):
    h = torch.relu(nn.functional.linear(_tp.copy_to_parallel(x), w1_rows, b1_part))
    return _tp.reduce_from_parallel(nn.functional.linear(h, w2_cols)) + b2
""",
        # the course's f's backward under a class of one's own: seen in backward
        tensor_parallel().replace(
            "class ReduceFromParallel(torch.autograd.Function):",
            "from helpers.parallel import tensor_parallel as _tp\n\n\n"
            "class ReduceFromParallel(torch.autograd.Function):",
        )
        + "\n\ndef _course_f_backward(ctx, grad):\n"
        + "    ctx.group = None  # what the course's f keeps from its forward: the world\n"
        + "    return _tp._CopyToParallel.backward(ctx, grad)[0]\n\n\n"
        + "CopyToParallel.backward = staticmethod(_course_f_backward)\n",
    ],
}
for _gid, _more in FINISHED.items():
    WRONG[_gid][1].extend(_more)
# the timing, memory and comparison cells grade nothing: a class is graded without them
UNGRADED = (
    "lab04_report.plot_schedules(",
    "lab04_harness.timed_runs(",
    "lab04_report.plot_timeline(",
    "lab04_harness.activation_peak,",
    "lab04_harness.compare,",
    # the findings printed from the timing cells left out above
    "# What the repeats allow: each measured bubble",
    "# What the repeats allow: step times compared",
)


# Found by a student-like pass written without reading the tests (issue 31): right on the fixed
# cases, wrong on the input space the hidden tests now sweep (cases drawn from the run's seed).
SWEPT = {
    "pipeline_step": [
        # every forward send waited for only at the end: each keeps its output alive all step
        r'''
def pipeline_step(stage, order, inputs, targets, loss_fn, shape):
    """One training step of this rank's ``stage`` following ``order``; returns (loss or None, events)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == p - 1
    m = sum(1 for kind, _ in order if kind == "F")
    kept, pending, events, loss = {}, [], [], 0.0
    for kind, i in order:
        if kind == "F":
            if first:
                x = inputs[i]
            else:
                x = torch.empty(shape)
                dist.recv(x, src=rank - 1)
                x.requires_grad_()
            start = time.perf_counter()
            out = stage(x)
            if last:
                out = loss_fn(out, targets[i]) / m
                loss += out.item()
            events.append({"rank": rank, "op": "F", "micro": i, "start": start, "end": time.perf_counter()})
            if not last:
                pending.append(dist.isend(out.detach(), dst=rank + 1))   # every isend waited for at the end
            kept[i] = (x, out)
        else:
            x, out = kept.pop(i)
            grad = None
            if not last:
                grad = torch.empty_like(out)
                dist.recv(grad, src=rank + 1)
            start = time.perf_counter()
            out.backward(grad)
            events.append({"rank": rank, "op": "B", "micro": i, "start": start, "end": time.perf_counter()})
            if not first:
                pending.append(dist.isend(x.grad, dst=rank - 1))
    for work in pending:
        work.wait()
    return (loss if last else None), events
''',
        # the last stage runs backward inside its forward and records an empty backward later
        r'''
def pipeline_step(stage, order, inputs, targets, loss_fn, shape):
    """One training step of this rank's ``stage`` following ``order``; returns (loss or None, events)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == p - 1
    m = sum(1 for kind, _ in order if kind == "F")
    kept, pending, events, loss = {}, [], [], 0.0
    for kind, i in order:
        if kind == "F":
            if first:
                x = inputs[i]
            else:
                x = torch.empty(shape)
                dist.recv(x, src=rank - 1)
                x.requires_grad_()
            start = time.perf_counter()
            out = stage(x)
            if last:
                out = loss_fn(out, targets[i]) / m
                loss += out.item()
                out.backward()        # the loss is here already: its backward at once frees the graph sooner
            events.append({"rank": rank, "op": "F", "micro": i, "start": start, "end": time.perf_counter()})
            sending = None if last else dist.isend(out.detach(), dst=rank + 1)
            kept[i] = (x, out, sending)
        else:
            x, out, sending = kept.pop(i)
            if sending is not None:
                sending.wait()
            start = time.perf_counter()
            if not last:              # the last stage's backward was done with its forward
                grad = torch.empty_like(out)
                dist.recv(grad, src=rank + 1)
                start = time.perf_counter()
                out.backward(grad)
            events.append({"rank": rank, "op": "B", "micro": i, "start": start, "end": time.perf_counter()})
            if not first:
                pending.append(dist.isend(x.grad, dst=rank - 1))
    for work in pending:
        work.wait()
    return (loss if last else None), events
''',
        # a stage is first, middle or last, never two at once: with one stage, rank 0 reads the
        # data and sends its output on to a rank 1 that does not exist (no hidden case had p = 1)
        r'''
def pipeline_step(stage, order, inputs, targets, loss_fn, shape):
    """One training step of this rank's ``stage`` following ``order``; returns (loss or None, events)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    role = "first" if rank == 0 else "last" if rank == p - 1 else "middle"
    m = sum(1 for kind, _ in order if kind == "F")
    kept, pending, events, loss = {}, [], [], 0.0
    for kind, i in order:
        if kind == "F":
            if role == "first":
                x = inputs[i]
            else:
                x = torch.empty(shape)
                dist.recv(x, src=rank - 1)
                x.requires_grad_()
            start = time.perf_counter()
            out = stage(x)
            if role == "last":
                out = loss_fn(out, targets[i]) / m
                loss += out.item()
            events.append({"rank": rank, "op": "F", "micro": i, "start": start, "end": time.perf_counter()})
            sending = None if role == "last" else dist.isend(out.detach(), dst=rank + 1)
            kept[i] = (x, out, sending)
        else:
            x, out, sending = kept.pop(i)
            if sending is not None:
                sending.wait()
            grad = None
            if role != "last":
                grad = torch.empty_like(out)
                dist.recv(grad, src=rank + 1)
            start = time.perf_counter()
            out.backward(grad)
            events.append({"rank": rank, "op": "B", "micro": i, "start": start, "end": time.perf_counter()})
            if role != "first":
                pending.append(dist.isend(x.grad, dst=rank - 1))
    for work in pending:
        work.wait()
    return (loss if role == "last" else None), events
''',
    ],
    "measured_bubble": [
        # the step's start read from the first event listed, not the earliest
        r'''
def measured_bubble(events):
    """1 − (compute time of all ranks) / (ranks × span of the step), from every rank's events."""
    ranks = {e["rank"] for e in events}
    # the step starts with its first event (rank 0's first forward) and ends with the last to finish
    span = max(e["end"] for e in events) - events[0]["start"]
    return 1 - sum(e["end"] - e["start"] for e in events) / (len(ranks) * span)
''',
    ],
}
for _gid, _more in SWEPT.items():
    WRONG[_gid][1].extend(_more)


def test_every_question_has_wrong_answers_that_differ_from_the_solution():
    lab_grading.assert_wrong_answers_are_wrong(LAB, WRONG, AUTO)


def test_the_right_parts_of_the_wrong_answer_templates_are_the_solution():
    """Each template, given nothing wrong, computes what the solution computes: a wrong answer
    differs from the solution only in what it names."""
    from helpers.parallel import pipeline as pp

    ns: dict = {}
    exec(one_f_one_b(), ns)  # noqa: S102 - our own test source
    for p, m in ((2, 3), (4, 8), (4, 2), (1, 1)):
        for s in range(p):
            assert ns["one_f_one_b_order"](p, m, s) == pp.one_f_one_b(p, m, s)
            assert ns["gpipe_order"](p, m, s) == pp.gpipe(p, m, s)
    src = {cells.grade_id(c): c.source for c in nbformat.read(LAB, as_version=4).cells}

    def strip(text):  # code lines only: no comments, docstrings or markers
        lines = (line.split("  #")[0].strip() for line in text.splitlines())
        return [line for line in lines if line and not line.startswith(("#", '"""'))]

    assert strip(engine()) == strip(src["pipeline_step"])
    assert strip(tensor_parallel()) == [line for line in strip(src["tensor_parallel"])]


def test_the_unfinished_student_version_says_what_to_do():
    lab_grading.assert_student_version_has_stubs(STUDENT, 5)


verdict_run, test_replaying_the_locked_helpers_of_another_seed_scores_nothing = (
    lab_grading.verdict_and_replay(LAB, STUDENT, WRONG, UNGRADED, AUTO)
)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the verdict kernel (the fixture) runs inside the first test
def test_each_plausible_wrong_answer_fails_its_test_cell(verdict_run):
    lab_grading.assert_each_wrong_answer_fails_its_test(verdict_run[1], WRONG)
