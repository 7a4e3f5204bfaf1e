"""One-call plots of the course's measurements. Each returns the matplotlib Axes it drew on.

Times in seconds, sizes in bytes, bandwidth in GB/s (1 GB = 1e9 bytes), as everywhere.
"""

from __future__ import annotations

from collections import defaultdict


def _axes(ax=None, figsize=(6, 4)):
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


# The batch in a scaling run is per rank (the global batch is n times it): say so in the legend.
_GROUP_NAMES = {"batch_size": "per-rank batch"}


def speedup(rows: list[dict], time_key: str = "time", group: str | None = "batch_size", ax=None):
    """Speedup T(1)/T(n) vs workers, one line per ``group`` value, ideal dashed.

    ``rows``: dicts with 'world_size' and either 'speedup' (with optional 'speedup_lo' and
    'speedup_hi': the range the repeats allow, drawn as error bars) or ``time_key`` (seconds
    for the same work, speedup computed here). Rows marked 'oversubscribed' (more ranks than
    cores) are drawn hollow, labelled, and left off the efficiency labels: not scaling.
    """
    ax = _axes(ax)
    series = defaultdict(list)
    for r in rows:
        series[r.get(group) if group else None].append(r)
    ns = sorted({r["world_size"] for r in rows})
    ax.plot(ns, ns, "k--", label="ideal (speedup = n)")
    baseline_labelled = False
    for key, rs in sorted(series.items(), key=lambda kv: str(kv[0])):
        rs = sorted(rs, key=lambda r: r["world_size"])
        if "speedup" in rs[0]:
            sp = [r["speedup"] for r in rs]
        else:
            times = {r["world_size"]: r[time_key] for r in rs}
            base = times.get(1) or times[min(times)] * min(times)
            sp = [base / r[time_key] for r in rs]
        xs = [r["world_size"] for r in rs]
        lo = [s - r.get("speedup_lo", s) for s, r in zip(sp, rs, strict=True)]
        hi = [r.get("speedup_hi", s) - s for s, r in zip(sp, rs, strict=True)]
        label = f"{_GROUP_NAMES.get(group, group)}={key}" if group else "measured"
        bars = ax.errorbar(xs, sp, yerr=[lo, hi], fmt="o-", capsize=4, label=label)
        color = bars[0].get_color()
        for n, s, r in zip(xs, sp, rs, strict=True):
            ink = color
            if r.get("oversubscribed"):
                ax.plot([n], [s], "o", markersize=11, mfc="none", mec="red")
                text = "oversubscribed"
            elif n == 1 and s == 1.0:
                # every line's own baseline: one black label, not one per line on top of each other
                if baseline_labelled:
                    continue
                baseline_labelled, text, ink = True, "100%", "black"
            else:
                text = f"{s / n:.0%}"
            ax.annotate(
                text, (n, s), textcoords="offset points", xytext=(6, -12), fontsize=8, color=ink
            )
    if any(r.get("oversubscribed") for r in rows):
        ax.plot([], [], "o", mfc="none", mec="red", label="oversubscribed: not scaling")
    ax.set_xlabel("workers (ranks)")
    ax.set_ylabel("speedup T(1) / T(n)")
    ax.set_xticks(ns)
    ax.margins(x=0.15)  # room for the labels at the last point
    ax.set_title("Speedup, median of repeats (bars: min-max; labels: efficiency)")
    ax.legend(fontsize=8)
    return ax


def comm_bars(rows: list[dict], label: str = "world_size", ax=None):
    """Stacked bars per ``label``: compute, exposed communication, data (seconds per step)."""
    ax = _axes(ax)
    labels = [
        str(r[label]) + ("\n(oversubscribed)" if r.get("oversubscribed") else "") for r in rows
    ]
    bottom = [0.0] * len(rows)
    for key, name in (
        ("compute", "compute"),
        ("exposed_comm_s", "exposed communication"),
        ("data", "data loading"),
    ):
        vals = [r.get(key, 0.0) for r in rows]
        if any(vals):
            ax.bar(labels, vals, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xlabel(label.replace("_", " "))
    ax.set_ylabel("time per step (s)")
    ax.set_title("Where a step's time goes")
    ax.legend(fontsize=8)
    return ax


def overlap(record: dict, ax=None):
    """One DDP step on one time axis: its phases above, each bucket's all-reduce below.

    ``record``: a StepTimer record made with ``comm=`` (it keeps 'spans' and 'buckets'). A bucket
    drawn under the backward bar was hidden by it; what sticks out past backward is exposed.
    """
    import matplotlib.pyplot as plt

    ax = _axes(ax, figsize=(8, 2.2))
    t0 = record["spans"][0][1]
    colors = dict(
        zip(("data", "forward", "backward", "optimizer"), plt.cm.Pastel1.colors, strict=False)
    )
    for name, start, end in record["spans"]:
        ax.broken_barh(
            [(1e3 * (start - t0), 1e3 * (end - start))],
            (1.1, 0.8),
            facecolors=colors.get(name, "0.8"),
            edgecolor="k",
            linewidth=0.3,
        )
        ax.text(1e3 * ((start + end) / 2 - t0), 1.5, name, ha="center", va="center", fontsize=7)
    for i, (start, end) in enumerate(record.get("buckets", [])):
        ax.broken_barh(
            [(1e3 * (start - t0), 1e3 * (end - start))],
            (0.1, 0.8),
            facecolors="tab:red",
            alpha=0.5 + 0.5 * (i % 2),
            edgecolor="k",
            linewidth=0.3,
        )
    ax.set_yticks([0.5, 1.5], ["all-reduce\n(per bucket)", "compute"])
    ax.set_xlabel("time since the step began (ms)")
    exposed = record.get("exposed_comm_s", 0.0)
    comm = record.get("comm_s", 0.0)
    hidden = f"{1 - exposed / comm:.0%} hidden behind backward" if comm else "no communication"
    ax.set_title(f"One DDP step: {len(record.get('buckets', []))} buckets, {hidden}", fontsize=9)
    return ax


def busbw(records: list[dict], fits: dict | None = None, ax=None):
    """Bus bandwidth vs message size (log-log), one line per (op, world size); fitted α-β dashed.

    ``fits``: {(op, world_size): AlphaBeta}. memcpy records are drawn as the one-host limit.
    """
    from helpers.bandwidth import bus_factor

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


def timeline(rows: list[dict], ax=None):
    """One row per rank, one box per torch.distributed call (rows from helpers.trace.collect)."""
    import matplotlib.pyplot as plt

    ax = _axes(ax, figsize=(8, 0.6 + 0.5 * len({r["rank"] for r in rows})))
    ops = sorted({r["op"] for r in rows})
    colors = dict(zip(ops, plt.cm.tab10.colors, strict=False))
    for r in rows:
        width = max(r["end"] - r["start"], 1e-6)
        ax.broken_barh(
            [(r["start"], width)],
            (r["rank"] - 0.4, 0.8),
            facecolors=colors[r["op"]],
            edgecolor="k",
            linewidth=0.3,
        )
    ax.set_yticks(sorted({r["rank"] for r in rows}))
    ax.set_yticklabels([f"rank {k}" for k in sorted({r["rank"] for r in rows})])
    ax.invert_yaxis()
    ax.set_xlabel("time since the first call (s)")
    ax.set_title("torch.distributed calls per rank (a long box = waiting for the others)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[o]) for o in ops]
    ax.legend(handles, ops, fontsize=7, loc="upper right")
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


def predicted_vs_measured(predicted: list[dict], measured: list[dict], key: str = "step", ax=None):
    """Step time vs world size: the cost model's prediction against the measurement.

    Measured rows marked 'oversubscribed' are circled: ranks sharing cores, not the model's world.
    """
    ax = _axes(ax)
    for rows, style, name in (
        (measured, "o-", "measured"),
        (predicted, "s--", "predicted (α-β model)"),
    ):
        rows = sorted(rows, key=lambda r: r["world_size"])
        ax.plot([r["world_size"] for r in rows], [r[key] for r in rows], style, label=name)
    over = [r for r in measured if r.get("oversubscribed")]
    if over:
        ax.plot(
            [r["world_size"] for r in over],
            [r[key] for r in over],
            "o",
            markersize=11,
            mfc="none",
            mec="red",
            label="oversubscribed: not scaling",
        )
    ax.set_xlabel("workers (ranks)")
    ax.set_ylabel("time per step (s)")
    ax.set_xticks(sorted({r["world_size"] for r in measured + predicted}))
    ax.set_title("DDP step time: model vs measurement")
    ax.legend(fontsize=8)
    return ax


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
    2(n−1)/n·S/B). Right: busbw with the fit and its large-message limit B. Oversubscribed
    worlds are drawn hollow and named so. Returns the two Axes.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    from helpers.bandwidth import bus_factor, ring_steps

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = defaultdict(list)
    for r in records:
        series[(r["op"], r["world_size"])].append(r)
    for (op, n), rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["bytes"])
        s = np.array([r["bytes"] for r in rs], dtype=float)
        t = np.array([r["seconds"] for r in rs])
        lo = np.array([r.get("min_s", r["seconds"]) for r in rs])
        hi = np.array([r.get("max_s", r["seconds"]) for r in rs])
        over = any(r.get("oversubscribed") for r in rs)
        label = f"{op}, n={n}" + (" (oversubscribed: not n devices)" if over else "")
        face = "none" if over else None
        bar = left.errorbar(
            s,
            t * 1e3,
            yerr=[(t - lo) * 1e3, (hi - t) * 1e3],
            fmt="o",
            mfc=face,
            capsize=2,
            markersize=4,
            label=label,
        )
        color = bar[0].get_color()
        factor = bus_factor(op, n)
        right.errorbar(
            s,
            factor * s / t / 1e9,
            yerr=[factor * s * (1 / t - 1 / hi) / 1e9, factor * s * (1 / lo - 1 / t) / 1e9],
            fmt="o",
            mfc=face,
            color=color,
            capsize=2,
            markersize=4,
            label=label,
        )
        fit = (fits or {}).get((op, n))
        if fit is None:
            continue
        grid = np.geomspace(s.min(), s.max(), 60)
        steps = ring_steps(op, n)
        left.plot(grid, fit.predict(grid) * 1e3, "--", color=color, linewidth=1)
        left.plot(grid, np.full_like(grid, fit.alpha * 1e3), ":", color=color, linewidth=1)
        left.plot(grid, grid / fit.beta * 1e3, ":", color=color, linewidth=1)
        left.annotate(
            f"latency 2(n−1)α = {steps}α = {fit.alpha * 1e3:.2f} ms",
            (grid[0], fit.alpha * 1e3),
            fontsize=7,
            color=color,
            va="bottom",
        )
        right.plot(grid, factor * grid / fit.predict(grid) / 1e9, "--", color=color, linewidth=1)
        right.axhline(
            fit.busbw_gbps,
            color=color,
            linestyle=":",
            linewidth=1,
            label=f"n={n}: fit's limit B = {fit.busbw_gbps:.2f} GB/s",
        )
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
    fig.tight_layout()
    return left, right


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

    from helpers.sharding import SHARDED, STAGES

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


PIPELINE_COLORS = {"F": "tab:blue", "B": "tab:orange"}


def pipeline(events: list[dict], ax=None, title: str | None = None, unit: str = "s"):
    """Lecture 04: one pipeline step as a Gantt chart, one row per rank (= stage).

    ``events``: dicts with 'rank', 'op' ("F" forward, "B" backward), 'micro', 'start', 'end' —
    from ``helpers.pipeline.simulate`` (``unit`` = "forward passes") or ``gather_events`` of a
    live run (seconds). One box per event, labelled F0, B0 ...; the hatched grey behind each row
    is the time that rank sat idle. The title adds the idle share (``helpers.pipeline.bubble``).
    """
    import matplotlib.pyplot as plt

    from helpers.pipeline import bubble

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
                f"{e['op']}{e['micro']}",
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
    handles = [plt.Rectangle((0, 0), 1, 1, color=PIPELINE_COLORS[k]) for k in "FB"]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="0.93", hatch="///", edgecolor="0.8"))
    ax.legend(
        handles,
        ["forward", "backward", "idle"],
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


def strategies(axes=None):
    """Lecture 04: the four ways to split training over 2 ranks, one panel each.

    Each rank is a column: its layers L1–L4 (blue: kept by this rank; half-blue: half of the
    layer's weight), under them the samples it starts from (green; cut in pieces: micro-batches).
    Red arrows: what crosses the wire, and when.
    """
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 4, figsize=(15, 4.2))
    a, b, w = 0.4, 6.2, 2.4  # x of rank 0's and rank 1's columns, their width
    up, down = 0.12, -0.12  # where an arrow's text goes: over it or under it
    panels = [
        (
            "Data parallel",
            [[1] * 4, [1] * 4],
            (1, 1),
            ("half the batch", "the other half"),
            [("<->", 2.85, "all-reduce all\ngradients, once\nper step, after\nbackward", up)],
            "each rank: the whole model,\nits share of the batch",
        ),
        (
            "Model parallel (naive)",
            [[1, 1, 0, 0], [0, 0, 1, 1]],
            (1, 0),
            ("the batch", ""),
            [
                ("->", 3.2, "activations\n(forward)", up),
                ("<-", 2.5, "their gradients\n(backward)", down),
            ],
            "each rank: some layers;\nonly one rank works at a time",
        ),
        (
            "Pipeline parallel",
            [[1, 1, 0, 0], [0, 0, 1, 1]],
            (4, 0),
            ("4 micro-batches", ""),
            [
                ("->", 3.2, "activations,\nper micro-batch", up),
                ("<-", 2.5, "gradients,\nper micro-batch", down),
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
                    up,
                )
            ],
            "each rank: half of every weight\nmatrix; the same samples",
        ),
    ]
    for ax, (name, held, pieces, texts, arrows, note) in zip(axes, panels, strict=True):
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
            ax.text(
                (a + w + b) / 2,
                y + side,
                text,
                ha="center",
                fontsize=7,
                color="tab:red",
                va="bottom" if side > 0 else "top",
            )
        ax.text((a + b + w) / 2, -1.0, note, ha="center", va="center", fontsize=8)
        ax.set_xlim(-0.4, b + w + 0.6)
        ax.set_ylim(-1.6, 5.6)
        ax.set_axis_off()
        ax.set_title(name, fontsize=10)
    return axes


def mesh(shape: tuple, names: tuple, ax=None):
    """Lecture 04: ranks on a device mesh, numbered as ``init_device_mesh(shape)`` numbers them.

    2 dims (e.g. ("dp", "tp")): a grid; the ranks of one row form a group of the last dim
    (blue frame), those of one column a group of the first (orange frame). 3 dims (e.g.
    ("pp", "dp", "tp")): one grid per index of the first dim, side by side, joined by arrows
    (pipeline stages pass activations to the next grid's rank in the same place).
    """
    import matplotlib.pyplot as plt
    import numpy as np

    if len(shape) not in (2, 3) or len(names) != len(shape):
        raise ValueError(f"draws 2 or 3 dimensions with a name each, not {shape} / {names}")
    ranks = np.arange(int(np.prod(shape))).reshape(shape)  # row-major, as init_device_mesh
    blocks = [ranks] if len(shape) == 2 else list(ranks)
    rows, cols = blocks[0].shape
    ax = _axes(ax, figsize=(1.6 + 1.9 * cols * len(blocks), 0.9 + 1.1 * rows))
    gap = cols + 1.2
    for k, block in enumerate(blocks):
        x0 = k * gap
        for i in range(rows):
            for j in range(cols):
                y = rows - 1 - i
                ax.add_patch(
                    plt.Rectangle(
                        (x0 + j + 0.1, y + 0.1), 0.8, 0.8, color="tab:gray", alpha=0.8, gid="rank"
                    )
                )
                ax.text(
                    x0 + j + 0.5,
                    y + 0.5,
                    f"rank {block[i, j]}",
                    ha="center",
                    va="center",
                    color="w",
                    fontsize=8,
                )
            ax.add_patch(
                plt.Rectangle(
                    (x0 + 0.03, rows - 1 - i + 0.03),
                    cols - 0.06,
                    0.94,
                    fill=False,
                    edgecolor="tab:blue",
                    lw=1.5,
                )
            )
        for j in range(cols):
            ax.add_patch(
                plt.Rectangle(
                    (x0 + j + 0.06, 0.0),
                    0.88,
                    rows,
                    fill=False,
                    edgecolor="tab:orange",
                    lw=1.5,
                    linestyle="--",
                )
            )
        if len(blocks) > 1:
            ax.text(x0 + cols / 2, rows + 0.15, f"{names[0]} = {k}", ha="center", fontsize=9)
            if k:
                ax.annotate(
                    "",
                    xy=(x0 - 0.05, rows / 2),
                    xytext=(x0 - 1.15, rows / 2),
                    arrowprops={"arrowstyle": "->", "color": "tab:green", "lw": 1.5},
                )
    handles = [
        plt.Line2D([], [], color="tab:blue", lw=1.5),
        plt.Line2D([], [], color="tab:orange", lw=1.5, linestyle="--"),
    ]
    labels = [f"a {names[-1]} group (one row)", f"a {names[-2]} group (one column)"]
    if len(blocks) > 1:
        handles.append(plt.Line2D([], [], color="tab:green", lw=1.5))
        labels.append(f"{names[0]}: send/recv to the next stage")
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_xlim(-0.2, len(blocks) * gap - 1.0)
    ax.set_ylim(-0.2, rows + 0.6)
    ax.set_aspect("equal")
    ax.set_axis_off()
    ax.set_title(
        f"init_device_mesh(shape={tuple(shape)}, mesh_dim_names={tuple(names)})", fontsize=9
    )
    return ax


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
