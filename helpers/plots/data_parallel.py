"""Lecture 02 and labs 01-02: speedup, compute against communication, overlap, a timeline of spans, the cost model against the run."""

from __future__ import annotations

from collections import defaultdict

from helpers.plots._axes import _axes

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
