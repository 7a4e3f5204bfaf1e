"""Lab 02 end to end: graded like a student's — unfinished, and plausibly wrong.

The wrong answers are the ones a student would write: gradients averaged where DataParallel sums
them, a model "replicated" by sharing it, DDP that never broadcasts or never divides, that all-
reduces after backward or synchronously, buckets in forward order, a parameter without a gradient
handled wrongly; steps counted with a floor, or a table of a plain run's answers; a loss not
divided by k, a forward outside ``no_sync``, every forward before one backward of their sum. And
the blank lab with the locked helpers its tests called redefined to return a reference (issue
41) scores nothing. The grader grades the first wrong answer of every question in two halves, each the
released lab filled in (each wrong in every other question: a wrong answer costs its own points and
only those); every wrong answer is also checked in one kernel against its question's test cell,
hidden parts included, and so is each unfinished cell of the released lab
(lab_grading.wrong_answer_verdicts). The ungraded timing and training cells run with fewer repeats
than the quick profile.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import lab_grading
import nbformat
import pytest

from course.grade import grade
from course.grading import cells
from course.grading.results import Limits, Result
from course.syllabus import REPO, load_syllabus

LAB = REPO / "solutions" / "lab02_build_ddp.ipynb"
STUDENT = REPO / "labs" / "lab02_build_ddp.ipynb"
AUTO = {
    "test_dp_primitives": 3,
    "test_scratch_ddp": 4,
    "test_epoch_bytes": 2,
    "test_accumulation_step": 2,
}
MANUAL = {"answer_bytes", "answer_compression", "answer_dp_slower", "answer_overlap"}

DP_RIGHT = {
    "scatter": 'return [devs.copy(c, 0, i, "scatter") for i, c in enumerate(x.chunk(devs.n))]',
    "replicate": """replicas = [model]
    for i in range(1, devs.n):
        sent = {id(p): nn.Parameter(devs.copy(p, 0, i, "replicate")) for p in model.parameters()}
        replicas.append(copy.deepcopy(model, memo=sent))
    return replicas""",
    "apply": 'return devs.run("forward", [lambda i=i: replicas[i](inputs[i]) for i in range(devs.n)])',
    "gather": 'return torch.cat([devs.copy(o, i, 0, "gather") for i, o in enumerate(outputs)])',
    "reduce": """for i in range(1, devs.n):
        for p, q in zip(model.parameters(), replicas[i].parameters()):
            p.grad += devs.copy(q.grad, i, 0, "reduce grads")""",
}


def dp(**wrong) -> str:
    """The five DataParallel functions, right except those given."""
    body = {**DP_RIGHT, **wrong}
    return f"""
def dp_scatter(x, devs):
    {body["scatter"]}

def dp_replicate(model, devs):
    {body["replicate"]}

def dp_parallel_apply(replicas, inputs, devs):
    {body["apply"]}

def dp_gather(outputs, devs):
    {body["gather"]}

def dp_reduce_gradients(model, replicas, devs):
    {body["reduce"]}
"""


SCRATCH_RIGHT = {
    "broadcast": """for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=0)""",
    "order": "reversed([p for p in module.parameters() if p.requires_grad])",
    "size": "size += p.numel() * p.element_size()",
    "full": "size >= bucket_cap_mb * 2**20",
    "hook": "p.register_post_accumulate_grad_hook(self._ready)",
    "ready": """self.arrived[i] += 1
        if self.arrived[i] == len(self.buckets[i]):
            self._launch(i)""",
    "send": "self.pending[i] = (flat, dist.all_reduce(flat, async_op=True))",
    "missing": "torch.zeros_like(p)",
    "leftover": """for i in range(len(self.buckets)):
            if i not in self.pending:
                self._launch(i)""",
    "average": "flat /= self.world_size",
    "write": """if p.grad is not None:
                    p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))""",
}


def scratch(**wrong) -> str:
    """ScratchDDP, right except the pieces given."""
    b = {**SCRATCH_RIGHT, **wrong}
    return f"""
class ScratchDDP(nn.Module):
    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        {b["broadcast"]}
        self.buckets, current, size = [], [], 0
        for p in {b["order"]}:
            current.append(p)
            {b["size"]}
            if {b["full"]}:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self.bucket_of = {{p: i for i, bucket in enumerate(self.buckets) for p in bucket}}
        self.arrived, self.pending = [0] * len(self.buckets), {{}}
        for p in self.bucket_of:
            {b["hook"]}

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _launch(self, i):
        grads = [p.grad if p.grad is not None else {b["missing"]} for p in self.buckets[i]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        {b["send"]}

    def _ready(self, p):
        i = self.bucket_of[p]
        {b["ready"]}

    def finish(self):
        {b["leftover"]}
        for i, (flat, work) in self.pending.items():
            if work is not None:
                work.wait()
            {b["average"]}
            offset = 0
            for p in self.buckets[i]:
                {b["write"]}
                offset += p.numel()
        self.arrived, self.pending = [0] * len(self.buckets), {{}}
"""


def epoch(steps="math.ceil(n_samples / batch_size)", fwd="n_samples * sample_bytes",
          bwd="4 * steps", ar="4 * n_params * steps") -> str:  # fmt: skip
    return f"""
def epoch_bytes(n_samples, sample_bytes, batch_size, n_params):
    steps = {steps}
    return {{"forward": {fwd}, "backward": {bwd}, "all-reduce": {ar}}}
"""


WRONG = {
    "dp_primitives": (
        "test_dp_primitives",
        [
            # the replicas' gradients averaged, as if each replica's loss were a full mean
            dp(
                reduce=DP_RIGHT["reduce"]
                + "\n    for p in model.parameters():\n        p.grad /= devs.n"
            ),
            dp(reduce="pass"),  # only device 0's gradients
            # one model shared by every "device": gradients land in it twice, no bytes replicated
            dp(replicate="return [model] * devs.n"),
            # every n-th sample instead of contiguous chunks: outputs no longer line up with y
            dp(scatter='return [devs.copy(x[i::devs.n], 0, i, "scatter") for i in range(devs.n)]'),
            dp(gather="return torch.cat(outputs)"),  # not copied to device 0
            dp(apply="return [replicas[i](inputs[i]) for i in range(devs.n)]"),  # one at a time
            # replicas built fresh instead of copied: their own random weights
            dp(
                replicate="return [model] + [copy.deepcopy(model).apply(lambda m: m.reset_parameters() if hasattr(m, 'reset_parameters') else None) for _ in range(1, devs.n)]"
            ),
        ],
    ),
    "scratch_ddp": (
        "test_scratch_ddp",
        [
            scratch(average="pass"),  # summed, never divided
            scratch(broadcast="pass"),  # every rank keeps its own initial weights
            scratch(send="self.pending[i] = (flat, dist.all_reduce(flat))"),  # blocking
            scratch(order="[p for p in module.parameters() if p.requires_grad]"),  # forward order
            # all-reduce everything after backward: no hooks, no overlap
            scratch(hook="pass"),
            scratch(leftover="pass"),  # a bucket holding an unused parameter is never sent
            # a parameter without a gradient gets zeros (DDP leaves it None)
            scratch(write="p.grad = flat[offset : offset + p.numel()].view_as(p).clone()"),
            scratch(order="reversed(list(module.parameters()))"),  # frozen parameters too
            # asynchronous in name only: waited for at once, inside backward
            scratch(
                send="w = dist.all_reduce(flat, async_op=True); w.wait(); self.pending[i] = (flat, w)"
            ),
            # every bucket launched together, when the last gradient has arrived: no overlap
            scratch(
                ready="""self.arrived[i] += 1
        if sum(self.arrived) == len(self.bucket_of):
            for j in range(len(self.buckets)):
                self._launch(j)"""
            ),
        ],
    ),
    "epoch_bytes": (
        "test_epoch_bytes",
        [
            epoch(steps="n_samples // batch_size"),  # the partial last batch forgotten
            epoch(fwd="batch_size * sample_bytes"),  # one batch, not the epoch
            epoch(ar="4 * n_params"),  # once per epoch
            epoch(bwd="4 * n_params * steps"),  # gradients counted as "backward" too
            epoch(steps="n_samples / batch_size"),  # fractional steps, floats
        ],
    ),
    "accumulation_step": (
        "test_accumulation_step",
        [
            """
            def accumulation_step(model, opt, micro_batches):
                opt.zero_grad()
                k = len(micro_batches)
                for j, (x, y) in enumerate(micro_batches):          # the loss not divided by k
                    with model.no_sync() if j < k - 1 else contextlib.nullcontext():
                        loss_fn(model(x), y).backward()
                opt.step()
            """,
            """
            def accumulation_step(model, opt, micro_batches):
                opt.zero_grad()
                k = len(micro_batches)
                for j, (x, y) in enumerate(micro_batches):
                    loss = loss_fn(model(x), y) / k                  # forward outside no_sync
                    with model.no_sync() if j < k - 1 else contextlib.nullcontext():
                        loss.backward()
                opt.step()
            """,
            """
            def accumulation_step(model, opt, micro_batches):
                opt.zero_grad()
                k = len(micro_batches)
                with model.no_sync():                                # never all-reduces
                    for x, y in micro_batches:
                        (loss_fn(model(x), y) / k).backward()
                opt.step()
            """,
            """
            def accumulation_step(model, opt, micro_batches):
                k = len(micro_batches)
                for j, (x, y) in enumerate(micro_batches):
                    opt.zero_grad()                                  # forgets all but the last
                    with model.no_sync() if j < k - 1 else contextlib.nullcontext():
                        (loss_fn(model(x), y) / k).backward()
                opt.step()
            """,
            """
            def accumulation_step(model, opt, micro_batches):        # one big batch: no accumulation
                opt.zero_grad()
                x = torch.cat([x for x, _ in micro_batches])
                y = torch.cat([y for _, y in micro_batches])
                loss_fn(model(x), y).backward()
                opt.step()
            """,
            """
            def accumulation_step(model, opt, micro_batches):
                opt.zero_grad()
                k = len(micro_batches)
                for j, (x, y) in enumerate(micro_batches):          # DDP bypassed, not no_sync
                    net = model.module if j < k - 1 else model
                    (loss_fn(net(x), y) / k).backward()
                opt.step()
            """,
            """
            def accumulation_step(model, opt, micro_batches):
                k = len(micro_batches)
                for j, (x, y) in enumerate(micro_batches):          # a step per micro-batch
                    opt.zero_grad()
                    (loss_fn(model(x), y) / k).backward()
                    opt.step()
            """,
            # every forward first, then one backward of the summed loss: the right update and
            # one all-reduce, but all k graphs (k times the activations) alive at once (issue 41)
            """
            def accumulation_step(model, opt, micro_batches):
                opt.zero_grad()
                k = len(micro_batches)
                loss = sum(loss_fn(model(x), y) for x, y in micro_batches) / k
                loss.backward()
                opt.step()
            """,
        ],
    ),
}


def epoch_table() -> str:
    """epoch_bytes as a table of answers (issue 41): the visible cases, and the hidden cases a
    plain run draws (seed 0), which its feedback or its `In` history showed, each answered
    right; any other case raises KeyError."""
    from helpers.labs import lab02
    from helpers.workloads import models

    steps = lambda n, b: -(-n // b)  # noqa: E731
    here = [
        (719, 64 * 4, b, models.n_params(models.mlp(hidden=64, depth=2))) for b in (32, 128, 512)
    ]
    poster = [(60_000, 784 * 4, b, 5_322) for b in (32, 64, 128)]
    table = {
        (n, size, b, p): {
            "forward": n * size,
            "backward": 4 * steps(n, b),
            "all-reduce": 4 * p * steps(n, b),
        }
        for n, size, b, p in poster + here + lab02.epoch_cases(0)
    }
    return f"""
def epoch_bytes(n_samples, sample_bytes, batch_size, n_params):
    return {table!r}[n_samples, sample_bytes, batch_size, n_params]
"""


WRONG["epoch_bytes"][1].append(epoch_table())

# The ungraded cells (timing, compression) with less work: the graded tests do not read them.
FASTER = {"repeats": 1, "steps": 2, "warmup": 1, "epochs": 1, "seeds": [0]}


# Found by a student-like pass written without reading the tests (issue 31): right on the fixed
# cases, wrong on the input space the hidden tests now sweep (cases drawn from the run's seed).
SWEPT = {
    "dp_primitives": [
        # torch.tensor_split, not chunk: 10 samples on 3 devices as 4, 3, 3 (chunk: 4, 4, 2)
        r'''
def dp_scatter(x, devs):
    """x cut into devs.n chunks along dim 0 (as x.chunk does), chunk i copied to device i."""
    # tensor_split: every device gets a share, sizes differing by at most one sample
    return [devs.copy(chunk, 0, i, "scatter") for i, chunk in enumerate(torch.tensor_split(x, devs.n))]

def dp_replicate(model, devs):
    """[model] + a copy of model on each of devices 1..n-1, its parameters copied from device 0."""
    replicas = [model]
    for i in range(1, devs.n):
        sent = {id(p): nn.Parameter(devs.copy(p, 0, i, "replicate")) for p in model.parameters()}
        replicas.append(copy.deepcopy(model, memo=sent))
    return replicas

def dp_parallel_apply(replicas, inputs, devs):
    """[replicas[i](inputs[i]) on device i for every i], all at once."""
    return devs.run("forward", [lambda i=i: replicas[i](inputs[i]) for i in range(devs.n)])

def dp_gather(outputs, devs):
    """The outputs copied to device 0 and concatenated along dim 0, in device order."""
    return torch.cat([devs.copy(o, i, 0, "gather") for i, o in enumerate(outputs)])

def dp_reduce_gradients(model, replicas, devs):
    """Add every other replica's parameter gradients, copied to device 0, to model's."""
    for i in range(1, devs.n):
        for p, q in zip(model.parameters(), replicas[i].parameters()):
            if q.grad is not None:
                p.grad += devs.copy(q.grad, i, 0, "reduce grads")
''',
    ],
    "scratch_ddp": [
        scratch(full="size >= bucket_cap_mb * 1e6"),  # the cap read as 10^6 bytes, not MiB
        scratch(full="size > bucket_cap_mb * 2**20"),  # closed only above the cap, not at it
        scratch(size="size += 4 * p.numel()"),  # 4 bytes a number whatever the dtype
        scratch(  # launched when its last-listed parameter arrives, not when all have
            ready="""if p is self.buckets[i][-1]:
            self._launch(i)"""
        ),
    ],
}
for _gid, _more in SWEPT.items():
    WRONG[_gid][1].extend(_more)


def test_every_question_has_wrong_answers_that_differ_from_the_solution():
    solution = {cells.grade_id(c): c.source for c in nbformat.read(LAB, as_version=4).cells}
    assert {test for test, _ in WRONG.values()} == set(AUTO)
    for gid, (_, variants) in WRONG.items():
        assert gid in solution and len(variants) >= 4, gid
        assert len({v.strip() for v in variants}) == len(variants), gid
    assert set(lab_grading.wrong_submissions(WRONG)) == {"wrong0a", "wrong0b"}


def test_the_unfinished_student_version_says_what_to_do():
    student = nbformat.read(STUDENT, as_version=4)
    stubs = [c.source for c in student.cells if "NotImplementedError" in c.source]
    assert len(stubs) == 4  # DataParallel, ScratchDDP, epoch_bytes, accumulation_step
    assert sum(s.count("NotImplementedError") for s in stubs) == 5 + 4 + 1 + 1
    assert not any(
        "BEGIN HIDDEN TESTS" in c.source or "BEGIN SOLUTION" in c.source for c in student.cells
    )
    locked = {cells.grade_id(c) for c in student.cells if cells.is_locked(c)}
    assert {"lab02_setup", "dp_step", "ddp_check", "bytes_runs", "accumulation_check"} <= locked
    assert set(AUTO) <= locked


# Cells no graded test reads (timelines, timing runs, the compression sweep, plots), left out of
# the graded copies to keep the suite short; the whole lab is executed by `course run` and
# `course check`, and these cells' own assertions run there.
UNGRADED = ("lab02_report.dp_timeline(", "lab02_harness.against_nn_dataparallel(", "lab02_report.timing(",
            "lab02_report.plot_overlaps(", "lab02_report.bytes_by_phase(", "lab02_report.no_sync_line(",
            "lab02_harness.compression_runs(", "lab02_report.plot_compression(")  # fmt: skip


verdict_run, test_replaying_the_locked_helpers_of_another_seed_scores_nothing = (
    lab_grading.verdict_and_replay(LAB, STUDENT, WRONG, UNGRADED, AUTO, FASTER)
)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the verdict kernel (the fixture) runs inside the first test
def test_each_plausible_wrong_answer_fails_its_test_cell(verdict_run):
    verdicts = verdict_run[1]
    lab_grading.assert_each_wrong_answer_fails_its_test(verdicts, WRONG)
    gid = next(g for g, (test, _) in WRONG.items() if test == "test_scratch_ddp")
    assert "NotImplementedError" in verdicts[gid, "stub"]  # what the feedback shows


# Issue 41: the blank lab with, right after each of three locked cells, a cell of the student's
# that redefines the helper its test called to return what the specification says a reference
# should be: the expected-bytes formula, reference_buckets, torch DDP's own parameters passed off
# as the scratch ones. Before the checks computed their references, a test compared two values
# these helpers chose in the kernel, and this scored 9 of 11 without a line of the work.
FORGED = {
    "dp_step": """
        def dp_versus_one_device(n, size, make=make_model, step=0):
            x, y = global_batch(step, size)
            model = make()
            P = sum(p.numel() * p.element_size() for p in model.parameters())
            others = lambda t: sum(c.numel() * c.element_size() for c in t.chunk(n)[1:])
            out = model(x)
            expected = {"scatter": others(x), "replicate": (n - 1) * P, "gather": others(out),
                        "scatter grad": others(out), "reduce grads": (n - 1) * P}
            expected = {k: v for k, v in expected.items() if v}
            return {"loss": 0.0, "grads": 0.0, "forward on": [f"device {i}" for i in range(n)],
                    "bytes": expected, "expected bytes": expected}
    """,
    "ddp_check": """
        def scratch_versus_torch(name, steps=3, batch=16, cap_mb=0.02):
            rank, n = dist.get_rank(), dist.get_world_size()
            torch.manual_seed(100 + rank)
            module = test_models[name]()
            model = DDP(module, bucket_cap_mb=cap_mb, find_unused_parameters=name == "awkward")
            buffers = [b.clone() for b in module.buffers()]
            opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
            for k in range(steps):
                x, y = global_batch(k, batch * n)
                x = x.to(next(module.parameters()).dtype)
                opt.zero_grad()
                loss_fn(model(x.chunk(n)[rank]), y.chunk(n)[rank]).backward()
                opt.step()
            params = [p.detach().clone() for p in module.parameters()]
            none = [p.grad is None for p in module.parameters()]
            buckets = reference_buckets(test_models[name](), cap_mb)
            return {"torch": params, "scratch": params, "torch grad is None": none,
                    "scratch grad is None": none, "buffers after construction": buffers,
                    "scratch calls": [[(b, True, True, True, True) for b in buckets]] * steps,
                    "expected buckets": buckets}
    """,
    "accumulation_check": """
        def accumulation_versus_one_process(k, micro, steps=2):
            return {"difference": 0.0, "all-reduced per step": [35880] * steps,
                    "gradient bytes": 35880, "steps": steps, "forwards": [[micro] * k] * steps}
    """,
}


def forged_submission(student: Path, path: Path) -> None:
    """The blank ``student`` lab with each FORGED cell right after its locked cell."""
    nb = nbformat.read(student, as_version=4)
    out = []
    for cell in nb.cells:
        out.append(cell)
        if cells.grade_id(cell) in FORGED:
            source = textwrap.dedent(FORGED[cells.grade_id(cell)]).strip()
            out.append(nbformat.v4.new_code_cell(source))
    assert len(out) == len(nb.cells) + len(FORGED), "every locked cell named is found"
    nb.cells = out
    nbformat.write(nb, path)


def grade_forged(lab: Path, student: Path, tmp: Path) -> Result:
    """``forged_submission`` of ``student`` graded against ``lab`` by the grader (quick profile,
    without the ungraded cells)."""
    for folder in ("lab", "student", "subs"):
        (tmp / folder).mkdir()
    lab = lab_grading.trimmed(lab, tmp / "lab", UNGRADED)
    forged_submission(
        lab_grading.trimmed(student, tmp / "student", UNGRADED), tmp / "subs" / "forged.ipynb"
    )
    quick = next(e for e in load_syllabus() if e.path == LAB).parameters("quick")
    results = grade(
        lab,
        tmp / "subs",
        tmp / "out",
        parameters={**quick, **FASTER},
        progress=False,
        limits=Limits(cell_timeout=120, budget=400),
    )
    return results["forged"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_helpers_redefined_to_return_a_reference_score_nothing(tmp_path):
    result = grade_forged(LAB, STUDENT, tmp_path)
    assert result.status == "graded", result.reason
    assert {test: result.scores[test] for test in AUTO} == dict.fromkeys(AUTO, 0.0), result.scores


def test_the_table_of_answers_is_right_on_a_plain_runs_cases_only():
    from helpers.labs import lab02

    namespace = {}
    exec(epoch_table(), namespace)
    for n, size, batch, n_params in lab02.epoch_cases(0):
        steps = -(-n // batch)
        assert (
            namespace["epoch_bytes"](n, size, batch, n_params)["all-reduce"] == 4 * n_params * steps
        )
    with pytest.raises(KeyError):  # a grading run draws other cases
        [namespace["epoch_bytes"](*case) for case in lab02.epoch_cases(lab_grading.VERDICT_SEED)]
