"""Lab 05's checks: the hidden cases of each test, drawn from the run's seed
(``COURSE_HIDDEN_SEED``). The probe draws them in the student's kernel and the check draws them
again in the grader's, so a table of another run's answers finds none of this run's cases."""

from __future__ import annotations

import random

import torch


def plan_cases(seed: int) -> list[tuple[int, int, int]]:
    """40 (global_batch, world_size, max_micro) that split over the ranks: 1 to 8 ranks, every
    per-rank size up to 600, a memory cap from 1 to 700 (above and below the per-rank size)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(40):
        n = rng.randint(1, 8)
        cases.append((rng.randint(1, 600) * n, n, rng.randint(1, 700)))
    return cases


def refused_cases(seed: int) -> list[tuple[int, int, int]]:
    """Six (global_batch, world_size, max_micro) that do not split over the ranks: 2 to 8 ranks,
    every remainder from 1 to world_size − 1."""
    rng = random.Random(seed)
    cases = []
    for _ in range(6):
        n = rng.randint(2, 8)
        cases.append((rng.randint(0, 300) * n + rng.randint(1, n - 1), n, rng.randint(1, 700)))
    return cases


def scaled_cases(seed: int) -> list[tuple[float, int, int]]:
    """Eight (base_lr, base_batch, batch): batches above and below the base, most of them not a
    multiple of it nor a divisor."""
    rng = random.Random(seed)
    cases = []
    for k in range(8):
        base = rng.randint(1, 512)
        batch = rng.randint(1, base) if k % 2 else rng.randint(base, 16 * base)
        cases.append((rng.uniform(0.001, 1.0), base, batch))
    return cases


def warmup_cases(seed: int) -> list[tuple[int, float, float, int]]:
    """(step, base_lr, peak_lr, warmup_steps) of five schedules: warmups of 0 to 50 steps (0 and
    1 always among them), peaks above the base and below it (a scaled rate at a batch under the
    base batch), each read at step 0, inside the warmup, either side of its end and long after."""
    rng = random.Random(seed)
    cases = []
    for k, warm in enumerate([0, 1, *(rng.randint(2, 50) for _ in range(3))]):
        base = rng.uniform(0.001, 1.0)
        peak = base * (rng.uniform(0.05, 0.95) if k % 2 else rng.uniform(1.05, 64.0))
        steps = {
            0,
            max(warm - 1, 0),
            warm,
            warm + 1,
            rng.randint(0, warm),
            rng.randint(warm, 10_000),
        }
        cases += [(step, base, peak, warm) for step in sorted(steps)]
    return cases


def lars_cases(seed: int) -> list[tuple[dict, list, list]]:
    """Six (hyperparameters, initial parameters, three steps of gradients): models of a matrix,
    a bias and a conv kernel in float32 or float64 (mixed in one model; the first model's
    matrix float64)."""
    rng = random.Random(seed)
    cases = []
    for c in range(6):
        shapes = [
            (rng.randint(1, 4), rng.randint(1, 5)),
            (rng.randint(1, 5),),
            (rng.randint(1, 3), 2, 2, 2),
        ]
        dtypes = [
            torch.float64 if c == 0 and i == 0 else rng.choice([torch.float32, torch.float64])
            for i in range(3)
        ]
        hyper = {
            "lr": rng.choice([0.1, 0.5, 1.0]),
            "momentum": rng.choice([0.0, 0.5, 0.9]),
            "weight_decay": rng.choice([0.0, 0.01, 0.1]),
            "trust": rng.choice([0.02, 0.1, 0.5]),
        }
        g = torch.Generator().manual_seed(rng.randint(0, 2**31))
        init = [
            torch.randn(s, generator=g, dtype=torch.float64).to(d)
            for s, d in zip(shapes, dtypes, strict=True)
        ]
        grads = [
            [
                torch.randn(s, generator=g, dtype=torch.float64).to(d)
                for s, d in zip(shapes, dtypes, strict=True)
            ]
            for _ in range(3)
        ]
        cases.append((hyper, init, grads))
    return cases
