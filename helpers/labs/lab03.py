"""Lab 03's references, computed by its checks apart from the student's kernel: the device's
accounting of a step's peak (the locked ``step_peak``, run here in one process), ZeRO-1's update
(one process with the whole optimizer: what DDP computes), the exact largest batch, PSNR and the
bytes per rank, PyTorch's ZeRO-1 partition for the live-world question, and the cases the hidden
tests draw (each from the run's seed). The runs of the student's code are in lab03_runs.

helpers.memory_limit counts tensors by their sizes alone, so a batch of zeros peaks exactly where
the lab's pixels do; the ZeroOne tests' pixels come from ``zero_batch``, the same in a rank and
here (tests/labs/test_lab03_reference.py runs both side by side).
"""

from __future__ import annotations

import random

import torch

from helpers.labs import hidden_seed, one_core
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


def exact_largest(points, limit: int) -> int:
    """The largest batch of the exact line through ``points`` ((batch, bytes) pairs) within
    ``limit`` bytes, or 0: in fractions, so no rounding at a GPU's 80 GB."""
    import math
    from fractions import Fraction

    (b0, p0), (b1, p1) = min(points), max(points)
    per_sample = Fraction(p1 - p0, b1 - b0)
    return max(0, math.floor((limit - (p0 - per_sample * b0)) / per_sample))


def psnr_reference(prediction, target, data_range) -> float:
    """PSNR in dB, in float64 (8-bit differences can be negative, their squares large)."""
    import math

    mse = ((prediction.double() - target.double()) ** 2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(data_range**2 / mse)


def psnr_cases(seed: int) -> list[tuple]:
    """test_psnr's hidden (prediction, target, data_range), drawn from ``seed``: 8-, 16- and
    32-bit integers and float32/64 images, errors from 1e-9 to 0.1 of the range, some identical,
    and a data_range that is not always the dtype's."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(rng.randint(0, 2**31))
    cases = []
    for dtype, top in [
        ("uint8", 255),
        ("int16", 4095),
        ("int32", 65535),
        ("float32", 1.0),
        ("float64", 1.0),
    ] * 2:
        shape = (rng.randint(1, 6), rng.randint(1, 6), rng.choice([1, 3]))
        if dtype.startswith("float"):
            a = torch.rand(shape, generator=g, dtype=torch.float64)
            noise = rng.choice([1e-9, 1e-3, 0.1]) * torch.randn(
                shape, generator=g, dtype=torch.float64
            )
            b = (a + noise).clamp(0, 1)
        else:
            a = torch.randint(0, top + 1, shape, generator=g)
            b = (a + torch.randint(-50, 51, shape, generator=g)).clamp(0, top)
        if rng.random() < 0.2:
            b = a.clone()
        cases.append(
            (
                b.to(getattr(torch, dtype)),
                a.to(getattr(torch, dtype)),
                rng.choice([top, 1.0, 2.0 * top]),
            )
        )
    return cases


def bytes_reference(n_params: int, world_size: int, stage: int, moments: int) -> dict:
    """What one rank keeps in fp32 at ``stage`` (0 DDP ... 3), a sharded part s = ⌈P/n⌉ numbers:
    {"parameters", "gradients", "optimizer_state", "total"} in bytes."""
    s = -(-n_params // world_size)
    out = {
        "parameters": 4 * (s if stage >= 3 else n_params),
        "gradients": 4 * (s if stage >= 2 else n_params),
        "optimizer_state": 4 * moments * (s if stage >= 1 else n_params),
    }
    out["total"] = sum(out.values())
    return out


def _largest_gap(got, ref) -> float:
    """The largest difference between two lists of tensors; inf where a shape differs, NaN kept."""
    gaps = [
        (g - w).abs().max().double() if g.shape == w.shape else torch.tensor(float("inf"))
        for g, w in zip(got, ref, strict=True)
    ]
    return torch.stack(gaps).max().item()


def like_ddp(per_rank, optimizer, world_size, dtype="float64", depth=2, width=31, seed=0) -> None:
    """test_zero_one's check of one run: every rank's parameters after each step are DDP's
    (``zero_reference``, computed here), its optimizer keeps the state of its shard of
    s = ⌈P / n⌉ numbers, and step() all-gathers n·s of them."""
    want, P = zero_reference(optimizer, world_size, dtype, depth, width, seed)
    s, itemsize = -(-P // world_size), getattr(torch, dtype).itemsize
    tolerance = 1e-5 if dtype == "float32" else 1e-10  # float32: the two may round differently
    moments = {"adam": 2, "momentum": 1}[optimizer]
    where = f"{optimizer}, {world_size} ranks, P = {P}"
    assert per_rank is not None and len(per_rank) == world_size, (
        f"{where}: {per_rank and len(per_rank)} ranks reported"
    )
    for rank, r in enumerate(per_rank):
        for step, (got, ref) in enumerate(zip(r["params"], want, strict=True)):
            worst = _largest_gap(got, ref)  # a NaN anywhere stays NaN: it fails
            assert worst < tolerance, (
                f"{where}, rank {rank}: after step {step + 1} the parameters differ from DDP's by {worst:.3g}"
            )
        assert r["state bytes"] == moments * s * itemsize, (
            f"{where}, rank {rank}: the optimizer keeps {r['state bytes']} bytes of state; "
            f"its shard of s = {s} numbers needs {moments * s * itemsize}"
        )
        assert r["gathered"] == [world_size * s * itemsize] * len(want), (
            f"{where}, rank {rank}: step() gathered {r['gathered']} bytes; n·s numbers are {world_size * s * itemsize}"
        )
        assert all(
            set(ops) <= {"all_gather_into_tensor", "all_gather", "broadcast"} for ops in r["ops"]
        ), f"{where}: step() called {r['ops']}; it should all-gather (or broadcast) the shards"


# -- the live world's question (part 3, %%ranks): PyTorch's ZeRO-1 on 2 ranks ----------------


def world_case(seed: int | None = None) -> tuple[int, int]:
    """The (depth, width) of coordinate_mlp the live-world question asks about, drawn from
    ``seed`` (default: the run's, ``hidden_seed()``): 1 to 4 layers of 8 to 64, so each run's
    ranks hold their own byte counts. The lab's locked cell draws it before the student's cell
    runs, so its test is not one a verdict kernel can re-run at another seed from the answer."""
    rng = random.Random(hidden_seed() if seed is None else seed)
    return rng.randint(1, 4), rng.randint(8, 64)


def zero_partition(numels, world_size: int) -> list[int]:
    """Numbers per rank of ZeroRedundancyOptimizer's partition of tensors of ``numels`` (one
    group): the largest first, each to the rank holding the fewest so far (the lowest rank on
    a tie), as torch.distributed.optim.ZeroRedundancyOptimizer._partition_parameters does.
    Whole tensors, so the ranks need not hold the same amount."""
    sizes = [0] * world_size
    for numel in sorted(numels, reverse=True):  # stable: equal sizes keep their order
        sizes[sizes.index(min(sizes))] += numel
    return sizes


def world_state_bytes(seed: int | None = None, world_size: int = 2) -> list[int]:
    """Bytes of Adam state (two fp32 moments) each rank of ``world_size`` keeps under
    ZeroRedundancyOptimizer for this run's model (``world_case``), in rank order."""
    depth, width = world_case(seed)
    numels = [p.numel() for p in models.coordinate_mlp(FEATURES, depth, width).parameters()]
    return [8 * n for n in zero_partition(numels, world_size)]
