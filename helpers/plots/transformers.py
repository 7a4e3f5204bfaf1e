"""Lecture 08: a transformer layer's activations by part, and who computes which attention scores."""

from __future__ import annotations

from helpers.plots._axes import _axes


def activation_parts(by_label: dict, ax=None, title: str | None = None):
    """Lecture 08: stacked bars of activation bytes, one bar per label, one segment per part.

    ``by_label``: {label: {part: bytes}} (e.g. ``transformer.activation_bytes_cpu_by_part`` per
    sequence length, or per layout). The parts that grow with s² (``transformer.SCORES``) are
    hatched and drawn on top, so the quadratic term stands out as s grows. Bytes in MB (1e6).
    """
    import matplotlib.pyplot as plt

    from helpers.parallel.transformer import SCORES

    labels = list(by_label)
    parts = list(dict.fromkeys(p for parts in by_label.values() for p in parts))
    parts = [p for p in parts if p not in SCORES] + [p for p in parts if p in SCORES]
    ax = _axes(ax, figsize=(8, 3.6))
    colors = plt.cm.tab20.colors
    bottom = [0.0] * len(labels)
    for i, part in enumerate(parts):
        heights = [by_label[label].get(part, 0) / 1e6 for label in labels]
        ax.bar(
            labels,
            heights,
            bottom=bottom,
            color=colors[i % len(colors)],
            edgecolor="k",
            linewidth=0.3,
            hatch="//" if part in SCORES else None,
            label=part + (" (grows as s²)" if part in SCORES else ""),
            gid="scores" if part in SCORES else "part",
        )
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_ylabel("activation bytes (MB)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    if title:
        ax.set_title(title, fontsize=9)
    return ax


def attention_work(
    s: int, world_size: int, layout: str = "contiguous", causal: bool = True, ax=None
):
    """Lecture 08: the (query, key) score matrix of one head, each score coloured by the rank of
    context parallelism that computes it (the rank holding its query), white where the causal
    mask hides it. The title gives each rank's visible scores; a block-wise kernel also computes
    the masked half of each diagonal block (``context.work_per_rank``)."""
    import matplotlib.pyplot as plt
    import numpy as np

    from helpers.parallel.context import positions

    owner = np.empty(s, dtype=int)
    for r in range(world_size):
        owner[positions(r, world_size, s // world_size, layout).numpy()] = r
    grid = np.repeat(owner[:, None], s, axis=1).astype(float)  # (query, key): its query's rank
    if causal:
        grid[np.triu_indices(s, 1)] = np.nan  # a query sees no later key
    visible = [int(np.sum(grid == r)) for r in range(world_size)]
    ax = _axes(ax, figsize=(3.4, 3.4))
    cmap = plt.get_cmap("tab10", 10).with_extremes(bad="white")
    ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=9.5, interpolation="nearest", gid="scores")
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    mask = "causal" if causal else "full"
    ax.set_title(f"{layout}, {mask}: scores per rank {visible}", fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(r)) for r in range(world_size)]
    ax.legend(handles, [f"rank {r}" for r in range(world_size)], fontsize=7, loc="upper right")
    return ax
