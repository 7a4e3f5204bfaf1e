"""Lecture 04 and lab 04: pipeline schedules, what each strategy splits, a device mesh."""

from __future__ import annotations

from helpers.plots._axes import _axes

# F forward, B backward (input gradient in ZB-H1), W the weight gradient ZB-H1 delays
PIPELINE_COLORS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}


def pipeline(events: list[dict], ax=None, title: str | None = None, unit: str = "s"):
    """Lecture 04: one pipeline step as a Gantt chart, one row per rank (= stage).

    ``events``: dicts with 'rank', 'op' ("F" forward, "B" backward, "W" weight gradient),
    'micro', 'start', 'end' (and 'chunk' for the interleaved schedule, labelled F0.1: micro 0,
    chunk 1) —
    from ``helpers.pipeline.simulate`` (``unit`` = "forward passes") or ``gather_events`` of a
    live run (seconds). One box per event, labelled F0, B0 ...; the hatched grey behind each row
    is the time that rank sat idle. The title adds the idle share (``helpers.pipeline.bubble``).
    """
    import matplotlib.pyplot as plt

    from helpers.parallel.pipeline import bubble

    ranks = sorted({e["rank"] for e in events})
    ax = _axes(ax, figsize=(8, 0.8 + 0.55 * len(ranks)))
    t0 = min(e["start"] for e in events)
    span = max(e["end"] for e in events) - t0
    for r in ranks:  # drawn first, so only the gaps between the boxes show it: idle time
        ax.barh(
            r, span, left=t0, height=0.8, color="0.93", hatch="///", edgecolor="0.8", gid="idle"
        )
    for e in events:
        width = e["end"] - e["start"]
        ax.barh(
            e["rank"],
            width,
            left=e["start"],
            height=0.8,
            color=PIPELINE_COLORS[e["op"]],
            edgecolor="k",
            linewidth=0.4,
            gid="event",
        )
        if width > 0.012 * span:  # a label only where it fits
            size = 8 if width > 0.04 * span else 6
            ax.text(
                e["start"] + width / 2,
                e["rank"],
                f"{e['op']}{e['micro']}" + (f".{e['chunk']}" if "chunk" in e else ""),
                ha="center",
                va="center",
                fontsize=size,
                color="w",
            )
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()  # rank 0 (the first stage) on top, as in the papers' figures
    ax.set_xlim(t0, t0 + span)
    ax.set_xlabel(f"time ({unit})")
    head = f"{title}: " if title else ""
    ax.set_title(f"{head}idle {bubble(events):.0%} of the ranks' time", fontsize=9)
    ops = [k for k in PIPELINE_COLORS if any(e["op"] == k for e in events)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=PIPELINE_COLORS[k]) for k in ops]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="0.93", hatch="///", edgecolor="0.8"))
    names = {"F": "forward", "B": "backward", "W": "weight gradient"}
    if "W" in ops:  # split backward: B is the input's gradient only
        names["B"] = "backward (input gradient)"
    ax.legend(
        handles,
        [names[k] for k in ops] + ["idle"],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
    )
    return ax


def _layers(ax, x, y, held, n_layers=4, width=2.4, label="", names_right=False):
    """One rank's column in ``strategies``: its layers stacked (``held`` = the part of each
    layer it keeps: 1 whole, "left"/"right" a half, 0 none) and a label over it. The layer
    names go on the outer side (``names_right``), leaving the gap between ranks to the arrows."""
    import matplotlib.pyplot as plt

    for k in range(n_layers):
        part = held[k]
        yk = y + 0.9 * k
        ax.add_patch(plt.Rectangle((x, yk), width, 0.7, fill=False, edgecolor="0.6"))
        if part:
            left = x + (width / 2 if part == "right" else 0)
            w = width if part == 1 else width / 2
            ax.add_patch(plt.Rectangle((left, yk), w, 0.7, color="tab:blue", alpha=0.8))
        tx, ha = (x + width + 0.15, "left") if names_right else (x - 0.15, "right")
        ax.text(tx, yk + 0.35, f"L{k + 1}", ha=ha, va="center", fontsize=7)
    ax.text(x + width / 2, y + 0.9 * n_layers + 0.1, label, ha="center", fontsize=8)


def _batch(ax, x, y, pieces, width=2.4, text=""):
    """The samples a rank starts from, as ``pieces`` boxes (micro-batches when more than one)."""
    import matplotlib.pyplot as plt

    w = width / pieces
    for k in range(pieces):
        ax.add_patch(plt.Rectangle((x + k * w, y), w * 0.92, 0.6, color="tab:green", alpha=0.7))
    ax.text(x + width / 2, y - 0.35, text, ha="center", va="center", fontsize=7)


_UP, _DOWN = 0.12, -0.12  # where an arrow's text goes: over it or under it
# strategies' panels: name, each rank's layers (as _layers' held), its batch's pieces and
# text, the arrows between the ranks (style, y, text, side) and the note under the panel
_STRATEGIES = (
    (
        "Data parallel",
        [[1] * 4, [1] * 4],
        (1, 1),
        ("half the batch", "the other half"),
        [("<->", 2.85, "all-reduce all\ngradients, once\nper step, after\nbackward", _UP)],
        "each rank: the whole model,\nits share of the batch",
    ),
    (
        "Model parallel (naive)",
        [[1, 1, 0, 0], [0, 0, 1, 1]],
        (1, 0),
        ("the batch", ""),
        [
            ("->", 3.2, "activations\n(forward)", _UP),
            ("<-", 2.5, "their gradients\n(backward)", _DOWN),
        ],
        "each rank: some layers;\nonly one rank works at a time",
    ),
    (
        "Pipeline parallel",
        [[1, 1, 0, 0], [0, 0, 1, 1]],
        (4, 0),
        ("4 micro-batches", ""),
        [
            ("->", 3.2, "activations,\nper micro-batch", _UP),
            ("<-", 2.5, "gradients,\nper micro-batch", _DOWN),
        ],
        "each rank: some layers; micro-batches\nkeep both ranks busy (mostly)",
    ),
    (
        "Tensor parallel",
        [["left"] * 4, ["right"] * 4],
        (1, 1),
        ("the same batch", "the same batch"),
        [
            (
                "<->",
                2.85,
                "all-reduce\nactivations in\nevery MLP: once\nforward, once\nbackward",
                _UP,
            )
        ],
        "each rank: half of every weight\nmatrix; the same samples",
    ),
)


def strategies(axes=None):
    """Lecture 04: the four ways to split training over 2 ranks, one panel each.

    Each rank is a column: its layers L1–L4 (blue: kept by this rank; half-blue: half of the
    layer's weight), under them the samples it starts from (green; cut in pieces: micro-batches).
    Red arrows: what crosses the wire, and when.
    """
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 4, figsize=(15, 4.2))
    for ax, panel in zip(axes, _STRATEGIES, strict=True):
        _strategy(ax, *panel)
    return axes


def _strategy(ax, name: str, held, pieces, texts, arrows, note: str) -> None:
    """One panel of ``strategies``: the two ranks' columns, the arrows between them, the note."""
    a, b, w = 0.4, 6.2, 2.4  # x of rank 0's and rank 1's columns, their width
    for x, h, n, t, r in zip((a, b), held, pieces, texts, (0, 1), strict=True):
        _layers(ax, x, 1.2, h, width=w, label=f"rank {r}", names_right=r == 1)
        if n:
            _batch(ax, x, 0.1, n, width=w, text=t)
    for style, y, text, side in arrows:
        ax.annotate(
            "",
            xy=(b - 0.1, y),
            xytext=(a + w + 0.1, y),
            arrowprops={"arrowstyle": style, "color": "tab:red", "lw": 1.5},
        )
        va = "bottom" if side > 0 else "top"
        ax.text((a + w + b) / 2, y + side, text, ha="center", fontsize=7, color="tab:red", va=va)
    ax.text((a + b + w) / 2, -1.0, note, ha="center", va="center", fontsize=8)
    ax.set_xlim(-0.4, b + w + 0.6)
    ax.set_ylim(-1.6, 5.6)
    ax.set_axis_off()
    ax.set_title(name, fontsize=10)


def mesh(shape: tuple, names: tuple, ax=None):
    """Lecture 04: ranks on a device mesh, numbered as ``init_device_mesh(shape)`` numbers them.

    2 dims (e.g. ("dp", "tp")): a grid; the ranks of one row form a group of the last dim
    (blue frame), those of one column a group of the first (orange frame). 3 dims (e.g.
    ("pp", "dp", "tp")): one grid per index of the first dim, side by side, joined by arrows
    (pipeline stages pass activations to the next grid's rank in the same place).
    """
    import numpy as np

    if len(shape) not in (2, 3) or len(names) != len(shape):
        raise ValueError(f"draws 2 or 3 dimensions with a name each, not {shape} / {names}")
    ranks = np.arange(int(np.prod(shape))).reshape(shape)  # row-major, as init_device_mesh
    blocks = [ranks] if len(shape) == 2 else list(ranks)
    rows, cols = blocks[0].shape
    ax = _axes(ax, figsize=(1.6 + 1.9 * cols * len(blocks), 0.9 + 1.1 * rows))
    gap = cols + 1.2
    for k, block in enumerate(blocks):
        _mesh_block(ax, block, k * gap)
        if len(blocks) > 1:
            ax.text(k * gap + cols / 2, rows + 0.15, f"{names[0]} = {k}", ha="center", fontsize=9)
        if k:  # a pipeline stage passes its activations on to the next grid
            ax.annotate(
                "",
                xy=(k * gap - 0.05, rows / 2),
                xytext=(k * gap - 1.15, rows / 2),
                arrowprops={"arrowstyle": "->", "color": "tab:green", "lw": 1.5},
            )
    _mesh_legend(ax, names, stages=len(blocks) > 1)
    ax.set_xlim(-0.2, len(blocks) * gap - 1.0)
    ax.set_ylim(-0.2, rows + 0.6)
    ax.set_aspect("equal")
    ax.set_axis_off()
    ax.set_title(
        f"init_device_mesh(shape={tuple(shape)}, mesh_dim_names={tuple(names)})", fontsize=9
    )
    return ax


def _mesh_block(ax, block, x0: float) -> None:
    """One grid of ``mesh`` at x = ``x0``: a box per rank, each row's group framed in blue and
    each column's in dashed orange."""
    import matplotlib.pyplot as plt

    rows, cols = block.shape
    for i in range(rows):
        y = rows - 1 - i
        for j in range(cols):
            box = plt.Rectangle((x0 + j + 0.1, y + 0.1), 0.8, 0.8, color="tab:gray", alpha=0.8)
            box.set_gid("rank")
            ax.add_patch(box)
            rank = f"rank {block[i, j]}"
            ax.text(x0 + j + 0.5, y + 0.5, rank, ha="center", va="center", color="w", fontsize=8)
        frame = {"fill": False, "edgecolor": "tab:blue", "lw": 1.5}
        ax.add_patch(plt.Rectangle((x0 + 0.03, y + 0.03), cols - 0.06, 0.94, **frame))
    for j in range(cols):
        frame = {"fill": False, "edgecolor": "tab:orange", "lw": 1.5, "linestyle": "--"}
        ax.add_patch(plt.Rectangle((x0 + j + 0.06, 0.0), 0.88, rows, **frame))


def _mesh_legend(ax, names: tuple, stages: bool) -> None:
    """What ``mesh``'s frames (and arrows, with ``stages``) mean."""
    import matplotlib.pyplot as plt

    handles = [
        plt.Line2D([], [], color="tab:blue", lw=1.5),
        plt.Line2D([], [], color="tab:orange", lw=1.5, linestyle="--"),
    ]
    labels = [f"a {names[-1]} group (one row)", f"a {names[-2]} group (one column)"]
    if stages:
        handles.append(plt.Line2D([], [], color="tab:green", lw=1.5))
        labels.append(f"{names[0]}: send/recv to the next stage")
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
