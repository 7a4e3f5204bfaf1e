"""The gradient noise scale and the critical batch size (McCandlish et al. 2018, "An Empirical
Model of Large-Batch Training", arXiv:1812.06162), measured on the course's models (lecture 05).

    g = per_example_grads(model, x, y)          # (N, P): one flattened gradient per sample
    noise = simple_noise_scale(g)                # {"trace": tr Σ, "g2": |G|², "b_simple": ...}
    est = two_batch_estimate(g2_small, g2_big, b_small, b_big)   # from data-parallel norms
    fit = fit_steps(batches, steps)              # S = S_min (1 + B_crit / B)

Why these: with per-example gradients g_i of mean G and covariance Σ, a batch of B samples has
E|G_B|² = |G|² + tr(Σ)/B. The batch where the noise term equals the signal, B_simple = tr(Σ)/|G|²,
is the paper's cheap estimate of the batch beyond which a larger batch stops buying fewer steps.
A data-parallel run has two batch sizes for free: each rank's own gradient (B/n samples) before
the all-reduce and the averaged one (B samples) after it (the paper's Appendix A).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from helpers.optimisation.large_batch import epoch_batches


def per_example_grads(model, x, y, loss=None):
    """(N, P) float64: row i is the gradient of ``loss(model(x[i:i+1]), y[i:i+1])`` with respect
    to every parameter of ``model``, flattened in ``model.parameters()`` order. Computed with
    torch.func (vmap over grad), so N samples cost one batched backward, not N.
    ``loss``: default cross-entropy. Needs a model without BatchNorm in training mode (a
    one-sample batch has no batch statistics)."""
    loss = loss or nn.functional.cross_entropy
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        return loss(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    grads = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([grads[k].reshape(len(x), -1) for k in params], dim=1).double()


def simple_noise_scale(grads, population: int | None = None) -> dict:
    """From per-example gradients (n, P): estimates of tr(Σ) and |G|², and their ratio B_simple.

    ``population=None``: the rows are independent draws (with replacement) from the gradient
    distribution; tr(Σ) is the sample covariance's trace and |G|² the squared mean less its own
    noise tr(Σ)/n, both unbiased. ``population=N``: the rows are n distinct samples of a training
    set of N (drawn without replacement, or all of it): Σ is then the set's own covariance
    (1/N), the sample mean's noise shrinks by (N - n)/(N - 1), and with n = N the mean *is* G.
    ``b_simple`` is inf when the estimate of |G|² is not positive (the mean gradient is lost in
    the noise of n samples: take more)."""
    n = len(grads)
    if n < 2:
        raise ValueError(f"the noise scale needs at least 2 per-example gradients, got {n}")
    if population is not None and not n <= population:
        raise ValueError(f"{n} distinct samples cannot come from a population of {population}")
    mean = grads.mean(0)
    trace = ((grads - mean) ** 2).sum().item() / (n - 1)
    if population is None:
        g2 = (mean @ mean).item() - trace / n
    else:
        trace *= (population - 1) / population  # E[sample covariance] = Σ N/(N-1)
        g2 = (mean @ mean).item() - trace / n * (population - n) / (population - 1)
    return {
        "trace": trace,
        "g2": g2,
        "b_simple": trace / g2 if g2 > 0 else math.inf,
        "samples": n,
    }


def two_batch_estimate(g2_small: float, g2_big: float, b_small: int, b_big: int) -> dict:
    """McCandlish et al.'s Appendix A: from the squared norms of gradients over batches of
    ``b_small`` and ``b_big`` samples (a rank's before the all-reduce, the average after it),
    unbiased estimates |G|² = (B_big |G_big|² - B_small |G_small|²) / (B_big - B_small) and
    tr(Σ) = (|G_small|² - |G_big|²) / (1/B_small - 1/B_big). Each is noisy from one step: average
    the norms over many steps first (the ratio of averages, not the average of ratios)."""
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got b_small={b_small}, b_big={b_big}")
    g2 = (b_big * g2_big - b_small * g2_small) / (b_big - b_small)
    trace = (g2_small - g2_big) / (1 / b_small - 1 / b_big)
    return {"g2": g2, "trace": trace, "b_simple": trace / g2 if g2 > 0 else math.inf}


def fit_steps(batches, steps) -> dict:
    """Least-squares fit of the paper's S = S_min (1 + B_crit / B) to steps-to-target measured at
    several batch sizes: linear in 1/B (S = S_min + S_min B_crit / B). Returns S_min, B_crit,
    E_min = S_min B_crit (the fewest samples), r2 of the fit, and the model's steps at each B."""
    import numpy as np

    b = np.asarray(batches, dtype=float)
    s = np.asarray(steps, dtype=float)
    if len(set(b)) < 3:  # 3 distinct batches (and so at least 3 points)
        raise ValueError(f"fit_steps needs steps at 3 or more batch sizes, got {list(batches)}")
    slope, intercept = np.polyfit(1 / b, s, 1)
    predicted = intercept + slope / b
    r2 = 1 - ((s - predicted) ** 2).sum() / max(((s - s.mean()) ** 2).sum(), 1e-300)
    b_crit = slope / intercept if intercept > 0 else math.inf
    return {
        "s_min": float(intercept),
        "b_crit": float(b_crit),
        "e_min": float(slope),
        "r2": float(r2),
        "predicted": predicted.tolist(),
    }


def steps_to_loss(
    build,
    train_set,
    batch: int,
    lr: float,
    target: float,
    max_steps: int,
    momentum: float = 0.0,
    seed: int = 0,
    every: int = 5,
) -> int | None:
    """Steps of SGD at ``batch`` and ``lr`` until the loss on the whole training set is below
    ``target`` (looked at every ``every`` steps, so the answer is a multiple of it: a lucky
    mini-batch does not count), or None within ``max_steps`` or if the loss stops being finite.
    One process: the step count does not depend on how many ranks share the batch."""
    torch.manual_seed(seed)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    x, y = train_set.tensors
    step, epoch = 0, 0
    while step < max_steps:
        for idx in epoch_batches(len(y), batch, epoch, seed):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            step += 1
            if step % every == 0:
                with torch.no_grad():
                    full = nn.functional.cross_entropy(model(x), y).item()
                if not math.isfinite(full):
                    return None
                if full < target:
                    return step
            if step >= max_steps:
                return None
        epoch += 1
    return None
