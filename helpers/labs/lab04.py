"""Lab 04's checks: what one process computes for the step a pipeline splits, what the dense MLP
computes for the tensor-parallel one, and the hidden cases of each test, drawn from the run's
seed (``COURSE_HIDDEN_SEED``).

The lab's harnesses build their models and data here too (``engine_model``, ``tp_case``), in
the ranks, so the check's one-process reference is made from the very weights and samples the
student's code was given, by code the student's kernel cannot rebind.
"""

from __future__ import annotations

import random

import torch
from torch import nn

from helpers.parallel import tensor_parallel

KINDS = ("gpipe", "1f1b")


# -- the pipeline engine (test_pipeline_step) ---------------------------------------------------


def engine_model(depth: int, width: int, seed: int) -> nn.Sequential:
    """``depth`` blocks Linear(width, width) + Tanh, seeded."""
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())])


def engine_batch(n: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples and their targets, (n, width) each, from a generator seeded ``seed + 1``."""
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


def one_process_step(n: int, width: int, depth: int, seed: int) -> tuple[float, list]:
    """The step a pipeline must reproduce: the whole batch in one process, the mean squared
    error; (loss, every parameter's gradient in the model's order)."""
    model = engine_model(depth, width, seed)
    x, y = engine_batch(n, width, seed)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.item(), [q.grad for q in model.parameters()]


def engine_cases(seed: int) -> list[tuple]:
    """Three runs of the engine, (kind, p, m, n, width, depth, seed), one from each side of the
    boundaries an engine can get wrong: a single stage (first and last at once); 1F1B with fewer
    micro-batches than stages (m = 1 included); as many micro-batches as stages or more, on 2 to
    4 ranks. Micro-batches of 1 to 3 samples, widths 1 to 8, and depth p to p + 3 layer pairs (so
    a stage may start with a Tanh and the stages differ in length). n is a multiple of m: the
    loss is divided by m, which is one process's mean only over equal micro-batches."""
    rng = random.Random(seed)

    def case(kind: str, p: int, m: int) -> tuple:
        size, width, depth = rng.randint(1, 3), rng.randint(1, 8), rng.randint(p, p + 3)
        return (kind, p, m, m * size, width, depth, rng.randint(1, 2**31 - 2))

    single = case(rng.choice(KINDS), 1, rng.randint(1, 6))
    p = rng.randint(3, 4)
    fewer = case("1f1b", p, rng.randint(1, p - 1))
    p = rng.randint(2, 4)
    more = case(rng.choice(KINDS), p, rng.randint(p, 8))
    return [single, fewer, more]


# -- the tensor-parallel MLP (test_tensor_parallel) ---------------------------------------------


def tp_case(d: int, h: int, n_samples: int, seed: int) -> tuple[nn.Sequential, torch.Tensor]:
    """The dense ``Linear(d, h), ReLU, Linear(h, d)`` (seeded) and its input (seed + 1)."""
    dense = tensor_parallel.mlp(d, h, seed)
    x = torch.randn(n_samples, d, generator=torch.Generator().manual_seed(seed + 1))
    return dense, x.requires_grad_()


def tp_loss(out: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient differs at every output element (a sum would give all ones)."""
    return (out * torch.arange(out.numel()).view_as(out).sin()).sum()


def dense_step(d: int, h: int, n_samples: int, seed: int):
    """The dense MLP's forward and backward on the case: (dense with its gradients, x with its
    gradient, the output)."""
    dense, x = tp_case(d, h, n_samples, seed)
    out = dense(x)
    tp_loss(out).backward()
    return dense, x, out.detach()


def tp_cases(seed: int) -> list[tuple]:
    """Two runs of the tensor-parallel MLP, (n, d, h, n_samples, seed): on 3 ranks and on 4
    (the visible case runs on 2), 1 to 3 hidden features per rank, 1 to 8 model features and
    samples."""
    rng = random.Random(seed)
    return [
        (n, rng.randint(1, 8), n * rng.randint(1, 3), rng.randint(1, 8), rng.randint(1, 2**31 - 2))
        for n in (3, 4)
    ]


# -- formulas and measured events (test_schedules, test_bubble_fraction, test_measured_bubble) --


def schedule_shapes(seed: int) -> list[tuple[int, int]]:
    """(p, m) for both schedules: fixed boundaries (one stage, one micro-batch, fewer micro-
    batches than stages, as many) and eight drawn, 1 to 6 stages, half of them with m ≤ p."""
    rng = random.Random(seed)
    drawn = []
    for _ in range(8):
        p = rng.randint(1, 6)
        drawn.append((p, rng.randint(1, p) if rng.random() < 0.5 else rng.randint(p, 3 * p + 2)))
    return [(4, 8), (3, 2), (4, 2), (1, 3), (3, 1), (5, 7), (1, 1), (3, 3)] + drawn


def bubble_shapes(seed: int) -> list[tuple[int, int]]:
    """(p, m) for the bubble formula: fixed boundaries and eight drawn, 1 to 8 stages, 1 to 64
    micro-batches."""
    rng = random.Random(seed)
    drawn = [(rng.randint(1, 8), rng.randint(1, 64)) for _ in range(8)]
    return [(1, 5), (3, 1), (8, 32), (5, 2)] + drawn


def bubble_steps(seed: int) -> list[list[dict]]:
    """Ten steps' events: 1 to 4 ranks, 1 to 6 micro-batches, random durations and gaps, each
    rank starting when it does, the events listed in a shuffled order."""
    rng = random.Random(seed)
    steps = []
    for _ in range(10):
        events = []
        for r in range(rng.randint(1, 4)):
            t = rng.uniform(0.0, 5.0)
            for i in range(rng.randint(1, 6)):
                for op in "FB":
                    start = t + rng.uniform(0.0, 1.0)
                    t = start + rng.uniform(0.1, 2.0)
                    events.append({"rank": r, "op": op, "micro": i, "start": start, "end": t})
        rng.shuffle(events)
        steps.append(events)
    return steps
