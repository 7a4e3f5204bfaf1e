"""Lab 06's checks: the hidden cases of each test, drawn from the run's seed
(``COURSE_HIDDEN_SEED``). The probe draws them in the student's kernel and the check draws them
again in the grader's, so a table of another run's answers finds none of this run's cases."""

from __future__ import annotations

import random

import torch
from torch import nn

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
FROZEN = ("nothing", "weight", "bias", "layer")  # what of a layer does not train


def layer_stacks(seed: int) -> list[list[tuple]]:
    """Eight models as layer lists, (in, out, bias, dtype, frozen) each: 1 to 5 Linear layers of
    1 to 40 features, each in its own dtype, each with nothing, its weight, its bias or all of
    it frozen."""
    rng = random.Random(seed)
    return [
        [
            (
                rng.randint(1, 40),
                rng.randint(1, 40),
                rng.random() < 0.7,
                rng.choice(list(DTYPE_BYTES)),
                rng.choice(FROZEN),
            )
            for _ in range(rng.randint(1, 5))
        ]
        for _ in range(8)
    ]


def stack(layers: list[tuple]) -> nn.Sequential:
    """The model of ``layer_stacks``' layers."""
    model = nn.Sequential(
        *[nn.Linear(i, o, bias=b).to(getattr(torch, d)) for i, o, b, d, _ in layers]
    )
    for layer, (*_, frozen) in zip(model, layers, strict=True):
        for name, p in layer.named_parameters():
            p.requires_grad_(frozen not in (name, "layer"))
    return model


def comm_runs(seed: int) -> list[tuple[list[tuple], int]]:
    """Ten runs, (records as (total, exposed, data), skip): 1 to 12 steps, a warm-up of 0 to all
    but one of them, exposed communication up to 0.9 of a step, some steps with a data phase."""
    rng = random.Random(seed)
    runs = []
    for _ in range(10):
        n = rng.randint(1, 12)
        steps = []
        for _ in range(n):
            total = rng.uniform(0.5, 5.0)
            steps.append((total, rng.uniform(0.0, 0.9) * total, rng.choice([0.0, 0.1 * total])))
        runs.append((steps, rng.randint(0, n - 1)))
    return runs


def histories(seed: int) -> list[tuple[list[dict], float]]:
    """Eight (history, target): 1 to 10 epochs of any length in seconds, targets from 0.01 to 0.5,
    losses that fall and bounce either side of the target; two histories never below it (one
    touching it), two with an epoch exactly at it (which is not below)."""
    rng = random.Random(seed)
    out = []
    for k in range(8):
        n, target = rng.randint(1, 10), rng.uniform(0.01, 0.5)
        losses = [target * rng.uniform(0.3, 4.0) for _ in range(n)]
        if k % 4 == 0:
            losses = [max(loss, target) for loss in losses]
        elif k % 4 == 1:
            losses[rng.randrange(n)] = target
        seconds = [rng.uniform(0.01, 5.0) for _ in range(n)]
        out.append(
            (
                [
                    {"epoch": i + 1, "train loss": loss, "seconds": s}
                    for i, (loss, s) in enumerate(zip(losses, seconds, strict=True))
                ],
                target,
            )
        )
    return out
