"""Lab 06's report: the tables, plots and findings of its runs (helpers.labs.lab06_runs).

Made in the kernel from the runs' data, with the student's functions passed in where the lab's
cells called them (``gradient_bytes`` checks the bytes DDP moved, ``time_to_target`` reads each
run's epochs). Findings come back as Markdown, printed from the run (helpers.findings), and count
in the notebook's family like any other.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from helpers.launcher.world import cpu_count, oversubscribed
from helpers.measure import findings
from helpers.measure.zoo import build
from helpers.workloads.models import n_params

ZOO_FORMAT = {"parameters": "{:,}", "MB/step": "{:.1f}", "step s": "{:.3f}", "step min": "{:.3f}",
              "step max": "{:.3f}", "compute s": "{:.3f}", "comm share": "{:.0%}",
              "share min": "{:.0%}", "share max": "{:.0%}"}  # fmt: skip


def _markdown(lines):
    from IPython.display import Markdown

    return Markdown("\n".join(lines))


def _ranks(n: int) -> str:
    return f"{n} ranks" + (" (oversubscribed)" if oversubscribed(n) else "")


def setup_line(world_size: int) -> str:
    """The machine, the world and the family: the set-up cell's line."""
    fam = findings.current()
    return (f"{cpu_count()} cores; {_ranks(world_size)}; {fam.expected} comparisons, each judged "
            f"at a chance of at most {fam.level:.2g}")  # fmt: skip


# -- part 1: the zoo ---------------------------------------------------------------------------


def zoo_table(zoo_runs: dict, repeats: dict, gradient_bytes, image: int, world_size: int):
    """A row per (model, ranks): parameters, the bytes DDP all-reduced per step, step time and
    compute (medians of the repeats, min–max) and the exposed communication share. Where the
    bytes DDP moved differ from the student's ``gradient_bytes`` of the model, a line says so."""
    import pandas as pd

    built = {m: build(m, image) for m in dict.fromkeys(m for m, _ in zoo_runs)}
    rows = []
    for (name, n), reps in zoo_runs.items():
        r = repeats[name, n]
        measured = sorted(set(reps[0][0]["bytes/step"]))  # what DDP all-reduced, every step
        if n > 1 and measured != [yours := gradient_bytes(built[name])]:
            print(
                f"{name}: DDP all-reduced {measured} bytes per step, your gradient_bytes says {yours:,}"
            )
        rows.append({"model": name, "ranks": n, "parameters": n_params(built[name]),
                     "MB/step": measured[0] / 1e6 if n > 1 else 0.0,
                     "step s": statistics.median(r["step"]), "step min": min(r["step"]),
                     "step max": max(r["step"]), "compute s": statistics.median(r["compute"]),
                     "comm share": statistics.median(r["share"]), "share min": min(r["share"]),
                     "share max": max(r["share"]),
                     "oversubscribed": n > 1 and oversubscribed(world_size)})  # fmt: skip
    return pd.DataFrame(rows)


def zoo_shown(table):
    """The zoo's table as the notebook shows it."""
    return table.style.format(ZOO_FORMAT)


def zoo_plot(table, world_size: int, batch: int, image: int) -> None:
    """The exposed share against the parameter count on ``world_size`` ranks, and the step time
    on one rank and on ``world_size`` (medians; bars: min–max over the repeats)."""
    import matplotlib.pyplot as plt

    dp = table[table.ranks == world_size]
    one = table[table.ranks == 1].set_index("model")
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    axes[0].errorbar(dp.parameters, dp["comm share"], fmt="o", capsize=4,
                     yerr=[dp["comm share"] - dp["share min"], dp["share max"] - dp["comm share"]])  # fmt: skip
    for _, r in dp.iterrows():
        axes[0].annotate(r["model"], (r["parameters"], r["comm share"]),
                         textcoords="offset points", xytext=(5, 5), fontsize=8)  # fmt: skip
    axes[0].set(xscale="log", xlabel="trainable parameters (log)",
                ylabel="exposed communication / step", title=_ranks(world_size))  # fmt: skip
    x = range(len(dp))
    sides = [("1 rank", one.loc[dp.model]), (f"{world_size} ranks", dp.set_index("model"))]
    for i, (label, t) in enumerate(sides):
        axes[1].bar([j + 0.4 * i for j in x], t["step s"], 0.4, label=label, capsize=3,
                    yerr=[t["step s"] - t["step min"], t["step max"] - t["step s"]])  # fmt: skip
    axes[1].set_xticks([j + 0.2 for j in x], dp.model, fontsize=8)
    axes[1].set(ylabel="seconds per step (median)", yscale="log",
                title=f"{batch} images of {image}x{image} per rank")  # fmt: skip
    axes[1].legend(fontsize=8)
    plt.tight_layout()
    plt.show()


def _share_lines(repeats: dict, params: dict, world_size: int) -> list[str]:
    """The ordering of the exposed share, and whether the separated pairs follow the parameters."""
    share_order = findings.order({m: [100 * s for s in repeats[m, world_size]["share"]] for m in params},
                                 "%", highest_first=True,
                                 what=f"exposed communication share on {world_size} ranks")  # fmt: skip
    groups = share_order.numbers["groups"]
    apart = [
        (hi, lo)
        for i, g in enumerate(groups)
        for hi in g
        for later in groups[i + 1 :]
        for lo in later
    ]
    apart += [tuple(pair) for pair in share_order.numbers["separated_inside"]]  # higher share first
    bigger = sum(params[hi] > params[lo] for hi, lo in apart)  # larger share, more parameters
    return [f"- {share_order}",
            f"- Of the {len(apart)} pairs of models this run separates, {bigger} put the larger share "
            f"on the model with more parameters and {len(apart) - bigger} on the one with fewer."
            if apart else
            "- No two models are separated: this run cannot say whether the share follows the parameter count."]  # fmt: skip


def zoo_findings(repeats: dict, table, world_size: int):
    """What this run can say about the zoo, from one value per repeat (a run's median step): a
    difference only where the repeats separate them (a rank test), otherwise "indistinguishable
    here". Markdown, in the notebook's family."""
    params = dict(zip(table.model, table.parameters, strict=True))  # every model once per world
    models = list(dict.fromkeys(m for m, _ in repeats))
    said = _share_lines(repeats, {m: params[m] for m in models}, world_size)
    for m in models:
        one, many = repeats[m, 1], repeats[m, world_size]
        sides = {"1 rank": one, f"{world_size} ranks": many}
        # repeat i on 1 rank and on world_size ranks ran one after the other: their compute pairs up
        rise = [b - a for a, b in zip(one["compute"], many["compute"], strict=True)]
        went = findings.compare({"rise in compute": rise, "exposed communication": many["exposed"]},
                                "s", better="higher",
                                what=f"where the {world_size}-rank step spent its extra time")  # fmt: skip
        said += [f"- **{m}**, 1 rank against {world_size}:",
                 f"  - {findings.compare({k: v['step'] for k, v in sides.items()}, 's', what='step time')}",
                 f"  - {findings.compare({k: v['compute'] for k, v in sides.items()}, 's', what='compute')}",
                 f"  - {went}"]  # fmt: skip
    return _markdown(said)


def repeats_for(values, d: float) -> str:
    """The run-to-run c of ``values`` and the repeats a relative difference ``d`` would take."""
    c = findings.cv(values)
    n = findings.repeats_needed(c, d)
    return (
        f"c ≈ {c:.0%}, so about {n} repeats each ({findings.LEHR_RULE})"
        if n
        else "no spread measured (one run)"
    )


def claim_repeats(repeats: dict, claim: float):
    """How noisy each zoo configuration's step time is, and the repeats telling a ``claim``
    relative difference apart would take (Lehr's rule at the family's level). Markdown."""
    return _markdown([f"- **{m}**, {n} rank(s): {findings.value(r['step'], 's')}; a {claim:.0%} "
                      f"difference: {repeats_for(r['step'], claim)}" for (m, n), r in repeats.items()])  # fmt: skip


# -- part 2: time to a target loss -------------------------------------------------------------


def _seconds_per_epoch(history) -> float:
    return statistics.median(e["seconds"] for e in history[1:])  # the first epoch warms up


def ttt_rows(runs: dict, time_to_target, target: float, world_size: int) -> list[dict]:
    """A row per (ranks, batch per rank): the epochs to the target (every repeat's, by the
    student's ``time_to_target``), the seconds to it (median, min–max), seconds per epoch and
    the first repeat's test accuracy."""
    rows = []
    for (n, b), histories in runs.items():
        hits = [time_to_target(h, target) for h in histories]
        seconds = [h[1] for h in hits if h is not None] or [float("nan")]
        rows.append({"ranks": n, "batch per rank": b, "global batch": n * b,
                     "epochs to target": ", ".join(sorted({str(h[0]) if h else "never" for h in hits})),
                     "seconds to target": statistics.median(seconds), "min": min(seconds),
                     "max": max(seconds),
                     "seconds per epoch": statistics.median(e["seconds"] for h in histories for e in h[1:]),
                     "test accuracy": histories[0][-1]["test accuracy"],
                     "oversubscribed": n > 1 and oversubscribed(world_size)})  # fmt: skip
    return rows


def ttt_shown(rows: list[dict], repeats: int):
    """The repeats taken, printed, and the table as the notebook shows it."""
    import pandas as pd

    fam = findings.current()
    need = findings.repeats_to_separate()
    print(
        f"{repeats} repeats of each configuration (the family's level, {fam.level:.2g}, needs {need} for a separation)"
    )
    return pd.DataFrame(rows).style.format(precision=3)


def ttt_plot(runs: dict, target: float) -> None:
    """The first repeat of each configuration: training loss against epochs and against seconds."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    for (n, b), histories in runs.items():
        h = histories[0]
        seconds = [sum(e["seconds"] for e in h[: i + 1]) for i in range(len(h))]
        loss = [e["train loss"] for e in h]
        axes[0].plot([e["epoch"] for e in h], loss, "o-", ms=3, label=f"{n} rank(s) x {b}")
        axes[1].plot(seconds, loss, "o-", ms=3, label=f"{n} rank(s) x {b}")
    for ax, xl in zip(axes, ("epoch", "training seconds"), strict=True):
        ax.axhline(target, color="k", ls="--", lw=0.8)
        ax.set(xlabel=xl, ylabel="training loss", yscale="log")
        ax.legend(fontsize=8)
    axes[0].set_title(f"epochs to a loss below {target}")
    axes[1].set_title("seconds to the same loss")
    plt.tight_layout()
    plt.show()


def ttt_findings(runs: dict, time_to_target, target: float, max_epochs: int):
    """Seconds per epoch (the first left out) and seconds to the target, one value per repeat,
    ordered; the configurations that never reached it named. Markdown, in the family."""
    label = {c: f"{c[0]} rank(s) x {c[1]}" for c in runs}
    per_epoch = {label[c]: [_seconds_per_epoch(h) for h in hs] for c, hs in runs.items()}
    hits = {label[c]: [time_to_target(h, target) for h in hs] for c, hs in runs.items()}
    never = [k for k, h in hits.items() if None in h]
    to_target = {k: [hit[1] for hit in h] for k, h in hits.items() if k not in never}
    said = [f"- {findings.order(per_epoch, 's', what='seconds per epoch')}"]
    if len(to_target) >= 2:
        said.append(
            f"- {findings.order(to_target, 's', what=f'seconds to a training loss below {target}')}"
        )
    elif to_target:
        said.append(
            f"- Only {', '.join(to_target)} reached the target: there is no time to target to compare."
        )
    if never:
        said.append(f"- Not below {target} within {max_epochs} epochs: {', '.join(never)}.")
    return _markdown(said)


# -- parts 3 and 4: the ViT, and gloo against NCCL ---------------------------------------------


def vit_shown(runs: dict):
    """The ViT's parameters and its epoch time on each world, printed (the spread is over one
    run's epochs, not over repeated runs: what it allows, printed); the table."""
    import pandas as pd

    from helpers.labs.lab06_runs import vit

    print(f"ViT: {n_params(vit()):,} parameters")
    epochs = {n: r["epoch seconds"][1:] for n, r in runs.items()}  # the first epoch warms up
    print(
        findings.compare(
            {f"{n} rank(s)": ep for n, ep in epochs.items()}, "s", what="ViT epoch time"
        )
    )
    rows = [{"ranks": n, "test accuracy": r["accuracy"], "train seconds": r["seconds"],
             "epoch s (median)": statistics.median(epochs[n]), "min": min(epochs[n]),
             "max": max(epochs[n]), "oversubscribed": n > 1 and oversubscribed(n)}
            for n, r in runs.items()]  # fmt: skip
    return pd.DataFrame(rows).style.format(precision=3)


def gloo_vs_nccl(runs: dict | None):
    """The ViT over gloo and NCCL (lab06_runs.backends) as a table; without the GPUs NCCL needs,
    why not, and what the seed poster reported instead (labelled: its text gives no numbers)."""
    import pandas as pd

    from helpers.labs.lab06_runs import gpus

    if runs is not None:
        return pd.DataFrame([{"backend": name, "test accuracy": r["accuracy"],
                              "epoch s (median)": statistics.median(r["epoch seconds"][1:])}
                             for name, r in runs.items()])  # fmt: skip
    print(
        f"{gpus()} GPU(s) here: NCCL runs only on CUDA tensors, one GPU per rank, so only gloo ran above."
    )
    print(
        "What the seed poster reported (Stony Brook, 2 GPUs; its text gives no numbers, its Figure 8 a chart):"
    )
    return pd.DataFrame([{"backend": "TCP (gloo)", "accuracy": "same as NCCL", "train time": "longer"},
                         {"backend": "NCCL", "accuracy": "same as gloo", "train time": "shorter"}])  # fmt: skip


# -- part 5: the sweep -------------------------------------------------------------------------


def sweep_table(results: list):
    """A row per point of the sweep, read from its JSON file only (this grid's, nothing older)."""
    import pandas as pd

    rows = []
    for p in (json.loads(Path(f).read_text()) for f in results):
        step = p["step seconds"]
        shares = [e / s for e, s in zip(p["exposed comm seconds"], step, strict=True)]
        rows.append({"world size": p["world_size"], "batch per rank": p["batch"],
                     "step s (median)": statistics.median(step), "min": min(step), "max": max(step),
                     "images/s": p["world_size"] * p["batch"] / statistics.median(step),
                     "exposed comm share": statistics.median(shares),
                     "MB/step": (p["bytes/step"] or [0])[0] / 1e6,
                     "oversubscribed": p["oversubscribed"]})  # fmt: skip
    return pd.DataFrame(rows).sort_values(["batch per rank", "world size"])


def sweep_plot(table, model: str) -> None:
    """Images per second against the per-rank batch, a line per world size."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for n, g in table.groupby("world size"):
        ax.plot(g["batch per rank"], g["images/s"], "o-", label=f"{n} rank(s)")
    ax.set(xscale="log", xlabel="batch per rank (log)", ylabel="images / s (median step)",
           title=f"{model}, from the sweep's files (one run per point: compare with care)")  # fmt: skip
    ax.legend(fontsize=8)
    plt.show()
