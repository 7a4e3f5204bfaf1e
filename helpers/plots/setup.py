"""Lecture 00: the device model, ranks sharing the cores of this machine."""

from __future__ import annotations

from helpers.plots._axes import _axes


def device_model(cores: int, world_sizes=(1, 2, 4), threads: int = 1, ax=None):
    """Lecture 00's picture: which core each rank plays its device on, per world size.

    One row per world size; a box per core; a rank with ``threads`` cores of its own sits on
    them. When ranks × threads exceed ``cores`` the ranks share cores: drawn red, oversubscribed.
    """
    import matplotlib.pyplot as plt

    ax = _axes(ax, figsize=(7, 0.9 + 0.7 * len(world_sizes)))
    width = max(cores, max(world_sizes) * threads)
    for row, n in enumerate(world_sizes):
        y = len(world_sizes) - 1 - row
        over = n * threads > cores
        for c in range(cores):  # the machine's cores
            ax.add_patch(plt.Rectangle((c, y), 0.92, 0.8, fill=False, edgecolor="gray"))
        share = -(-n * threads // cores)  # threads per core (ceil): > 1 means ranks take turns
        for rank in range(n):
            for k in range(threads):
                slot = rank * threads + k
                core, turn = slot % cores, slot // cores
                w = 0.8 / share
                x = core + 0.06 + turn * w
                color = "tab:red" if over else "tab:blue"
                ax.add_patch(plt.Rectangle((x, y + 0.12), w * 0.94, 0.56, color=color, alpha=0.8))
                name = f"rank {rank}" if share == 1 else f"r{rank}"
                ax.text(
                    x + w * 0.47, y + 0.4, name, ha="center", va="center", color="w", fontsize=8
                )
        note = (
            "oversubscribed: ranks take turns"
            if over
            else ("1-rank baseline: same budget" if n == 1 else f"{n} devices, {n}× the hardware")
        )
        ax.text(
            width + 0.2,
            y + 0.4,
            f"world size {n}: {note}",
            va="center",
            fontsize=9,
            color="tab:red" if over else "black",
        )
    ax.set_xlim(-0.1, width + 3.6)
    ax.set_ylim(-0.1, len(world_sizes))
    ax.set_xticks([c + 0.46 for c in range(cores)], [f"core {c}" for c in range(cores)])
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(
        f"One CPU rank = one device with {threads} core{'s' * (threads > 1)} "
        f"(this machine: {cores} cores)",
        fontsize=10,
    )
    return ax
