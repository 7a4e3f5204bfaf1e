"""Lecture 03 and lab 03: memory over a step, ZeRO's stages, bytes per rank, a grid of peaks."""

from __future__ import annotations

from helpers.plots._axes import _axes

MEMORY_COLORS = {
    "parameters": "tab:blue",
    "gradients": "tab:orange",
    "optimizer_state": "tab:green",
    "activations": "tab:red",
    "inputs": "tab:gray",
    "temporaries": "tab:purple",
}


def memory_phases(timeline: list[dict], ax=None):
    """Lecture 03: bytes alive at the end of each phase of a step, by part, and each phase's peak.

    ``timeline``: ``helpers.memory.track(...).timeline`` (dicts with 'phase', a byte count per
    part, and 'peak'). Bars stack the parts (MB); a black tick marks the peak within the phase.
    """
    ax = _axes(ax, figsize=(7, 3.5))
    xs = range(len(timeline))
    bottom = [0.0] * len(timeline)
    for part, color in MEMORY_COLORS.items():
        vals = [row.get(part, 0) / 1e6 for row in timeline]
        if any(vals):
            ax.bar(xs, vals, bottom=bottom, color=color, label=part.replace("_", " "), width=0.6)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.scatter(
        xs,
        [row["peak"] / 1e6 for row in timeline],
        marker="_",
        s=900,
        color="k",
        label="peak during the phase",
        zorder=3,
    )
    ax.set_xticks(list(xs), [row["phase"] for row in timeline])
    ax.set_ylabel("bytes alive (MB)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return ax


def zero_stages(world_size: int = 4, axes=None):
    """Lecture 03: who keeps what under DDP and ZeRO-1/2/3, one panel per stage.

    Each rank is a column of three bars — parameters, gradients, optimizer state — cut in
    ``world_size`` shards; a filled shard is kept by that rank, an empty one it does not keep.
    Under each panel, the collectives that stage uses every step.
    """
    import matplotlib.pyplot as plt

    from helpers.parallel.sharding import SHARDED, STAGES

    moves = {
        0: "all-reduce gradients",
        1: "all-reduce gradients;\nall-gather updated parameters",
        2: "reduce-scatter gradients;\nall-gather updated parameters",
        3: "all-gather each layer's parameters\n(forward and backward); reduce-scatter gradients",
    }
    rows = (("parameters", 2.0), ("gradients", 1.0), ("optimizer_state", 0.0))
    if axes is None:
        _, axes = plt.subplots(1, 4, figsize=(13, 3.3))
    n = world_size
    for stage, ax in zip(STAGES, axes, strict=True):
        for rank in range(n):
            for part, y in rows:
                for shard in range(n):
                    kept = part not in SHARDED[stage] or shard == rank
                    x = rank * (n + 1) + shard
                    ax.add_patch(
                        plt.Rectangle(
                            (x, y),
                            0.9,
                            0.8,
                            edgecolor=MEMORY_COLORS[part],
                            facecolor=MEMORY_COLORS[part] if kept else "none",
                            alpha=0.85,
                        )
                    )
            ax.text(rank * (n + 1) + n / 2, 3.0, f"rank {rank}", ha="center", fontsize=8)
        ax.set_xlim(-0.5, n * (n + 1))
        ax.set_ylim(-1.6, 3.4)
        ax.set_yticks([y + 0.4 for _, y in rows], ["params", "grads", "opt state"])
        ax.tick_params(left=False, labelleft=stage == 0)
        ax.set_xticks([])
        for side in ("top", "right", "bottom", "left"):
            ax.spines[side].set_visible(False)
        ax.set_title(STAGES[stage], fontsize=9)
        ax.text(n * (n + 1) / 2 - 0.5, -0.9, moves[stage], ha="center", va="center", fontsize=8)
    return axes


def memory_per_rank(formula: list[dict], measured: list[dict], unit: str = "MB", ax=None):
    """Lecture 03: bytes per rank vs world size, one line per stage (formula) and measured points.

    ``formula``: dicts {'stage', 'world_size', 'total'}; ``measured``: the same keys, the
    largest rank's bytes. Log-2 x axis; y in ``unit`` ("MB" or "GB", 1 GB = 1e9 bytes).
    """
    scale = {"MB": 1e6, "GB": 1e9}[unit]
    ax = _axes(ax, figsize=(6, 3.8))
    colors = {0: "k", 1: "tab:green", 2: "tab:orange", 3: "tab:blue"}
    for stage in sorted({r["stage"] for r in formula}):
        rs = sorted((r for r in formula if r["stage"] == stage), key=lambda r: r["world_size"])
        ax.plot(
            [r["world_size"] for r in rs],
            [r["total"] / scale for r in rs],
            "--",
            color=colors[stage],
            label=f"stage {stage} formula",
        )
        ms = [r for r in measured if r["stage"] == stage]
        if ms:
            ax.plot(
                [r["world_size"] for r in ms],
                [r["total"] / scale for r in ms],
                "o",
                color=colors[stage],
                label=f"stage {stage} measured",
            )
    ax.set_xscale("log", base=2)
    ns = sorted({r["world_size"] for r in formula})
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("ranks n")
    ax.set_ylabel(f"parameters + gradients + optimizer state\nper rank ({unit})")
    ax.legend(fontsize=7, ncol=2)
    return ax


def heatmap(
    values,
    row_labels,
    col_labels,
    row_name: str = "depth",
    col_name: str = "width",
    value_name: str = "value",
    ax=None,
    missing: str = "OOM",
    vmin: float | None = None,
    vmax: float | None = None,
):
    """A labelled heatmap (e.g. time or quality over depth × width), each cell annotated.

    A NaN cell is drawn grey and labelled ``missing`` (a configuration that did not run).
    ``vmin`` / ``vmax``: the ends of the colour scale (default: this grid's own); give several
    heatmaps of one quantity the same ends so that one colour means one value in all of them."""
    import numpy as np

    ax = _axes(ax)
    data = np.asarray(values, dtype=float)
    im = ax.imshow(np.ma.masked_invalid(data), cmap="viridis", aspect="auto", vmin=vmin, vmax=vmax)
    ax.set_facecolor("0.85")  # a cell without a value (NaN: e.g. out of memory) is grey
    ax.set_xticks(range(len(col_labels)), [str(c) for c in col_labels])
    ax.set_yticks(range(len(row_labels)), [str(r) for r in row_labels])
    ax.set_xlabel(col_name)
    ax.set_ylabel(row_name)
    for i in range(data.shape[0]):
        for j in range(data.shape[1]):
            text = missing if np.isnan(data[i, j]) else f"{data[i, j]:.3g}"
            ax.text(
                j,
                i,
                text,
                ha="center",
                va="center",
                color="k" if np.isnan(data[i, j]) else "w",
                fontsize=8,
            )
    ax.figure.colorbar(im, ax=ax, label=value_name)
    return ax
