"""helpers.labs.lab05: the hidden cases its checks draw cover the boundaries its docstrings name
(remainders, both sides of the base batch and of the base rate, warmups of 0 and 1 steps), anew
for every seed."""

from __future__ import annotations

import pytest
import torch

from helpers.labs import lab05

SEEDS = range(50)


def test_the_plans_split_over_the_ranks_and_the_refusals_do_not():
    plans = [c for s in SEEDS for c in lab05.plan_cases(s)]
    assert all(b % n == 0 for b, n, _ in plans)
    assert any(m < b // n for b, n, m in plans) and any(m >= b // n for b, n, m in plans)
    refused = [c for s in SEEDS for c in lab05.refused_cases(s)]
    assert all(b % n for b, n, _ in refused)
    assert {b % n for b, n, _ in refused} == set(range(1, 8))  # every remainder
    assert {n for _, n, _ in refused} == set(range(2, 9))


def test_the_scaled_batches_lie_both_sides_of_the_base_and_off_its_multiples():
    scaled = [c for s in SEEDS for c in lab05.scaled_cases(s)]
    assert any(batch < base for _, base, batch in scaled)
    assert any(batch > base for _, base, batch in scaled)
    assert (
        sum(batch % base != 0 and base % batch != 0 for _, base, batch in scaled) > len(scaled) / 2
    )


def test_the_warmups_start_at_zero_steps_and_reach_peaks_both_sides_of_the_base():
    for s in SEEDS:
        cases = lab05.warmup_cases(s)
        assert {0, 1} <= {warm for _, _, _, warm in cases}
        assert any(peak < base for _, base, peak, _ in cases)
        assert any(peak > base for _, base, peak, _ in cases)
        for w in {warm for *_, warm in cases}:  # both sides of each warmup's end
            steps = {step for step, *_, warm in cases if warm == w}
            assert {0, w, w + 1} <= steps and max(w - 1, 0) in steps


def test_the_plan_reference_is_the_fewest_micro_batches_that_fit():
    for b, n, m in [c for s in range(5) for c in lab05.plan_cases(s)]:
        micro, k = lab05.plan_reference(b, n, m)
        assert micro * k * n == b and micro <= m
        assert all((b // n) % j or (b // n) // j > m for j in range(1, k)), (b, n, m)
    assert lab05.plan_reference(2048, 2, 256) == (256, 4)


def test_the_lars_reference_is_the_worked_example_of_the_lab():
    """Trust 0.1, lr 1, no weight decay: [3, 4] with gradient [0, 1] moves by 0.5 * [0, 1]; the
    weight 2 with gradient -0.5 by 0.4 * -0.5; the biases by their gradients."""
    init = [
        torch.tensor([[3.0, 4.0]]),
        torch.tensor([2.0]),
        torch.tensor([[2.0]]),
        torch.tensor([-1.0]),
    ]
    grads = [
        [
            torch.tensor([[0.0, 1.0]]),
            torch.tensor([0.5]),
            torch.tensor([[-0.5]]),
            torch.tensor([1.0]),
        ]
    ]
    hyper = {"lr": 1.0, "momentum": 0.9, "weight_decay": 0.0, "trust": 0.1}
    after = lab05.lars_reference(hyper, init, grads)[0]
    lab05.near(
        [p.flatten().tolist() for p in after], [[3.0, 3.5], [1.5], [2.2], [-2.0]], "one step"
    )
    with pytest.raises(AssertionError, match="one step"):
        lab05.near(
            [[3.0, 4.0], [1.5], [2.2], [-2.0]], [[3.0, 3.5], [1.5], [2.2], [-2.0]], "one step"
        )


@pytest.mark.parametrize(
    "draw",
    [
        lab05.plan_cases,
        lab05.refused_cases,
        lab05.scaled_cases,
        lab05.warmup_cases,
        lab05.lars_cases,
    ],
)
def test_the_cases_are_the_seeds_own(draw):
    """The same seed draws the same cases (the probe and the check agree); another seed draws
    others (a table of one run's answers fails the next)."""
    assert repr(draw(3)) == repr(draw(3))
    assert repr(draw(3)) != repr(draw(4))
