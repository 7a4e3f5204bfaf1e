"""Lab 02's shared pieces and its checks' references.

The lab's locked cells and its graded checks import the same things from here, so the kernel
and the check build the same models and the same batches: ``global_batch``, ``make_model``
(and ``build``, a model from its spec), the test models of DDP (``Awkward``, ``Reordered``,
``ddp_model``), ``rank_share`` and ``sgd``.

What a check compares against is computed here, by the check, on the cases it draws itself
from the run's seed (``dp_cases``, ``ddp_cases``, ``epoch_cases``, ``accumulation_cases``):
- ``dp_reference``: one device's loss and gradients on the whole batch, and the bytes each
  phase of DataParallel moves (lecture 02);
- ``ddp_reference``: what torch DDP ends with on every rank, by one process playing every rank
  (tests/labs/test_lab02_reference.py holds it to torch DDP itself, on gloo ranks);
  ``reference_buckets`` and ``after_first_bucket``: the buckets the specification makes;
- ``accumulation_reference``: one process, plain SGD with momentum on each global batch.
"""

from __future__ import annotations

import functools
import random

import torch
from torch import nn
from torch.nn import functional as F

from helpers.workloads import data, models

MIB = 2**20  # DDP's "MB"


# -- the lab's data and models -------------------------------------------------------------------


@functools.cache
def _digits():
    return data.load("digits").tensors  # (1437, 1, 8, 8) float32, (1437,) int64


def global_batch(step: int, size: int, digits=None):
    """The global batch of ``step``: the same samples for every scheme and every rank.
    ``digits``: (inputs, labels) when the caller has them (the lab's ``X, Y``: a rank that gets
    them with its function loads nothing), else loaded here."""
    x, y = digits or _digits()
    idx = torch.randint(len(y), (size,), generator=torch.Generator().manual_seed(step))
    return x[idx], y[idx]  # copies: the data stays as it was


def rank_share(batch, rank: int, world_size: int, dtype=torch.float32):
    """``rank``'s share of a global ``batch`` (inputs, labels): its chunk, inputs in ``dtype``."""
    x, y = batch
    return x.chunk(world_size)[rank].to(dtype), y.chunk(world_size)[rank]


def make_model(seed: int = 0, hidden: int = 512, depth: int = 4):
    """The lab's MLP, the same initial weights wherever it is built."""
    torch.manual_seed(seed)
    return models.mlp(hidden=hidden, depth=depth)


def build(spec: tuple):
    """A model from its spec: ``("mlp", seed, hidden, depth)`` or ``("cnn", seed, channels)``."""
    kind, seed, *sizes = spec
    if kind == "mlp":
        return make_model(seed, *sizes)
    if kind == "cnn":
        torch.manual_seed(seed)
        return models.cnn(channels=sizes[0])
    raise ValueError(f"unknown model spec {spec!r}: ('mlp', seed, hidden, depth) or ('cnn', ...)")


def sgd(params, lr: float = 0.05):
    """The optimizer of the lab's graded runs (and of their references)."""
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


class Awkward(nn.Module):
    """A frozen layer, a layer the forward never uses, a weight used twice, BatchNorm and a buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(64, 32)
        self.frozen = nn.Linear(32, 32).requires_grad_(False)
        self.norm = nn.BatchNorm1d(32)
        self.unused = nn.Linear(32, 10)
        self.head = nn.Linear(64, 10)
        self.register_buffer("scale", torch.rand(1) + 0.5)  # differs on each rank until broadcast

    def forward(self, x):
        h = torch.relu(self.norm(self.frozen(self.embed(x.flatten(1) * self.scale))))
        return self.head(h @ self.embed.weight)  # embed.weight again: tied


class Reordered(nn.Module):
    """Its output layer registered before its input layer: gradients arrive in another order
    than the parameters are listed."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(32, 10)
        self.inp = nn.Linear(64, 32)

    def forward(self, x):
        return self.out(torch.relu(self.inp(x.flatten(1))))


DDP_MODELS = {
    "mlp": lambda: models.mlp(hidden=32, depth=3),
    "awkward": Awkward,
    "mlp float64": lambda: models.mlp(hidden=32, depth=3).double(),
    "reordered": Reordered,
}


def ddp_model(kind: str, seed: int):
    """One of the DDP test models (``DDP_MODELS``), its initial weights from ``seed``."""
    if kind not in DDP_MODELS:
        raise ValueError(f"unknown DDP test model {kind!r}: one of {', '.join(DDP_MODELS)}")
    torch.manual_seed(seed)
    return DDP_MODELS[kind]()


# -- DataParallel: test_dp_primitives ------------------------------------------------------------


def _chunks(size: int, n: int) -> int:
    """How many chunks ``x.chunk(n)`` makes of ``size`` rows (fewer than n for some sizes)."""
    return -(-size // -(-size // n))


def dp_cases(seed: int) -> list[tuple]:
    """(devices, batch size, step, model spec): 1 to 4 devices, for each a batch size of every
    remainder mod the devices (chunks of unequal size), each a drawn MLP; one a CNN."""
    rng = random.Random(seed)
    cases = []
    for n in range(1, 5):
        for r in range(n):
            sizes = [s for s in range(n, 48) if s % n == r and _chunks(s, n) == n]
            mlp = ("mlp", rng.randrange(100), rng.randint(4, 64), rng.randint(1, 4))
            cases.append((n, rng.choice(sizes), rng.randrange(10_000), mlp))
    at = rng.choice([i for i, case in enumerate(cases) if case[0] > 1])
    cases[at] = (*cases[at][:3], ("cnn", rng.randrange(100), rng.randint(2, 8)))
    return cases


def dp_reference(n: int, size: int, step: int, spec: tuple) -> dict:
    """What DataParallel on ``n`` devices must give: one device's loss and parameter gradients
    on the whole global batch, and the bytes each phase moves between device 0 and the others
    (phases that move nothing left out)."""
    model, (x, y) = build(spec), global_batch(step, size)
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    params = sum(p.numel() * p.element_size() for p in model.parameters())

    def others(t):  # chunks 1..n-1: what leaves or reaches device 0
        return sum(c.numel() * c.element_size() for c in t.chunk(n)[1:])

    moved = {
        "scatter": others(x),
        "replicate": (n - 1) * params,
        "gather": others(out),
        "scatter grad": others(out),
        "reduce grads": (n - 1) * params,
    }
    return {
        "loss": loss.item(),
        "grads": [p.grad for p in model.parameters()],
        "bytes": {phase: b for phase, b in moved.items() if b},
    }


# -- DDP from scratch: test_scratch_ddp ----------------------------------------------------------


def _reversed_sizes(module) -> list[int]:
    """Bytes of each parameter that requires a gradient, in reverse order of registration."""
    return [p.numel() * p.element_size() for p in module.parameters() if p.requires_grad][::-1]


def bucket_sizes(sizes: list[int], cap_bytes: float, closes=float.__ge__) -> list[int]:
    """Bytes of each bucket, filled in the order of ``sizes`` and closed as soon as
    ``closes(filled, cap_bytes)``."""
    buckets, current = [], 0
    for size in sizes:
        current += size
        if closes(float(current), float(cap_bytes)):
            buckets.append(current)
            current = 0
    return buckets + [current] if current else buckets


def reference_buckets(module, cap_mb: float) -> list[int]:
    """Bytes of each bucket by the specification (full at ``cap_mb`` MiB), in launch order for a
    model whose gradients arrive in reverse order of registration."""
    return bucket_sizes(_reversed_sizes(module), cap_mb * MIB)


def after_first_bucket(module, cap_mb: float) -> list[int]:
    """Indices (in ``module.parameters()``) of the trainable parameters not in the first bucket:
    for a model like the MLP, their gradients arrive after the first bucket is complete."""
    first, filled, later = reference_buckets(module, cap_mb)[0], 0, []
    for i, p in reversed(list(enumerate(module.parameters()))):
        if p.requires_grad:
            if filled >= first:
                later.append(i)
            filled += p.numel() * p.element_size()
    return later


def ddp_cases(seed: int) -> list[tuple]:
    """(kind, world size, steps, batch per rank, cap in MiB, rank 0's seed): every test model,
    2 and 3 ranks, and caps across each boundary of the bucket rule: between 10⁶ bytes and a
    MiB, exactly a bucket's size, one bucket for the whole model, a bucket per parameter, the
    float64 model in several buckets, and the reordered model with a bucket that spans both its
    layers (its last-listed parameter's gradient arrives first)."""
    rng = random.Random(seed)

    def log_uniform(lo, hi):
        return lo * (hi / lo) ** rng.random()

    def filled(kind):  # bytes of the first 1, 2, ... parameters of the reversed order
        sizes = _reversed_sizes(ddp_model(kind, 0))
        return [sum(sizes[: i + 1]) for i in range(len(sizes))]

    def buckets(kind, cap_bytes, closes=float.__ge__):
        return sorted(bucket_sizes(_reversed_sizes(ddp_model(kind, 0)), cap_bytes, closes))

    def anywhere(kind):
        return log_uniform(64, 2 * filled(kind)[-1]) / MIB

    def between(kind):  # full at 10⁶ bytes, not at a MiB: the buckets differ by the reading
        while True:
            cap = rng.choice(filled(kind)[:-1]) / 1e6 / rng.uniform(1.0, 1.045)
            if buckets(kind, cap * 1e6) != buckets(kind, cap * MIB):
                return cap

    def exact(kind):  # a bucket of exactly the cap, not the last (which closes anyway)
        while True:
            cap = rng.choice(filled(kind)[:-1]) / MIB
            if buckets(kind, cap * MIB, float.__gt__) != buckets(kind, cap * MIB):
                return cap

    def one_bucket(kind):
        return log_uniform(1, 8) * filled(kind)[-1] / MIB

    def several(kind):  # float64: buckets that 4 bytes a number (full at twice the cap) misses
        while True:
            cap = log_uniform(filled(kind)[1], filled(kind)[-1] / 2) / MIB
            if buckets(kind, cap * MIB) != buckets(kind, 2 * cap * MIB):
                return cap

    def per_parameter(kind):
        return log_uniform(8, min(_reversed_sizes(ddp_model(kind, 0)))) / MIB

    def spanning(kind):  # the reordered model: its input layer's bucket holds an output's too
        return log_uniform(filled(kind)[1] + 1, 2 * filled(kind)[-1]) / MIB

    plan = [
        ("awkward", anywhere),
        (rng.choice(["mlp", "mlp float64", "awkward"]), between),
        (rng.choice(["mlp", "mlp float64", "reordered"]), exact),
        (rng.choice(list(DDP_MODELS)), one_bucket),
        ("mlp float64", several),
        (rng.choice(["mlp", "mlp float64"]), per_parameter),
        ("reordered", spanning),
    ]
    worlds = [2, 3] + [rng.choice((2, 3)) for _ in plan[2:]]
    rng.shuffle(worlds)
    return [
        (kind, world, rng.randint(2, 3), rng.randint(2, 12), cap(kind), rng.randrange(1000))
        for (kind, cap), world in zip(plan, worlds, strict=True)
    ]


def ddp_reference(kind: str, world_size: int, steps: int, batch: int, start: int) -> dict:
    """What torch DDP ends with on every rank, by one process playing every rank: rank 0's start
    (seed ``start``; the broadcast gives it to every rank) and its buffers; each step every
    rank's gradients on its share of the global batch (``rank_share``), averaged (a parameter
    no rank used keeps ``.grad`` None, as under ``find_unused_parameters``), then SGD with
    momentum (``sgd``). The parameters and which ``.grad`` are None after ``steps`` steps."""
    model = ddp_model(kind, start)
    buffers = [b.clone() for b in model.buffers()]
    params = list(model.parameters())
    opt = sgd(params)
    for step in range(steps):
        per_rank = []
        for rank in range(world_size):
            model.zero_grad()
            x, y = rank_share(
                global_batch(step, batch * world_size), rank, world_size, params[0].dtype
            )
            F.cross_entropy(model(x), y).backward()
            per_rank.append([p.grad for p in params])
        for p, grads in zip(params, zip(*per_rank, strict=True), strict=True):
            got = [g for g in grads if g is not None]
            p.grad = torch.stack(got).sum(0) / world_size if got else None
        opt.step()
    return {
        "parameters": [p.detach() for p in params],
        "grad is None": [p.grad is None for p in params],
        "buffers": buffers,
    }


def _assert_steps_like_buckets(where: str, steps_seen, steps: int, buckets: list[int]) -> None:
    """Every step: one asynchronous all_reduce per bucket (its bytes), none waited for before
    backward returned."""
    assert isinstance(steps_seen, list) and len(steps_seen) == steps, (
        f"{where}: {len(steps_seen)} steps recorded, not {steps}"
    )
    for step, seen in enumerate(steps_seen):
        calls, done = seen["calls"], seen["backward done"]
        assert isinstance(calls, list) and calls and all(c[1] is True for c in calls), (
            f"{where}, step {step}: every bucket's all_reduce should be async_op=True"
        )
        assert all(c[3] is None or c[3] >= done for c in calls), (
            f"{where}, step {step}: an all-reduce was waited for during backward: wait in finish()"
        )
        assert sorted(c[0] for c in calls) == sorted(buckets), (
            f"{where}, step {step}: all-reduced {[c[0] for c in calls]} bytes, buckets should be "
            f"{buckets}"
        )


def assert_like_torch_ddp(per_rank, kind, world_size, steps, batch, cap_mb, start) -> None:
    """test_scratch_ddp's check of one case: on every rank torch DDP's parameters and None grads
    (``ddp_reference``, computed here, one process playing every rank), rank 0's buffers after
    construction, and each step one asynchronous all-reduce per bucket of the specification
    (``reference_buckets``), none waited for in backward. ``per_rank``: what the lab's
    ``scratch_ddp_runs`` returned (the student's data: judged, never trusted)."""
    want = ddp_reference(kind, world_size, steps, batch, start)
    buckets = reference_buckets(ddp_model(kind, start), cap_mb)
    assert isinstance(per_rank, list) and len(per_rank) == world_size, (
        f"{kind}: {world_size} ranks should report"
    )
    for rank, r in enumerate(per_rank):
        where = f"{kind}, rank {rank}"
        torch.testing.assert_close(
            r["parameters"], want["parameters"], rtol=1e-4, atol=1e-5,
            msg=lambda m, where=where: f"{where}: parameters differ from torch DDP's: {m}",
        )  # fmt: skip
        assert r["grad is None"] == want["grad is None"], (
            f"{where}: which .grad is None differs from torch DDP: {r['grad is None']}"
        )
        torch.testing.assert_close(
            r["buffers after construction"], want["buffers"], rtol=0, atol=0,
            msg=f"{where}: buffers not broadcast from rank 0 at construction",
        )  # fmt: skip
        _assert_steps_like_buckets(kind, r["steps"], steps, buckets)


# -- bytes per phase: test_epoch_bytes -----------------------------------------------------------


def epoch_cases(seed: int) -> list[tuple]:
    """(n_samples, sample_bytes, batch_size, n_params): three drawn datasets and models, each
    with a batch size that divides n_samples, one that does not, n_samples itself and one
    larger than n_samples."""
    rng = random.Random(seed)
    cases = []
    for _ in range(3):
        n, sample_bytes, n_params = (
            rng.randint(3, 5000),
            rng.randint(1, 4096),
            rng.randint(1, 2_000_000),
        )
        batches = [
            rng.choice([b for b in range(1, n) if n % b == 0]),
            rng.choice([b for b in range(2, n) if n % b]),
            n,
            rng.randint(n + 1, 2 * n),
        ]
        cases += [(n, sample_bytes, b, n_params) for b in batches]
    return cases


# -- gradient accumulation: test_accumulation_step -----------------------------------------------


def accumulation_model():
    """The model of the accumulation runs: a small MLP, the same start on every rank."""
    return make_model(0, hidden=64, depth=2)


def accumulation_cases(seed: int) -> list[tuple]:
    """(k micro-batches, micro-batch size, world size, steps): k = 1 (nothing to accumulate) and
    two of 2 to 5, on 2 and 3 ranks."""
    rng = random.Random(seed)
    worlds = [2, 3, rng.choice((2, 3))]
    rng.shuffle(worlds)
    ks = [1, *rng.sample(range(2, 6), 2)]
    return [
        (k, rng.randint(1, 12), world, rng.randint(2, 3))
        for k, world in zip(ks, worlds, strict=True)
    ]


def accumulation_reference(k: int, micro: int, world_size: int, steps: int) -> list:
    """What accumulation under DDP must end with: one process, each step one backward of the
    whole global batch (``world_size`` × ``k`` × ``micro`` samples), SGD with momentum."""
    model = accumulation_model()
    opt = sgd(model.parameters())
    for step in range(steps):
        x, y = global_batch(step, world_size * k * micro)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]
