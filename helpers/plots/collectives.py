"""Lecture 01: what a collective does to each rank's data, the ring, bandwidth against message size."""

from __future__ import annotations

from collections import defaultdict

from helpers.plots._axes import _axes


def collective(before: list, after: list, name: str, note: str = ""):
    """Each rank's tensor before and after a collective, side by side (values written in)."""
    import matplotlib.pyplot as plt

    values = [v for rows in (before, after) for r in rows if r is not None for v in r]
    vmax = max(values, default=1)
    fig, (a, b) = plt.subplots(1, 2, figsize=(7, 0.5 + 0.45 * len(before)))
    _grid(a, before, f"{name}: before", vmax)
    _grid(b, after, f"{name}: after" + (f" ({note})" if note else ""), vmax)
    fig.tight_layout()
    return a, b


def _grid(ax, rows: list, title: str, vmax: float):
    import numpy as np

    width = max((len(r) for r in rows if r is not None), default=1)
    data = np.full((len(rows), width), np.nan)
    for i, r in enumerate(rows):
        if r is not None:
            data[i, : len(r)] = r
    ax.imshow(data, cmap="YlGnBu", vmin=0, vmax=vmax or 1, aspect="auto")
    for i, r in enumerate(rows):
        for j, v in enumerate(r if r is not None else []):
            ax.text(j, i, f"{v:g}", ha="center", va="center", fontsize=8)
        if r is None:
            ax.text(
                (width - 1) / 2,
                i,
                "(no output)",
                ha="center",
                va="center",
                fontsize=7,
                color="gray",
            )
    ax.set_yticks(range(len(rows)), [f"rank {i}" for i in range(len(rows))])
    ax.set_xticks(range(width))
    ax.set_xlabel("element")
    ax.set_title(title, fontsize=9)


def ring(state: dict, ax=None):
    """One step of ring all-reduce (helpers.ring.steps): who holds the sum of whom, who sends."""
    import numpy as np

    held = state["held"]
    n = len(held)
    ax = _axes(ax, figsize=(1.2 + 0.9 * n, 0.8 + 0.6 * n))
    counts = np.array([[len(c) for c in row] for row in held])
    ax.imshow(counts, cmap="Oranges", vmin=0, vmax=n)
    for r in range(n):
        for c in range(n):
            ax.text(c, r, "+".join(map(str, held[r][c])), ha="center", va="center", fontsize=7)
    for src, dst, chunk in state["sends"]:
        ax.annotate(
            "",
            xy=(chunk, dst),
            xytext=(chunk, src),
            arrowprops={"arrowstyle": "->", "color": "k", "alpha": 0.5},
        )
    ax.set_xticks(range(n), [f"chunk {c}" for c in range(n)])
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_title(f"{state['phase']}: cell = ranks summed into that chunk")
    return ax


def alpha_beta(records: list[dict], fits: dict | None = None):
    """Lecture 01's α-β figure: time and busbw vs message size, medians with min–max bars.

    ``records`` from ``bench.benchmark_spread``; ``fits``: {(op, world_size): AlphaBeta}. Left:
    time with the fit (dashed) and its two ring terms (dotted: latency 2(n−1)α, bandwidth
    2(n−1)/n·S/B). Right: busbw with the fit and its large-message limit B. A fit under the R²
    floor is drawn without its terms or B, labelled with its R²: it measured neither. Oversubscribed
    worlds are drawn hollow and named so. Returns the two Axes.
    """
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = defaultdict(list)
    for r in records:
        series[(r["op"], r["world_size"])].append(r)
    for (op, n), rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["bytes"])
        sizes, color = _measured(left, right, op, n, rs)
        fit = (fits or {}).get((op, n))
        if fit is not None:
            _fitted(left, right, op, n, sizes, color, fit)
    _alpha_beta_axes(left, right, records)
    fig.tight_layout()
    return left, right


def _measured(left, right, op: str, n: int, rs: list[dict]):
    """One series' medians with min–max bars: time on the left, busbw on the right (hollow when
    oversubscribed). Returns its sizes and its colour."""
    import numpy as np

    from helpers.measure.bandwidth import bus_factor

    s = np.array([r["bytes"] for r in rs], dtype=float)
    t = np.array([r["seconds"] for r in rs])
    lo = np.array([r.get("min_s", r["seconds"]) for r in rs])
    hi = np.array([r.get("max_s", r["seconds"]) for r in rs])
    over = any(r.get("oversubscribed") for r in rs)
    label = f"{op}, n={n}" + (" (oversubscribed: not n devices)" if over else "")
    style = {"fmt": "o", "mfc": "none" if over else None, "capsize": 2, "markersize": 4}
    bar = left.errorbar(s, t * 1e3, yerr=[(t - lo) * 1e3, (hi - t) * 1e3], label=label, **style)
    color = bar[0].get_color()
    factor = bus_factor(op, n)
    spread = [factor * s * (1 / t - 1 / hi) / 1e9, factor * s * (1 / lo - 1 / t) / 1e9]
    right.errorbar(s, factor * s / t / 1e9, yerr=spread, color=color, label=label, **style)
    return s, color


def _fitted(left, right, op: str, n: int, s, color, fit) -> None:
    """One series' α-β fit, dashed; its two ring terms (dotted) and its limit B, unless the fit
    is under the R² floor (then it measured neither, and its label says its R²)."""
    import numpy as np

    from helpers.measure.bandwidth import bus_factor, ring_steps
    from helpers.measure.findings import R2_FLOOR

    grid = np.geomspace(s.min(), s.max(), 60)
    left.plot(grid, fit.predict(grid) * 1e3, "--", color=color, linewidth=1)
    if fit.r2 < R2_FLOOR:  # the points do not follow the model: it measured no α and no B
        left.plot([], [], "--", color=color, label=f"n={n}: fit R² = {fit.r2:.3f}, no α or B")
        return
    left.plot(grid, np.full_like(grid, fit.alpha * 1e3), ":", color=color, linewidth=1)
    left.plot(grid, grid / fit.beta * 1e3, ":", color=color, linewidth=1)
    left.annotate(
        f"latency 2(n−1)α = {ring_steps(op, n)}α = {fit.alpha * 1e3:.2f} ms",
        (grid[0], fit.alpha * 1e3),
        fontsize=7,
        color=color,
        va="bottom",
    )
    busbw = bus_factor(op, n) * grid / fit.predict(grid) / 1e9
    right.plot(grid, busbw, "--", color=color, linewidth=1)
    limit = f"n={n}: fit's limit B = {fit.busbw_gbps:.2f} GB/s"
    right.axhline(fit.busbw_gbps, color=color, linestyle=":", linewidth=1, label=limit)


def _alpha_beta_axes(left, right, records: list[dict]) -> None:
    """The two panels' scales, limits, labels and legends."""
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size S (bytes)")
        ax.grid(alpha=0.3, which="both")
    fastest = min((r.get("min_s", r["seconds"]) for r in records), default=1e-3)
    left.set_ylim(bottom=fastest * 1e3 / 3)  # the bandwidth term's tail would squash the data
    left.set_ylabel("time per call (ms): median, bars min–max of repeats")
    left.set_title("time = latency term + bandwidth term (dotted), fit dashed", fontsize=9)
    right.set_ylabel("bus bandwidth (GB/s)")
    right.set_title("busbw = algbw × 2(n−1)/n; dotted: its limit B", fontsize=9)
    left.legend(fontsize=7, loc="upper left")
    right.legend(fontsize=7, loc="lower right")


def busbw(records: list[dict], fits: dict | None = None, ax=None):
    """Bus bandwidth vs message size (log-log), one line per (op, world size); fitted α-β dashed.

    ``fits``: {(op, world_size): AlphaBeta}. memcpy records are drawn as the one-host limit.
    """
    from helpers.measure.bandwidth import bus_factor

    ax = _axes(ax, figsize=(7, 4.5))
    series = defaultdict(list)
    for r in records:
        series[(r["op"], r["world_size"])].append(r)
    for (op, n), rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["bytes"])
        xs = [r["bytes"] for r in rs]
        style = "k:" if op == "memcpy" else "o-"
        label = "memcpy (one device)" if op == "memcpy" else f"{op}, n={n}"
        line = ax.plot(xs, [r["busbw_GBps"] for r in rs], style, label=label, markersize=3)[0]
        fit = (fits or {}).get((op, n))
        if fit is not None:
            model = [s / fit.predict(s) / 1e9 * bus_factor(op, n) for s in xs]
            ax.plot(xs, model, "--", color=line.get_color(), linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title("Collective bandwidth (dashed: α-β fit)")
    ax.legend(fontsize=7, ncol=2)
    return ax
