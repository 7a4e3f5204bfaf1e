"""Large batches: accuracy against the global batch (lab 05); the critical batch and the
sharpness along a run (lecture 05)."""

from __future__ import annotations

from collections import defaultdict

from helpers.plots._axes import _axes


def batch_accuracy(
    rows: list[dict], key: str = "test accuracy", chance: float | None = 0.1, ax=None
):
    """``key`` vs global batch (log scale), one line per method: the median over seeds, bars
    from the worst to the best seed, and each run that failed to train drawn as a red x (lab 05).

    ``rows``: dicts with 'method', 'global batch', 'seed', ``key`` and 'failed' (diverged, or
    a final loss no better than guessing).
    """
    import statistics

    ax = _axes(ax, figsize=(7, 4))
    series = defaultdict(lambda: defaultdict(list))
    for r in rows:
        series[r["method"]][r["global batch"]].append(r)
    for method, by_batch in series.items():
        xs = sorted(by_batch)
        values = [[r[key] for r in by_batch[b]] for b in xs]
        med = [statistics.median(v) for v in values]
        lo = [m - min(v) for m, v in zip(med, values, strict=True)]
        hi = [max(v) - m for m, v in zip(med, values, strict=True)]
        ax.errorbar(xs, med, yerr=[lo, hi], fmt="o-", capsize=4, label=method)
        bad = [(b, r[key]) for b in xs for r in by_batch[b] if r.get("failed")]
        if bad:
            ax.plot(*zip(*bad, strict=True), "x", color="red", markersize=9)
    if any(r.get("failed") for r in rows):
        ax.plot([], [], "x", color="red", label="a seed that failed to train")
    if chance is not None:
        ax.axhline(chance, color="grey", lw=0.8, ls=":", label="chance")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch (log)")
    ax.set_ylabel(key)
    seeds = sorted({r["seed"] for r in rows})
    ax.set_title(f"median over seeds {seeds}; bars: worst to best seed", fontsize=9)
    ax.legend(fontsize=8)
    return ax


def critical_batch(batches, steps, fit: dict, lo=None, hi=None, axes=None):
    """Lecture 05: steps to a target loss against the batch (left) and the samples that took
    (right), measured points (medians; bars from ``lo`` to ``hi``, the seeds' range) beside
    McCandlish et al.'s S = S_min (1 + B_crit / B) and E = E_min (1 + B / B_crit), both from
    ``fit`` (noise_scale.fit_steps). Two Axes."""
    import matplotlib.pyplot as plt
    import numpy as np

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    b = np.asarray(batches, dtype=float)
    s = np.asarray(steps, dtype=float)
    grid = np.geomspace(b.min() / 2, b.max() * 2, 100)
    model = fit["s_min"] * (1 + fit["b_crit"] / grid)
    left, right = axes
    bars = None
    if lo is not None and hi is not None:
        lo_, hi_ = np.asarray(lo, dtype=float), np.asarray(hi, dtype=float)
        bars = np.vstack([s - lo_, hi_ - s])
    left.errorbar(b, s, yerr=bars, fmt="o", capsize=3, label="measured (median; seeds' range)")
    left.plot(grid, model, "-", label="S_min (1 + B_crit / B)")
    left.axhline(fit["s_min"], color="grey", ls=":", lw=0.8, label="S_min")
    left.set_ylabel("steps to the target loss")
    right.errorbar(
        b, s * b, yerr=None if bars is None else bars * b, fmt="o", capsize=3, label="measured"
    )
    right.plot(grid, model * grid, "-", label="E_min (1 + B / B_crit)")
    right.axhline(fit["e_min"], color="grey", ls=":", lw=0.8, label="E_min")
    right.set_ylabel("samples to the target loss")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axvline(fit["b_crit"], color="C3", ls="--", lw=0.8, label="B_crit (fit)")
        ax.set_xlabel("batch B (log)")
        ax.legend(fontsize=8)
    return axes


def sharpness(steps, sharp, losses, lr: float, momentum: float = 0.0, ax=None):
    """Lecture 05: the top Hessian eigenvalue along a run (log scale) with the stability bound
    2(1 + momentum)/lr it is compared with, and the loss on a second axis."""
    ax = _axes(ax, figsize=(8, 3.5))
    ax.plot(steps, sharp, "o-", color="C0", label="sharpness λ_max")
    bound = 2 * (1 + momentum) / lr
    ax.axhline(bound, color="C3", ls="--", label=f"2(1+μ)/lr = {bound:g}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("λ_max (log)")
    other = ax.twinx()
    other.plot(steps, losses, "s:", color="C2", label="loss")
    other.set_ylabel("training loss")
    lines = ax.get_legend_handles_labels()
    more = other.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper right")
    return ax
