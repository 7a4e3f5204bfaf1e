"""helpers.noise_scale: per-example gradients equal N separate backwards; the noise-scale
estimates recover a known covariance and mean from synthetic gradients (per-example and from two
batch sizes, as a data-parallel run has them); the critical-batch fit recovers its parameters;
steps_to_loss counts what it says."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

import helpers
from helpers.optimisation import noise_scale as ns


def _model(seed=0):
    torch.manual_seed(seed)
    return helpers.models.mlp(hidden=16, depth=2)


def _data(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(10, (n,), generator=g)


def test_per_example_gradients_equal_one_backward_per_sample():
    model = _model()
    x, y = _data(12)
    grads = ns.per_example_grads(model, x, y)
    assert grads.shape == (12, sum(p.numel() for p in model.parameters()))
    for i in range(12):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        one = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
        torch.testing.assert_close(grads[i], one, rtol=1e-5, atol=1e-7)
    # and their mean is the batch's gradient (the loss is a mean)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    batch = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    torch.testing.assert_close(grads.mean(0), batch, rtol=1e-5, atol=1e-7)


def _synthetic(n, g_norm2=0.25, trace=4.0, dim=50, seed=0):
    """Per-example gradients with mean G (|G|² = g_norm2) and isotropic covariance (tr = trace)."""
    gen = torch.Generator().manual_seed(seed)
    mean = torch.zeros(dim, dtype=torch.float64)
    mean[0] = math.sqrt(g_norm2)
    noise = torch.randn(n, dim, generator=gen, dtype=torch.float64) * math.sqrt(trace / dim)
    return mean + noise


def test_the_simple_noise_scale_recovers_a_known_covariance_and_mean():
    est = ns.simple_noise_scale(_synthetic(20_000))
    assert est["trace"] == pytest.approx(4.0, rel=0.03)
    assert est["g2"] == pytest.approx(0.25, rel=0.1)
    assert est["b_simple"] == pytest.approx(16.0, rel=0.12)
    assert est["samples"] == 20_000


def test_the_simple_noise_scale_is_unbiased_not_the_plain_squared_mean():
    # with few samples the plain |mean|² overestimates |G|² by tr(Σ)/N; the estimate removes it
    runs = [ns.simple_noise_scale(_synthetic(8, seed=s)) for s in range(2000)]
    mean_g2 = sum(r["g2"] for r in runs) / len(runs)
    mean_trace = sum(r["trace"] for r in runs) / len(runs)
    assert mean_g2 == pytest.approx(0.25, abs=0.04)  # the plain |mean|² averages 0.25 + 4/8 = 0.75
    assert mean_trace == pytest.approx(4.0, rel=0.03)
    with pytest.raises(ValueError, match="at least 2"):
        ns.simple_noise_scale(_synthetic(1))


def test_two_batch_sizes_give_the_same_estimates_as_a_data_parallel_run_would():
    # n ranks of b samples: each rank's own mean, and their average (n*b samples)
    b, n, draws = 8, 4, 3000
    small, big = [], []
    for s in range(draws):
        per_rank = _synthetic(n * b, seed=s).view(n, b, -1).mean(1)
        small += [(g @ g).item() for g in per_rank]
        avg = per_rank.mean(0)
        big.append((avg @ avg).item())
    est = ns.two_batch_estimate(sum(small) / len(small), sum(big) / len(big), b, n * b)
    assert est["trace"] == pytest.approx(4.0, rel=0.05)
    assert est["g2"] == pytest.approx(0.25, rel=0.15)
    assert est["b_simple"] == pytest.approx(16.0, rel=0.2)
    with pytest.raises(ValueError, match="b_small < b_big"):
        ns.two_batch_estimate(1.0, 1.0, 32, 32)


def test_the_critical_batch_fit_recovers_the_model_it_fits():
    batches = [8, 16, 32, 64, 128, 256]
    steps = [100 * (1 + 40 / b) for b in batches]
    fit = ns.fit_steps(batches, steps)
    assert fit["s_min"] == pytest.approx(100)
    assert fit["b_crit"] == pytest.approx(40)
    assert fit["e_min"] == pytest.approx(4000)  # E_min = S_min B_crit
    assert fit["r2"] == pytest.approx(1.0)
    assert fit["predicted"] == pytest.approx(steps)
    with pytest.raises(ValueError, match="3 or more"):
        ns.fit_steps([8, 8, 16], [1, 2, 3])


def test_steps_to_loss_is_the_first_look_below_the_target():
    x, y = _data(64)
    data = torch.utils.data.TensorDataset(x, y)
    steps = ns.steps_to_loss(_model, data, batch=16, lr=0.5, target=1.5, max_steps=400, every=5)
    assert steps is not None and steps % 5 == 0
    # replay the same run: below the target at that step, not at the look before it
    from helpers.optimisation.large_batch import epoch_batches

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, step, epoch = {}, 0, 0
    while step < steps:
        for idx in epoch_batches(64, 16, epoch, 0):
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            step += 1
            with torch.no_grad():
                losses[step] = F.cross_entropy(model(x), y).item()
            if step == steps:
                break
        epoch += 1
    assert losses[steps] < 1.5
    assert all(losses[s] >= 1.5 for s in range(5, steps, 5))
    # unreachable, and diverging: None, never a step count
    assert ns.steps_to_loss(_model, data, 16, 0.5, target=0.0, max_steps=20) is None
    assert ns.steps_to_loss(_model, data, 16, 1e6, target=0.1, max_steps=200) is None


def test_a_whole_training_set_has_no_sampling_noise_in_its_mean():
    # all N samples: the mean is G exactly, and tr(Σ) is the set's own (1/N) covariance trace
    grads = _synthetic(50, seed=3)
    est = ns.simple_noise_scale(grads, population=50)
    mean = grads.mean(0)
    assert est["g2"] == pytest.approx((mean @ mean).item())
    assert est["trace"] == pytest.approx(((grads - mean) ** 2).sum().item() / 50)
    with pytest.raises(ValueError, match="population of 40"):
        ns.simple_noise_scale(grads, population=40)


def test_samples_drawn_without_replacement_are_corrected_for_the_finite_set():
    # a set of N = 64 gradients; many draws of n = 16 distinct ones: the corrected estimates
    # average to the set's own |G|² and tr(Σ) (the i.i.d. formulas would not)
    population = _synthetic(64, seed=11)
    mean = population.mean(0)
    true_g2 = (mean @ mean).item()
    true_trace = ((population - mean) ** 2).sum().item() / 64
    gen = torch.Generator().manual_seed(0)
    runs = [
        ns.simple_noise_scale(population[torch.randperm(64, generator=gen)[:16]], population=64)
        for _ in range(4000)
    ]
    assert sum(r["g2"] for r in runs) / len(runs) == pytest.approx(true_g2, abs=0.02)
    assert sum(r["trace"] for r in runs) / len(runs) == pytest.approx(true_trace, rel=0.02)
