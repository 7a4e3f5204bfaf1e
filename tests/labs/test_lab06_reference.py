"""helpers.labs.lab06: the hidden cases its checks draw cover the boundaries its docstrings name
(every dtype, weights and biases frozen apart, losses at the target and never below it), anew for
every seed."""

from __future__ import annotations

import pytest
import torch

from helpers.labs import lab06


def test_the_stacks_freeze_weights_and_biases_apart_in_every_dtype():
    layers = [layer for stack in lab06.layer_stacks(0) for layer in stack]
    assert {d for *_, d, _ in layers} == set(lab06.DTYPE_BYTES)
    assert {f for *_, f in layers} == set(lab06.FROZEN)
    model = lab06.stack([(3, 2, True, "float64", "weight"), (2, 4, True, "bfloat16", "bias")])
    assert [(p.requires_grad, p.dtype) for p in model.parameters()] == [
        (False, torch.float64),
        (True, torch.float64),
        (True, torch.bfloat16),
        (False, torch.bfloat16),
    ]


def test_the_histories_reach_the_target_never_exactly_and_below():
    for seed in range(20):
        drawn = lab06.histories(seed)
        below = [any(r["train loss"] < t for r in h) for h, t in drawn]
        exactly = [any(r["train loss"] == t for r in h) for h, t in drawn]
        assert not all(below) and any(below) and any(exactly)
        assert all([r["epoch"] for r in h] == list(range(1, len(h) + 1)) for h, _ in drawn)


@pytest.mark.parametrize("draw", [lab06.layer_stacks, lab06.comm_runs, lab06.histories])
def test_the_cases_are_the_seeds_own(draw):
    """The same seed draws the same cases (the probe and the check agree); another seed draws
    others (a table of one run's answers fails the next)."""
    assert draw(3) == draw(3)
    assert draw(3) != draw(4)
