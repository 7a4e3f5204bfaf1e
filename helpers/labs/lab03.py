"""Lab 03's references, computed by its checks apart from the student's kernel: the device's
accounting of a step's peak (the locked ``step_peak``, run here in one process), ZeRO-1's update
(one process with the whole optimizer: what DDP computes), and the cases the hidden tests draw.

helpers.memory_limit counts tensors by their sizes alone, so a batch of zeros peaks exactly where
the lab's pixels do; the ZeroOne tests' pixels come from ``zero_batch``, the same in a rank and
here (tests/labs/test_lab03_reference.py runs both side by side).
"""

from __future__ import annotations

import random

import torch

from helpers.labs import one_core
from helpers.measure.memory import memory_limit
from helpers.workloads import models

FEATURES = 26  # helpers.data.image's inputs: x, y and their sin and cos at 6 octaves
OPTIMIZERS = {"adam": ("Adam", {"lr": 1e-3}), "momentum": ("SGD", {"lr": 0.05, "momentum": 0.9})}


def step_peak(batch: int, depth: int, width: int, features: int = FEATURES, budget=None):
    """The lab's ``step_peak``: peak bytes of two Adam steps at ``batch`` pixels, as
    helpers.memory_limit counts them; None if they ran out of ``budget``."""
    if budget is not None and 4 * batch * features > budget:
        return None  # the first layer saves the input batch itself: no step can fit
    model = models.coordinate_mlp(features, depth, width)
    opt = torch.optim.Adam(model.parameters(), lr=0.002)
    x, y = torch.zeros(batch, features), torch.zeros(batch, 3)
    try:
        with one_core(), memory_limit(budget or 10**15, model, opt) as mem:
            for _ in range(2):  # the second holds Adam's state from its start
                opt.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
                opt.step()
                mem.check()
    except torch.OutOfMemoryError:
        return None
    return mem.peak["total"]


def zero_batch(step: int, rank: int, dtype: str, seed: int = 0, batch: int = 16, features=FEATURES):
    """Rank ``rank``'s pixels at ``step`` of a ZeroOne test drawn with ``seed``: random, the
    same wherever made (in a rank, and in the check's one process)."""
    g = torch.Generator().manual_seed(10_000 * seed + 100 * step + rank)
    x = torch.randn(batch, features, generator=g, dtype=getattr(torch, dtype))
    return x, torch.rand(batch, 3, generator=g, dtype=getattr(torch, dtype))


@one_core()  # as a rank computes it
def zero_reference(optimizer, world_size, dtype="float64", depth=2, width=31, seed=0, steps=3):
    """The parameters after each step of training in one process on the ranks' global batch
    (the mean of their mean losses: DDP's update) with the whole ``optimizer``, and their count."""
    torch.manual_seed(0)  # as every rank of the lab's zero_training
    model = models.coordinate_mlp(FEATURES, depth, width).to(getattr(torch, dtype))
    name, kwargs = OPTIMIZERS[optimizer]
    opt = getattr(torch.optim, name)(model.parameters(), **kwargs)
    after = []
    for step in range(steps):
        opt.zero_grad()
        for rank in range(world_size):
            x, y = zero_batch(step, rank, dtype, seed)
            (((model(x) - y) ** 2).mean() / world_size).backward()
        opt.step()
        after.append([p.detach().clone() for p in model.parameters()])
    return after, sum(p.numel() for p in model.parameters())


def coordinate_params(depth: int, width: int, features: int = FEATURES) -> int:
    """Parameters of coordinate_mlp(features, depth, width): always odd with 3 outputs, so P
    leaves a remainder on 2 and 4 ranks, and 0, 1 or 2 on 3 ranks as the width says."""
    return (features + 1) * width + (depth - 1) * (width + 1) * width + (width + 1) * 3


def zero_cases(seed: int) -> list[tuple]:
    """test_zero_one's hidden runs, drawn from ``seed``: (optimizer, world_size, dtype, depth,
    width, data seed). Each run has the last shard padded by 3 (4 ranks), no padding at all
    (3 ranks, P = 3·s), a padding of 1 or 2, and a float32 run on 2 to 4 ranks; both optimizers."""
    rng = random.Random(seed)

    def model(world_size, remainders):  # a model whose P leaves one of ``remainders``
        while True:
            depth, width = rng.randint(1, 3), rng.randint(3, 32)
            if coordinate_params(depth, width) % world_size in remainders:
                return depth, width

    def case(optimizer, world_size, dtype, remainders):
        return (optimizer, world_size, dtype, *model(world_size, remainders), rng.randint(1, 2**30))

    pick = lambda: rng.choice(sorted(OPTIMIZERS))  # noqa: E731
    ranks, remainders = rng.choice([(3, {1, 2}), (4, {3})])  # padded by 2 or 1 on 3 ranks, 1 on 4
    return [
        case("momentum", 4, "float64", {1}),
        case("adam", 3, "float64", {0}),
        case(pick(), ranks, "float64", remainders),
        case(pick(), rng.randint(2, 4), "float32", {0, 1, 2, 3}),
    ]


def largest_cases(seed: int, budget: int) -> tuple[list, int]:
    """test_largest_batch_from's hidden cases, drawn from ``seed``: exact lines as (points,
    budget), and a budget for the lab's own peaks, from half to twice the device's ``budget``.

    A line fixed + per_sample × batch (whole or half bytes per sample) is measured at 2 or 3
    even batches, given in any order, at four scales: a toy, a laptop, and a GPU (up to 80 GB,
    where a float32 number is off by thousands of bytes) with small and with large samples.
    Its budgets sit on both sides of each boundary: a batch's peak and one byte less, one
    sample's worth (exactly 1 fits) and one byte less, the fixed part alone and one byte less."""
    import math

    rng = random.Random(seed)
    lines = []
    for low, high, most in (
        (1, 10**4, 100),
        (1, 10**7, 10**4),
        (10**9, 8 * 10**10, 10**3),
        (10**9, 8 * 10**10, 10**7),
    ):
        fixed, per_sample = rng.randint(low, high), rng.randint(2, 2 * most) / 2
        batches = rng.sample(range(2, 10**4, 2), rng.choice([2, 3]))
        points = tuple((b, int(fixed + per_sample * b)) for b in batches)
        for edge in (
            math.ceil(fixed + per_sample * rng.randint(2, 10**4)),
            math.ceil(fixed + per_sample),
            fixed,
        ):
            lines += [(points, edge), (points, edge - 1)]
    return lines, rng.randint(budget // 2, 2 * budget)


def bytes_cases(seed: int) -> list[tuple[int, int]]:
    """test_per_rank_bytes's hidden (parameters, world size), drawn from ``seed``: one rank;
    2, 3 and 4 ranks with every remainder (a last shard padded by n - r, or not at all); many
    ranks with fewer parameters than ranks (shards of one number) and with a trillion."""
    rng = random.Random(seed)
    cases = [(rng.randint(1, 10**9), 1)]
    for n in (2, 3, 4):
        cases += [(n * rng.randint(1, 10**9) + r, n) for r in range(n)]
    many = rng.choice([8, 64, 1024])
    return [*cases, (rng.randint(1, many - 1), many), (rng.randint(10**9, 10**12), many)]
