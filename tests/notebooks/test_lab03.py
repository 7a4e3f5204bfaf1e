"""Lab 03 end to end: graded like a student's — unfinished, and plausibly wrong.

The wrong answers are the ones a student would write: the largest batch from one point's bytes per
sample (the fixed part forgotten), rounded or off by one at the boundary, negative or truncated, a
float, a slope floored, a line fitted in float32 tensors; PSNR with 20·log10, a natural log, a sum,
the range not squared, read from the target or guessed, uint8 differences that wrap, int16 squares
that overflow, a tensor, no ``inf``; a ZeRO-1 with floored shards, or one number more than the
floor, without the all-gather, broadcasting rank 0's view, an unsharded optimizer, a state that is
re-created every step, gradients summed again, strided shards read back in order, ``zero_grad``
forgotten, a float64 buffer for every dtype; bytes per rank with Adam's state counted once,
unpadded or floored shards, a number of padding always added, the gradients sharded at stage 1, the
parameters never sharded, SGD given a state, mixed precision's bytes in fp32, stage 2 and 3
swapped; on the live world (%%ranks), what each rank of PyTorch's ZeRO-1 holds answered with DDP's
whole Adam, the total split without its remainder, ZeroOne's flat shard, flat halves, the
parameters, the parameters owned, rank 0 alone, the step counters counted, the all-reduced total,
and a typed table of a plain run's bytes (seed 0's model: another seed's is another).
The grader grades the first wrong answer of every question in two halves, each the released lab
filled in (each wrong in every other question: a wrong answer costs its own points and only
those); every wrong answer is also checked in one kernel against its question's test cell,
hidden parts included, and so is each unfinished cell of the released lab
(lab_grading.wrong_answer_verdicts). The ungraded timing, fitting and plot cells are left out.
"""

from __future__ import annotations

import lab_grading
import nbformat
import pytest

from course.grading import cells
from course.syllabus import REPO

LAB = REPO / "solutions" / "lab03_memory.ipynb"
STUDENT = REPO / "labs" / "lab03_memory.ipynb"
AUTO = {
    "test_largest_batch_from": 2,
    "test_psnr": 2,
    "test_zero_one": 4,
    "test_per_rank_bytes": 2,
    "test_zero_held": 1,
}
MANUAL = {"answer_batch_time", "answer_two_devices", "answer_zero_cost"}

LINE = """(b0, p0), (b1, p1) = min(peaks.items()), max(peaks.items())
    per_sample = (p1 - p0) / (b1 - b0)
    fixed = p0 - per_sample * b0"""


def largest(body: str) -> str:
    return f"def largest_batch_from(peaks, budget):\n    {body}\n"


def psnr(body: str) -> str:
    return f"def psnr(prediction, target, data_range=1.0):\n    {body}\n"


MSE = "mse = torch.mean((prediction.double() - target.double()) ** 2).item()"

ZERO_RIGHT = {
    "size": "math.ceil(self.numel / self.n)",
    "shard": "flat[start:start + self.shard_size].clone().requires_grad_(True)",
    "optimizer": "optimizer_class([self.shard], **kwargs)",
    "zero_grad": """for p in self.params:
            p.grad = None""",
    "grads": """grads = self._flat([p.grad for p in self.params])
        self.shard.grad = grads[start:start + self.shard_size].clone()""",
    "inner": "self.optimizer.step()",
    "gather": """full = torch.empty(self.n * self.shard_size, dtype=self.shard.dtype)
        dist.all_gather_into_tensor(full, self.shard.detach())""",
}


def zero(**wrong) -> str:
    """ZeroOne, right except the parts given."""
    body = {**ZERO_RIGHT, **wrong}
    return f"""
class ZeroOne:
    def __init__(self, params, optimizer_class, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.rank, self.n = dist.get_rank(), dist.get_world_size()
        self.numel = sum(p.numel() for p in self.params)
        self.shard_size = {body["size"]}
        self.optimizer_class, self.kwargs = optimizer_class, kwargs
        start = self.rank * self.shard_size
        flat = self._flat([p.detach() for p in self.params])
        self.shard = {body["shard"]}
        self.optimizer = {body["optimizer"]}

    def _flat(self, tensors):
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return nn.functional.pad(flat, (0, self.n * self.shard_size - self.numel))

    def zero_grad(self):
        {body["zero_grad"]}

    def step(self):
        start = self.rank * self.shard_size
        {body["grads"]}
        {body["inner"]}
        {body["gather"]}
        with torch.no_grad():
            for p, new in zip(self.params, full[:self.numel].split([p.numel() for p in self.params])):
                p.copy_(new.view_as(p))
"""


BYTES_RIGHT = {
    "shard": "math.ceil(n_params / world_size)",
    "moments": '{"sgd": 0, "momentum": 1, "adam": 2}',
    "parameters": "4 * (shard if stage >= 3 else n_params)",
    "gradients": "4 * (shard if stage >= 2 else n_params)",
    "state": "4 * moments * (shard if stage >= 1 else n_params)",
}


def per_rank(**wrong) -> str:
    body = {**BYTES_RIGHT, **wrong}
    return f"""
def per_rank_bytes(n_params, world_size, stage, optimizer="adam"):
    shard = {body["shard"]}
    moments = {body["moments"]}[optimizer]
    out = {{"parameters": {body["parameters"]}, "gradients": {body["gradients"]},
           "optimizer_state": {body["state"]}}}
    out["total"] = sum(out.values())
    return out
"""


WRONG = {
    "largest_batch_from": (
        "test_largest_batch_from",
        [
            largest("b, p = max(peaks.items())\n    return int(budget / (p / b))"),
            largest(LINE + "\n    return max(0, math.ceil((budget - fixed) / per_sample) - 1)"),
            largest(LINE + "\n    return max(0, round((budget - fixed) / per_sample))"),
            largest(LINE + "\n    return math.floor((budget - fixed) / per_sample)"),
            largest(LINE + "\n    return int(budget // per_sample)"),
            largest(LINE + "\n    return max(0, (budget - fixed) // per_sample)"),
            largest(LINE + "\n    return max(0, math.floor((budget - p0) / per_sample))"),
            largest(LINE + "\n    return int((budget - fixed) / per_sample)"),
            largest(
                LINE.replace("(p1 - p0) / (b1 - b0)", "(p1 - p0) // (b1 - b0)")
                + "\n    return max(0, math.floor((budget - fixed) / per_sample))"
            ),
        ],
    ),
    "psnr": (
        "test_psnr",
        [
            psnr(MSE + "\n    return math.inf if mse == 0 else 20 * math.log10(data_range / mse)"),
            psnr(MSE + "\n    return math.inf if mse == 0 else 10 * math.log(data_range**2 / mse)"),
            psnr(
                "mse = torch.sum((prediction.double() - target.double()) ** 2).item()\n"
                "    return math.inf if mse == 0 else 10 * math.log10(data_range**2 / mse)"
            ),
            psnr(MSE + "\n    return math.inf if mse == 0 else 10 * math.log10(data_range / mse)"),
            psnr(
                MSE
                + "\n    return math.inf if mse == 0 else 10 * math.log10(target.max().item() ** 2 / mse)"
            ),
            psnr(
                "mse = ((prediction - target) ** 2).double().mean().item()\n"
                "    return math.inf if mse == 0 else 10 * math.log10(data_range**2 / mse)"
            ),
            psnr(
                "mse = torch.mean((prediction.double() - target.double()) ** 2)\n"
                "    return 10 * torch.log10(data_range**2 / mse)"
            ),
            psnr(MSE + "\n    return 10 * math.log10(data_range**2 / mse)"),
            psnr(
                "d = prediction.to(torch.int16) - target.to(torch.int16)\n"
                "    mse = (d**2).double().mean().item()\n"
                "    return math.inf if mse == 0 else 10 * math.log10(data_range**2 / mse)"
            ),
            psnr(
                "r = 255.0 if target.max() > 1 else 1.0\n    " + MSE + "\n"
                "    return math.inf if mse == 0 else 10 * math.log10(r**2 / mse)"
            ),
        ],
    ),
    "zero_one": (
        "test_zero_one",
        [
            zero(size="self.numel // self.n"),
            zero(
                gather="""full = self._flat([p.detach() for p in self.params])
        full[start:start + self.shard_size] = self.shard.detach()"""
            ),
            zero(
                gather="""full = self._flat([p.detach() for p in self.params])
        full[start:start + self.shard_size] = self.shard.detach()
        dist.broadcast(full, src=0)"""
            ),
            zero(
                optimizer="optimizer_class(self.params, **kwargs)",
                inner="self.optimizer.step()\n        return",
            ),
            zero(
                inner="""self.optimizer = self.optimizer_class([self.shard], **self.kwargs)
        self.optimizer.step()"""
            ),
            zero(
                grads="""grads = self._flat([p.grad for p in self.params])
        dist.all_reduce(grads)
        self.shard.grad = grads[start:start + self.shard_size].clone()"""
            ),
            zero(
                shard="flat[self.rank::self.n].clone().requires_grad_(True)",
                grads="""grads = self._flat([p.grad for p in self.params])
        self.shard.grad = grads[self.rank::self.n].clone()""",
            ),
            zero(zero_grad="pass"),
            zero(
                gather="""full = torch.empty(self.n * self.shard_size, dtype=torch.float64)
        dist.all_gather_into_tensor(full, self.shard.detach())"""
            ),
        ],
    ),
    "per_rank_bytes": (
        "test_per_rank_bytes",
        [
            per_rank(moments='{"sgd": 0, "momentum": 1, "adam": 1}'),
            per_rank(shard="n_params / world_size"),
            per_rank(shard="n_params // world_size"),
            per_rank(gradients="4 * (shard if stage >= 1 else n_params)"),
            per_rank(parameters="4 * n_params"),
            per_rank(moments='{"sgd": 1, "momentum": 1, "adam": 2}'),
            per_rank(
                parameters="2 * (shard if stage >= 3 else n_params)",
                gradients="2 * (shard if stage >= 2 else n_params)",
                state="(4 + 4 * moments) * (shard if stage >= 1 else n_params)",
            ),
            per_rank(
                parameters="4 * (shard if stage >= 2 else n_params)",
                gradients="4 * (shard if stage >= 3 else n_params)",
            ),
        ],
    ),
}


def world(
    body: str,
    measure: str = "state_bytes = helpers.memory.nbytes(helpers.memory.optimizer_tensors(opt.optim))",
) -> str:
    """The live world's %%ranks cell: one ZeroRedundancyOptimizer step, then ``measure``."""
    return f"""%%ranks
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)
model = DDP(helpers.models.coordinate_mlp(26, *zero_model))
{body}
x, y = torch.randn(8, 26), torch.rand(8, 3)
((model(x) - y) ** 2).mean().backward()
opt.step()
P = sum(p.numel() for p in model.parameters())
{measure}
"""


ZERO_OPT = (
    "opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)"
)
WRONG["zero_world"] = (
    "test_zero_held",
    [
        # the unsharded total: DDP's whole Adam on every rank
        world(
            "opt = torch.optim.Adam(model.parameters(), lr=1e-3)",
            "state_bytes = helpers.memory.nbytes(helpers.memory.optimizer_tensors(opt))",
        ),
        # the total over the ranks, without the remainder
        world(ZERO_OPT, "state_bytes = 8 * (P // world_size)"),
        # the flat shard of ZeroOne, s = ceil(P / n): not how PyTorch's ZeRO-1 deals tensors
        world(ZERO_OPT, "import math\nstate_bytes = 8 * math.ceil(P / world_size)"),
        # flat halves, the remainder on the last rank: the right sum, the wrong ranks
        world(
            ZERO_OPT,
            "state_bytes = 8 * (P // world_size + (rank == world_size - 1) * (P % world_size))",
        ),
        # the parameters instead of the optimizer state
        world(ZERO_OPT, "state_bytes = helpers.memory.nbytes(list(model.parameters()))"),
        # the parameters this rank's optimizer owns, not their two moments
        world(
            ZERO_OPT,
            'state_bytes = 4 * sum(p.numel() for g in opt.optim.param_groups for p in g["params"])',
        ),
        # measured on rank 0 only: the other rank has no answer
        world(
            ZERO_OPT,
            "if rank == 0:\n"
            "    state_bytes = helpers.memory.nbytes(helpers.memory.optimizer_tensors(opt.optim))",
        ),
        # the 0-d step counters counted too
        world(
            ZERO_OPT,
            "state_bytes = sum(t.numel() * t.element_size() for s in opt.optim.state.values()"
            " for t in s.values())",
        ),
        # the total of every rank, all-reduced, on each
        world(
            ZERO_OPT,
            "t = torch.tensor(helpers.memory.nbytes(helpers.memory.optimizer_tensors(opt.optim)))\n"
            "dist.all_reduce(t)\nstate_bytes = int(t)",
        ),
        # a table of a plain run: seed 0's model's bytes, typed
        world(ZERO_OPT, "state_bytes = [50176, 39896][rank]"),
    ],
)

# the timing, fitting and plotting cells grade nothing: a class is graded without them
UNGRADED = (
    "lab03_runs.epoch_times",
    "lab03_report.epoch_findings(",
    "lab03_runs.fit_image",
    "lab03_report.heatmaps(",
    "lab03_report.show_images(",
    "lab03_report.by_part(",
    "lab03_report.two_devices(",
    "measured = {0: ",
)


# Found by a student-like pass written without reading the tests (issue 31): right on the fixed
# cases, wrong on the input space the hidden tests now sweep (cases drawn from the run's seed).
SWEPT = {
    "largest_batch_from": [
        # the line fitted with torch tensors: true division of integer tensors gives float32,
        # exact at a laptop's megabytes, thousands of bytes off at a GPU's (issue 41)
        r'''
def largest_batch_from(peaks, budget):
    """The largest batch whose peak is at most ``budget`` bytes, from measured peaks {batch: bytes}
    that grow as a line (fixed + per_sample × batch). An int; 0 if not even one sample fits."""
    b = torch.tensor(sorted(peaks))
    p = torch.tensor([peaks[k] for k in sorted(peaks)])
    per_sample = (p[-1] - p[0]) / (b[-1] - b[0])
    fixed = p[0] - per_sample * b[0]
    return max(0, int((budget - fixed) // per_sample))
''',
    ],
    "per_rank_bytes": [
        # one number of padding whenever sharded: wrong only where P divides by n (issue 41)
        r'''
def per_rank_bytes(n_params, world_size, stage, optimizer="adam"):
    """Bytes of parameters, gradients and optimizer state one rank keeps (fp32), with their total."""
    # one rank keeps everything; on n ranks a shard is P // n numbers, and one of padding
    shard = n_params if world_size == 1 else n_params // world_size + 1
    moments = {"sgd": 0, "momentum": 1, "adam": 2}[optimizer]
    out = {"parameters": 4 * (shard if stage >= 3 else n_params),
           "gradients": 4 * (shard if stage >= 2 else n_params),
           "optimizer_state": 4 * moments * (shard if stage >= 1 else n_params)}
    out["total"] = sum(out.values())
    return out
''',
    ],
    "psnr": [
        # the MSE in float32: near-identical float64 images give inf
        r'''
def psnr(prediction, target, data_range=1.0):
    """Peak signal-to-noise ratio in dB of ``prediction`` against ``target`` (tensors of one shape)."""
    # float first: 8-bit differences can be negative and their squares large
    mse = torch.mean((prediction.float() - target.float()) ** 2).item()
    return math.inf if mse == 0 else 10 * math.log10(data_range**2 / mse)
''',
        # 255 for every integer tensor, whatever data_range it is given
        r'''
def psnr(prediction, target, data_range=1.0):
    """Peak signal-to-noise ratio in dB of ``prediction`` against ``target`` (tensors of one shape)."""
    if not prediction.is_floating_point():        # an 8-bit image: its values range over 0..255
        data_range = 255
    mse = torch.mean((prediction.double() - target.double()) ** 2).item()
    return math.inf if mse == 0 else 10 * math.log10(data_range**2 / mse)
''',
    ],
    "zero_one": [
        # one number more than the floor, to hold the remainder: a shard too many where P
        # divides by n, which 1925 parameters on 2, 3 and 4 ranks never did (issue 41)
        zero(size="self.numel // self.n + 1"),
        # one zero of padding: a short last shard when P % n is neither 0 nor n - 1
        r'''
class ZeroOne:
    """ZeRO stage 1: this rank keeps optimizer state only for its shard of the flattened parameters."""

    def __init__(self, params, optimizer_class, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.rank, self.n = dist.get_rank(), dist.get_world_size()
        self.numel = sum(p.numel() for p in self.params)
        self.shard_size = math.ceil(self.numel / self.n)
        start = self.rank * self.shard_size
        flat = self._flat([p.detach() for p in self.params])
        self.shard = flat[start:start + self.shard_size].clone().requires_grad_(True)
        self.optimizer = optimizer_class([self.shard], **kwargs)

    def _flat(self, tensors):
        """The tensors as one vector; when P does not split evenly, a zero pads the last shard."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if self.numel % self.n:
            flat = torch.cat([flat, flat.new_zeros(1)])
        return flat

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        start = self.rank * self.shard_size
        grads = self._flat([p.grad for p in self.params])
        self.shard.grad = grads[start:start + self.shard_size].clone()
        self.optimizer.step()
        full = torch.empty(self.n * self.shard_size, dtype=self.shard.dtype, device=self.shard.device)
        dist.all_gather_into_tensor(full, self.shard.detach())
        with torch.no_grad():
            for p, new in zip(self.params, full[:self.numel].split([p.numel() for p in self.params])):
                p.copy_(new.view_as(p))
''',
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
        assert all(v.strip() != solution[gid].strip() for v in variants), gid
    assert set(lab_grading.wrong_submissions(WRONG)) == {"wrong0a", "wrong0b"}


def test_the_right_parts_of_the_wrong_answer_templates_are_the_solution():
    """The templates above, with nothing wrong, are a right answer: each wrong answer differs
    from the solution only in what it names."""
    import math

    import torch

    ns: dict = {"math": math, "torch": torch}
    exec(per_rank(), ns)  # noqa: S102 - our own test source
    sol: dict = {"math": math}
    src = {cells.grade_id(c): c.source for c in nbformat.read(LAB, as_version=4).cells}
    exec(src["per_rank_bytes"], sol)  # noqa: S102 - the solution's own cell
    for args in ((1_000_003, 4, 2, "adam"), (10, 3, 1, "momentum"), (7, 1, 3, "sgd")):
        assert ns["per_rank_bytes"](*args) == sol["per_rank_bytes"](*args)


def test_the_unfinished_student_version_says_what_to_do():
    student = nbformat.read(STUDENT, as_version=4)
    stubs = [c.source for c in student.cells if "NotImplementedError" in c.source]
    assert len(stubs) == 5  # largest_batch_from, psnr, ZeroOne, per_rank_bytes, the %%ranks cell


verdict_run, test_replaying_the_locked_helpers_of_another_seed_scores_nothing = (
    lab_grading.verdict_and_replay(LAB, STUDENT, WRONG, UNGRADED, AUTO)
)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the verdict kernel (the fixture) runs inside the first test
def test_each_plausible_wrong_answer_fails_its_test_cell(verdict_run):
    verdicts = verdict_run[1]
    lab_grading.assert_each_wrong_answer_fails_its_test(verdicts, WRONG)
