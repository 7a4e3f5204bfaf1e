"""Lecture 07: a profiler's timeline per rank."""

from __future__ import annotations

from helpers.plots._axes import _axes


def profile_timeline(per_rank: dict, ax=None):
    """Profiled spans on one time axis (lecture 07): a row per rank and lane (forward, backward,
    optimizer, communication), from ``{rank: profiling.spans(...)}``; times in milliseconds."""
    ax = _axes(ax, figsize=(10, 1 + 0.5 * 4 * len(per_rank)))
    lanes = ("forward", "backward", "communication", "optimizer")
    colours = {
        "forward": "tab:blue",
        "backward": "tab:orange",
        "communication": "tab:red",
        "optimizer": "tab:green",
    }
    ticks, labels = [], []
    for i, (rank, rows) in enumerate(sorted(per_rank.items())):
        for j, lane in enumerate(lanes):
            y = i * (len(lanes) + 1) + j
            ticks.append(y)
            labels.append(f"rank {rank} {lane}")
            bars = [(s * 1e3, (e - s) * 1e3) for ln, _, s, e in rows if ln == lane]
            ax.broken_barh(bars, (y - 0.4, 0.8), color=colours[lane])
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds since the first profiled event")
    return ax
