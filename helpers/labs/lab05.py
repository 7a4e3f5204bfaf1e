"""Lab 05's checks: the hidden cases of each test, drawn from the run's seed
(``COURSE_HIDDEN_SEED``), and the references the checks compare against (``plan_reference``,
``lars_reference``). The probe draws the cases in the student's kernel and the check draws them
again in the grader's, so a table of another run's answers finds none of this run's cases. The
runs of the student's code are in lab05_runs."""

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


def plan_reference(global_batch: int, world_size: int, max_micro: int) -> tuple[int, int]:
    """(micro, k): the fewest micro-batches per rank that make ``global_batch``, each at most
    ``max_micro`` samples (the batch splits evenly over the ranks)."""
    per = global_batch // world_size
    k = next(k for k in range(1, per + 1) if per % k == 0 and per // k <= max_micro)
    return per // k, k


def near(got, want, what: str) -> None:
    """test_lars: ``got`` and ``want`` (lists of parameters as lists of numbers) agree to 1e-5."""
    flat_got = [x for t in got for x in t]
    flat_want = [x for t in want for x in t]
    assert len(flat_got) == len(flat_want) and all(
        abs(g - w) < 1e-5 for g, w in zip(flat_got, flat_want, strict=True)
    ), f"{what}: got {got}, expected {want}"


def lars_reference(hyper: dict, init, grads) -> list:
    """The lab's LARS, step by step, in each parameter's own dtype: the parameters after each
    step of ``grads`` from ``init`` (a trust ratio for tensors of ndim > 1, none for biases)."""
    ps, vs, out = [t.clone() for t in init], [torch.zeros_like(t) for t in init], []
    for gs in grads:
        for i, g in enumerate(gs):
            d = g
            if ps[i].ndim > 1:
                wn, gn = ps[i].norm(), g.norm()
                ratio = (hyper["trust"] * wn / (gn + hyper["weight_decay"] * wn)
                         if wn > 0 and gn > 0 else 1.0)  # fmt: skip
                d = ratio * (g + hyper["weight_decay"] * ps[i])
            vs[i] = hyper["momentum"] * vs[i] + d
            ps[i] = ps[i] - hyper["lr"] * vs[i]
        out.append([p.clone() for p in ps])
    return out


def lars_matches(got, case) -> None:
    """test_lars's hidden check of one drawn case: every step's parameters, dtype and shape."""
    want = lars_reference(*case)
    assert len(got) == len(want)
    for after, ref in zip(got, want, strict=True):
        assert len(after) == len(ref)
        for p, w in zip(after, ref, strict=True):
            tol = 1e-10 if w.dtype == torch.float64 else 1e-5
            assert (
                p.dtype == w.dtype
                and p.shape == w.shape
                and torch.allclose(p, w, rtol=tol, atol=tol)
            ), case[0]
