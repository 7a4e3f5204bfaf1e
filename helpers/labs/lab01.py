"""Lab 01's references, computed by its checks apart from the student's kernel: the lab's
model and its device (the locked ``make_model`` and ``fits_one_device``, run here in one
process from the lab's parameters), the one-process reference of ``average_gradients``, and the
hidden cases each test draws from the run's seed (searches, shards, trainings, a table, a model).

The device is helpers.memory_limit's accounting, which counts tensors by their sizes alone, so
inputs of zeros fit exactly where the lab's images do (tests/labs/test_lab01_reference.py runs
both side by side).
"""

from __future__ import annotations

import math
import random

import torch
from torch import nn

from helpers.labs import one_core
from helpers.measure.memory import memory_limit, parse_bytes
from helpers.workloads import models


def make_model(name: str = "mlp", in_shape=(1, 8, 8), hidden: int = 512, depth: int = 4):
    """The lab's ``make_model()``: the model of ``model_name`` for images of ``in_shape``."""
    torch.manual_seed(0)  # as the lab's: the same weights, though only their sizes matter here
    kwargs = {"hidden": hidden, "depth": depth} if name == "mlp" else {}
    return models.build(name, in_shape=tuple(in_shape), **kwargs)


def fits(
    batch: int, budget, data: int, name="mlp", in_shape=(1, 8, 8), hidden=512, depth=4
) -> bool:
    """The lab's ``fits_one_device(batch)``: two steps of SGD with momentum at ``batch`` images
    within ``budget``, on a dataset of ``data`` images (its labels are sliced, as the lab's)."""
    if 4 * batch * math.prod(in_shape) > parse_bytes(budget):
        return False  # the first layer saves the input batch itself: no step can fit
    model = make_model(name, in_shape, hidden, depth)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x_all, y_all = torch.zeros(batch, *in_shape), torch.zeros(data, dtype=torch.long)
    try:
        with one_core(), memory_limit(budget, model, opt) as mem:
            for _ in range(2):  # the second step also holds the momentum buffers
                loss = nn.functional.cross_entropy(model(x_all.clone()), y_all[:batch])
                opt.zero_grad()
                loss.backward()
                opt.step()
                mem.check()
    except torch.OutOfMemoryError:
        return False
    return True


class Scale(nn.Module):
    """One learnable number, a 0-d parameter named neither weight nor bias."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))


def drawn_model(seed: int) -> nn.Module:
    """test_bytes_theory's hidden model, drawn from ``seed``: Linear, Conv2d, Embedding,
    LayerNorm, BatchNorm1d (buffers that are not gradients), attention (parameters named
    ``in_proj_weight``) and a bare 0-d parameter, dimensions 1 to 9, biases on or off, each
    parameter frozen or not: a conv kernel (2×2 or 3×3) and an oddly named parameter train, one
    parameter is frozen."""
    rng = random.Random(seed)
    dim = lambda: rng.randint(1, 9)  # noqa: E731
    bias = lambda: rng.random() < 0.6  # noqa: E731
    kinds = {
        "linear": lambda: nn.Linear(dim(), dim(), bias=bias()),
        "conv": lambda: nn.Conv2d(dim(), dim(), rng.randint(2, 3), bias=bias()),
        "embedding": lambda: nn.Embedding(dim(), dim()),
        "layernorm": lambda: nn.LayerNorm(dim()),
        "batchnorm": lambda: nn.BatchNorm1d(dim()),
        "attention": lambda: nn.MultiheadAttention(2 * dim(), 2, bias=bias()),
        "scale": Scale,
    }
    names = ["conv", rng.choice(["attention", "scale"])]
    names += [rng.choice(sorted(kinds)) for _ in range(rng.randint(1, 3))]
    rng.shuffle(names)
    model = nn.ModuleList(kinds[k]() for k in names)
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(rng.random() < 0.6)
    must_train = [next(m.weight for m in model if isinstance(m, nn.Conv2d))]
    must_train.append(
        next(p for m in model for n, p in m.named_parameters() if n in ("in_proj_weight", "gain"))
    )
    for p in must_train:
        p.requires_grad_(True)
    frozen = [p for p in params if all(p is not q for q in must_train)]
    if frozen and all(p.requires_grad for p in frozen):
        rng.choice(frozen).requires_grad_(False)
    return model


def ring_case(seed: int) -> tuple[int, int]:
    """test_bytes_theory's hidden ring all-reduce: (bytes, world size), from 2 to 1024 ranks."""
    rng = random.Random(seed)
    return rng.randint(1, 10**10), rng.choice([rng.randint(2, 8), rng.randint(9, 1024)])


def search_cases(seed: int) -> list[tuple]:
    """test_largest_fitting_batch's hidden searches, (threshold, start, limit), drawn from
    ``seed``: a batch fits if it is at most ``threshold``. Random ones, and one on each side of
    every boundary: the threshold at a doubling and one below it, the limit at a doubling, one
    below and one above it, a limit below ``start`` (nothing to ask), and a device so large that
    the search doubles 16 times and more."""
    rng = random.Random(seed)
    start = lambda: rng.randint(1, 64)  # noqa: E731
    doubled = lambda s: s * 2 ** rng.randint(0, 12)  # noqa: E731
    cases = [
        (rng.randint(0, 5000), start(), rng.choice([None, rng.randint(1, 4000)])) for _ in range(3)
    ]
    for edge in (0, -1):
        s = start()
        cases.append((doubled(s) + edge, s, None))
    for edge in (-1, 0, 1):
        s = start()
        cases.append((10**9, s, doubled(s) + edge))
    s = start()
    cases.append((rng.randint(0, 5000), s, rng.randint(0, s - 1)))
    s = start()
    cases.append((rng.randint(s * 2**16, 10**9), s, None))
    return list(dict.fromkeys(cases))


def shard_cases(seed: int) -> list[tuple]:
    """test_shard_indices's hidden cases, (n, world_size, epoch, shuffle, seed), drawn from
    ``seed``: on 1 to 4 ranks, n with every remainder by the world size (n below the world size
    included), a dataset of one on 3 or 4 ranks (its one sample repeated on every rank),
    and an unshuffled one."""
    rng = random.Random(seed)
    draw = lambda n, ws, shuffle: (n, ws, rng.randint(0, 9), shuffle, rng.randint(0, 99))  # noqa: E731
    cases = [draw(rng.randint(1, 40), 1, True)]  # one rank shuffles too
    for ws in (2, 3, 4):
        for r in range(ws):
            cases.append(draw(ws * rng.randint(0 if r else 1, 12) + r, ws, rng.random() < 0.75))
    cases.append(draw(1, rng.randint(3, 4), True))
    cases.append(draw(rng.randint(1, 40), rng.randint(2, 4), False))
    return list(dict.fromkeys(cases))


class Mixed(nn.Module):
    """A frozen layer (no gradient), an unused one (a gradient of None) and a float64 one."""

    def __init__(self):
        super().__init__()
        self.a, self.frozen, self.unused = nn.Linear(6, 5), nn.Linear(5, 5), nn.Linear(5, 5)
        self.b = nn.Linear(5, 3).double()
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.b(torch.tanh(self.frozen(self.a(x))).double())


def small_model(mixed: bool = False) -> nn.Module:
    """test_average_gradients' model, as every rank and the check build it: Linear-Tanh-Linear,
    or (``mixed``) one with a frozen layer, an unused one and a float64 one."""
    torch.manual_seed(0)
    return Mixed() if mixed else nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def small_batches(steps: int, global_batch: int, seed: int):
    """Each step's global batch, (steps, global_batch, 6) inputs and their 3 classes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, global_batch, 6, generator=g)
    return x, torch.randint(0, 3, (steps, global_batch), generator=g)


@one_core()  # as a rank computes it
def one_process(world_size: int, steps=3, batch=4, seed=1, mixed=False) -> list:
    """The reference of average_gradients: one process from the same start on the same data,
    every step on the whole global batch of ``world_size`` × ``batch``; its parameters."""
    model = small_model(mixed)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    x, y = small_batches(steps, batch * world_size, seed)
    for step in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[step]), y[step]).backward()
        opt.step()
    return [p.detach().double() for p in model.parameters()]


def training_cases(seed: int) -> list[tuple]:
    """test_average_gradients' hidden runs, (world_size, steps, batch, data seed, mixed): the
    small model on 3 or 4 ranks and the mixed one on 2 to 4, 1 to 5 samples per rank."""
    rng = random.Random(seed)
    return [
        (rng.randint(3, 4), 3, rng.randint(1, 5), rng.randint(2, 2**30), False),
        (rng.randint(2, 4), 3, rng.randint(1, 4), rng.randint(2, 2**30), True),
    ]


def drawn_times(seed: int) -> dict:
    """test_speedup_table's hidden table: {(world_size, batch): [seconds, ...]}, world size 1
    and one to three others, one to three batches, one to six repeats, each drawn."""
    rng = random.Random(seed)
    worlds = [1, *sorted(rng.sample([2, 3, 4, 8], rng.randint(1, 3)))]
    batches = rng.sample([8, 16, 32, 64, 128, 512], rng.randint(1, 3))
    return {
        (w, b): [round(rng.uniform(0.5, 20.0), 3) for _ in range(rng.randint(1, 6))]
        for w in worlds
        for b in batches
    }
