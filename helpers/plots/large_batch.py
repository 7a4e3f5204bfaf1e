"""Lab 05: accuracy against the global batch."""

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
