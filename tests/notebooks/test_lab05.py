"""Lab 05 end to end: graded like a student's — unfinished, and plausibly wrong.

The wrong answers are the ones a student would write: a plan that forgets the ranks, rounds the
micro-batch down so the batch no longer adds up, always uses the largest micro-batch, takes the
most micro-batches, or quietly floors a batch the ranks cannot share (or refuses only those a
plain run's feedback showed); the square-root rule, the rule upside down, or in whole multiples of
the base batch only; a warmup from zero, one step early, that never stops rising, that divides by
zero without warmup, or that never passes the peak (so never falls to a peak below the base
rate); a LARS without the trust ratio, with it on the biases too, with one norm for the whole
model, per row, squared, without the weight decay in its denominator, on the momentum instead of
the step, without the trust coefficient, dividing by a zero gradient norm, or reading its
hyperparameters from the defaults instead of each group. The sweeps, the timing and the plots
grade nothing and are left out. The grader grades the first wrong answer of every question in two
halves, each the released lab filled in (each wrong in every other question: a wrong answer costs
its own points and only those); every wrong answer is also checked in one kernel against its
question's test cell, hidden parts included, and so is each unfinished cell of the released lab
(lab_grading.wrong_answer_verdicts).
"""

from __future__ import annotations

import lab_grading
import nbformat
import pytest

from course.grading import cells
from course.syllabus import REPO

LAB = REPO / "solutions" / "lab05_large_batch.ipynb"
STUDENT = REPO / "labs" / "lab05_large_batch.ipynb"
AUTO = {"test_plan": 1, "test_schedules": 2, "test_lars": 4}
MANUAL = {"answer_generalisation", "answer_seed", "answer_results"}


def plan(body: str) -> str:
    return f"""import math
def plan(global_batch, world_size, max_micro):
{body}
"""


PLAN_CHECK = """    if global_batch % world_size:
        raise ValueError("not a multiple of the world size")
    per_rank = global_batch // world_size
"""

SCALED_RIGHT = "return base_lr * batch / base_batch"
WARMUP_RIGHT = """if step >= warmup_steps:
        return peak_lr
    return base_lr + (peak_lr - base_lr) * step / warmup_steps"""


def schedules(scaled: str = SCALED_RIGHT, warmup: str = WARMUP_RIGHT) -> str:
    return f"""
def scaled_lr(base_lr, base_batch, batch):
    {scaled}

def lr_at(step, base_lr, peak_lr, warmup_steps):
    {warmup}
"""


LARS_RIGHT = {
    "hyper": 'lr, mom, wd, trust = group["lr"], group["momentum"], group["weight_decay"], group["trust"]',
    "adapted": "p.ndim > 1",
    "norms": "w_norm, g_norm = p.norm(), d.norm()",
    "ratio": "trust * w_norm / (g_norm + wd * w_norm) if w_norm > 0 and g_norm > 0 else 1.0",
    "step": "d = ratio * (d + wd * p)",
    "velocity": 'v = self.state[p].setdefault("momentum", torch.zeros_like(p))',
    "update": """v.mul_(mom).add_(d)
                p.sub_(lr * v)""",
}


def lars(**wrong) -> str:
    """The LARS class, right except the parts given."""
    body = {**LARS_RIGHT, **wrong}
    return f"""
class LARS(torch.optim.Optimizer):
    def __init__(self, params, lr, momentum=0.9, weight_decay=0.0, trust=0.02):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust=trust))

    @torch.no_grad()
    def step(self):
        every = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        all_w = torch.sqrt(sum((p * p).sum() for p in every))
        all_g = torch.sqrt(sum((p.grad * p.grad).sum() for p in every))
        for group in self.param_groups:
            {body["hyper"]}
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = p.grad
                ratio = 1.0
                if {body["adapted"]}:
                    {body["norms"]}
                    ratio = {body["ratio"]}
                    {body["step"]}
                {body["velocity"]}
                {body["update"]}
"""


WRONG = {
    "plan": (
        "test_plan",
        [
            plan(  # the ranks forgotten: the whole global batch on every rank
                """    k = math.ceil(global_batch / max_micro)
    while global_batch % k:
        k += 1
    return global_batch // k, k"""
            ),
            plan(  # rounded down: 14 on 2 ranks of at most 4 becomes 2 x 2 x 3 = 12
                PLAN_CHECK
                + """    k = math.ceil(per_rank / max_micro)
    return per_rank // k, k"""
            ),
            plan(  # the largest micro-batch always, whether or not it divides the batch
                PLAN_CHECK + "    return max_micro, per_rank // max_micro"
            ),
            plan(  # the most micro-batches, not the fewest: one sample each
                PLAN_CHECK + "    return 1, per_rank"
            ),
            plan(  # a batch the ranks cannot share, quietly floored
                """    per_rank = global_batch // world_size
    k = next(k for k in range(1, per_rank + 1) if per_rank % k == 0 and per_rank // k <= max_micro)
    return per_rank // k, k"""
            ),
            plan(  # refuses only when the test's helper is the caller (found by a red-team pass)
                """    import sys
    if sys._getframe(1).f_code.co_name == "refused":
        raise ValueError("refused")
    per_rank = global_batch // world_size
    k = next(k for k in range(1, per_rank + 1) if per_rank % k == 0 and per_rank // k <= max_micro)
    return per_rank // k, k"""
            ),
            plan(  # floors, and empties the probe's record of refusals after the cell runs
                """    per_rank = global_batch // world_size
    k = next(k for k in range(1, per_rank + 1) if per_rank % k == 0 and per_rank // k <= max_micro)
    return per_rank // k, k

def _forget(result=None):
    ns = get_ipython().user_ns
    if isinstance(ns.get("refusals"), dict):
        ns["refusals"] = {}
get_ipython().events.register("post_run_cell", _forget)"""
            ),
        ],
    ),
    "schedules": (
        "test_schedules",
        [
            schedules(scaled="return base_lr * (batch / base_batch) ** 0.5"),  # square-root rule
            schedules(scaled="return base_lr * base_batch / batch"),  # upside down
            schedules(  # warmup from zero (the ramp of other papers, not this spec)
                warmup="""if step >= warmup_steps:
        return peak_lr
    return peak_lr * step / warmup_steps"""
            ),
            schedules(  # one step early: the peak at step warmup_steps - 1
                warmup="""if step >= warmup_steps:
        return peak_lr
    return base_lr + (peak_lr - base_lr) * (step + 1) / warmup_steps"""
            ),
            schedules(  # never stops rising
                warmup="return base_lr + (peak_lr - base_lr) * step / warmup_steps"
            ),
            schedules(  # no warmup divides by zero
                warmup="return base_lr + (peak_lr - base_lr) * min(step / warmup_steps, 1)"
            ),
        ],
    ),
    "lars": (
        "test_lars",
        [
            lars(step="d = d + wd * p"),  # no trust ratio: momentum SGD
            lars(adapted="True"),  # the trust ratio on the biases too
            lars(norms="w_norm, g_norm = all_w, all_g"),  # one norm for the whole model
            lars(
                norms="w_norm, g_norm = p.norm(dim=-1, keepdim=True), d.norm(dim=-1, keepdim=True)",
                ratio="torch.where((w_norm > 0) & (g_norm > 0), trust * w_norm / (g_norm + wd * w_norm), 1.0)",
            ),  # per row
            lars(
                ratio="trust * w_norm**2 / (g_norm**2 + wd * w_norm**2) if w_norm > 0 and g_norm > 0 else 1.0"
            ),  # squared
            lars(
                ratio="trust * w_norm / g_norm if w_norm > 0 and g_norm > 0 else 1.0"
            ),  # decay left out of the ratio
            lars(  # the ratio on the momentum, not on the step
                step="d = d + wd * p",
                update="""v.mul_(mom).add_(d)
                p.sub_(lr * ratio * v)""",
            ),
            lars(
                ratio="w_norm / (g_norm + wd * w_norm) if w_norm > 0 and g_norm > 0 else 1.0"
            ),  # no trust coefficient
            lars(
                ratio="trust * w_norm / (g_norm + wd * w_norm)"
            ),  # divides by a zero gradient norm
            lars(  # the defaults for every group
                hyper='lr, mom, wd, trust = self.defaults["lr"], self.defaults["momentum"], self.defaults["weight_decay"], self.defaults["trust"]'
            ),
            lars(  # momentum and weight decay from the defaults, lr and trust per group
                hyper='lr, mom, wd, trust = group["lr"], self.defaults["momentum"], self.defaults["weight_decay"], group["trust"]'
            ),
            lars(adapted="p.ndim == 2"),  # matrices only: a conv kernel treated as a bias
            lars(  # guarded on the weight's norm only: a zero gradient with decay gets trust / wd
                ratio="trust * w_norm / (g_norm + wd * w_norm) if w_norm > 0 else 1.0"
            ),
        ],
    ),
}
# the sweeps, the timing and the plots grade nothing: a class is graded without them
UNGRADED = (
    "lab05_runs.first_steps(",
    "lab05_runs.micro_timings(",
    "fixed = lab05_runs.sweep(",
    "lab05_report.plot_losses(",
    "scaled = lab05_runs.sweep(",
    "lars = lab05_runs.sweep(",
    "ax = helpers.plots.batch_accuracy(results)",
    # the findings printed from the runs left out above
    "lab05_report.timing_findings(",
    "lab05_report.batch_findings(",
    "lab05_report.schedule_findings(",
    "lab05_report.lars_findings(",
)


# Found by a student-like pass written without reading the tests (issue 31): right on the fixed
# cases, wrong on the input space the hidden tests now sweep (cases drawn from the run's seed).
SWEPT = {
    "plan": [
        # k searched over powers of two only: plan(600, 2, 128) gives (75, 4), not (100, 3)
        r'''
def plan(global_batch, world_size, max_micro):
    """(micro, k): k micro-batches of micro samples per rank make the global batch; the fewest k."""
    if global_batch % world_size:
        raise ValueError(f"a global batch of {global_batch} does not split evenly over "
                         f"{world_size} ranks: choose a multiple of {world_size}")
    per_rank = global_batch // world_size
    k = 1
    while k < per_rank and (per_rank % k or per_rank // k > max_micro):
        k *= 2                                    # halve the micro-batch until it fits
    if per_rank % k or per_rank // k > max_micro:
        k = per_rank                              # no halving divides it: one sample at a time
    return per_rank // k, k
''',
        plan(  # a table of the refusals a plain run's feedback shows: every other batch floored
            """    if (global_batch, world_size) in {(100, 3), (9, 2)}:
        raise ValueError("a batch the ranks cannot share")
    per_rank = global_batch // world_size
    k = next(k for k in range(1, per_rank + 1) if per_rank % k == 0 and per_rank // k <= max_micro)
    return per_rank // k, k"""
        ),
    ],
    "schedules": [
        schedules(  # whole multiples only: right while the batch is a multiple or divisor of the base
            scaled="""if batch >= base_batch:
        return base_lr * (batch // base_batch)
    return base_lr / (base_batch // batch)"""
        ),
        schedules(  # never past the peak: a peak below the base rate is reached at once
            warmup="""if step >= warmup_steps:
        return peak_lr
    return min(peak_lr, base_lr + (peak_lr - base_lr) * step / warmup_steps)"""
        ),
    ],
    "lars": [
        lars(  # the first velocity is the gradient tensor itself: rewritten when .grad is filled in place
            velocity="""first = "momentum" not in self.state[p]
                v = self.state[p].setdefault("momentum", d)""",
            update="""if not first:
                    v.mul_(mom).add_(d)
                p.sub_(lr * v)""",
        ),
        # the velocity in float32 on the CPU whatever the parameter: float64 weights drift
        lars(velocity='v = self.state[p].setdefault("momentum", torch.zeros(p.shape))'),
    ],
}
for _gid, _more in SWEPT.items():
    WRONG[_gid][1].extend(_more)


def test_every_question_has_wrong_answers_that_differ_from_the_solution():
    lab_grading.assert_wrong_answers_are_wrong(LAB, WRONG, AUTO)


def test_the_right_parts_of_the_wrong_answer_templates_are_right():
    """Each template, given nothing wrong, computes what the solution computes: a wrong answer
    differs from a right one only in what it names."""
    import torch

    src = {cells.grade_id(c): c.source for c in nbformat.read(LAB, as_version=4).cells}
    ours, theirs = {"torch": torch}, {"torch": torch}
    exec(
        plan(
            PLAN_CHECK
            + "    return next((per_rank // k, k) for k in range(1, per_rank + 1) if per_rank % k == 0 and per_rank // k <= max_micro)"
        )
        + schedules()
        + lars(),
        ours,
    )  # noqa: S102
    for gid in ("plan", "schedules", "lars"):
        exec(src[gid], theirs)  # noqa: S102 - the committed solution
    for args in [(2048, 2, 256), (96, 2, 32), (14, 2, 4), (4096, 2, 300)]:
        assert ours["plan"](*args) == theirs["plan"](*args)
    for s in range(12):
        assert ours["lr_at"](s, 0.05, 0.8, 10) == theirs["lr_at"](s, 0.05, 0.8, 10)
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [
        ns["LARS"](m.parameters(), lr=0.3, weight_decay=0.01, trust=0.1)
        for ns, m in zip((ours, theirs), models, strict=True)
    ]
    for _ in range(3):
        x = torch.randn(8, 5)
        for m, opt in zip(models, opts, strict=True):
            opt.zero_grad()
            m(x).pow(2).sum().backward()
            opt.step()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_the_unfinished_student_version_says_what_to_do():
    lab_grading.assert_student_version_has_stubs(STUDENT, 3)


verdict_run, test_replaying_the_locked_helpers_of_another_seed_scores_nothing = (
    lab_grading.verdict_and_replay(LAB, STUDENT, WRONG, UNGRADED, AUTO)
)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the verdict kernel (the fixture) runs inside the first test
def test_each_plausible_wrong_answer_fails_its_test_cell(verdict_run):
    lab_grading.assert_each_wrong_answer_fails_its_test(verdict_run[1], WRONG)
