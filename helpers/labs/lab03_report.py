"""Lab 03's report: what its runs show (part 1's epoch times, part 2's fits on one device, DDP
and FSDP, part 4's bytes per rank), from the runs' data.

``fits`` is {setup: {(depth, width): result}} (helpers.labs.lab03_runs.fit_image, rank 0's), and
``setups`` {setup: (ranks, parallel)}, the one-device setup first. The maps for the heatmaps, the
results table, the peaks by part against one device's, and the step-time verdicts
(helpers.findings) are computed here; the notebook shows them.
"""

from __future__ import annotations

import itertools
import math
import statistics

import pandas as pd

from helpers.labs.lab03_runs import make_model
from helpers.launcher import world
from helpers.measure import findings
from helpers.measure.timing import spread
from helpers.parallel.sharding import STAGES, fsdp_shard_numel
from helpers.workloads.models import n_params

PARTS = ["parameters", "gradients", "optimizer_state", "activations", "total"]
BLOCKS = 7  # a run's timed steps in 7 blocks of consecutive steps; each block's median a sample


def name(c) -> str:
    return f"{c[0]}×{c[1]}"


def label(setups: dict, setup: str) -> str:
    n = setups[setup][0]
    return setup if n == 1 else f"{setup}, {n} devices"


def ms(r: dict, stat=statistics.median) -> float:
    return 1000 * stat(r["seconds"])


def grids(fits: dict, setups: dict, depths, widths, device_memory: str):
    """({(quantity, setup): depths × widths values, NaN where out of memory}, {quantity: unit})."""

    def grid(setup, value):
        return [[value(fits[setup][d, w]) if "seconds" in fits[setup][d, w] else math.nan
                 for w in widths] for d in depths]  # fmt: skip

    maps = {("quality", s): grid(s, lambda r: r["psnr"]) for s in setups}
    maps.update({("time", s): grid(s, ms) for s in setups})
    maps.update({("memory", s): [[fits[s][d, w]["peak"]["total"] / 1e6 for w in widths]
                                 for d in depths] for s in setups})  # fmt: skip
    units = {"quality": "PSNR (dB)", "time": "ms per step (median)",
             "memory": f"peak MB, fullest device ({device_memory} fit)"}  # fmt: skip
    return maps, units


def colour_range(maps: dict, kind: str):
    """One colour scale per quantity over every setup: (lowest, highest), or (None, None)."""
    seen = [v for (k, _), rows in maps.items() if k == kind for row in rows for v in row]
    seen = [v for v in seen if not math.isnan(v)]
    return (min(seen), max(seen)) if seen else (None, None)


def results_table(fits: dict, setups: dict, configs, n_params) -> list[dict]:
    """A row per configuration: parameters, PSNR and ms per step (min–max) in every setup."""

    def time(r):
        return f"{ms(r):.1f} ({ms(r, min):.1f}–{ms(r, max):.1f})" if "seconds" in r else "OOM"

    return [{"depth": d, "width": w, "parameters": n_params(d, w),
             **{f"PSNR, {s}": fits[s][d, w].get("psnr") for s in setups},
             **{f"ms/step, {s} (min–max)": time(fits[s][d, w]) for s in setups}}
            for d, w in configs]  # fmt: skip


def psnr_gaps(fits: dict, setups: dict, configs) -> dict:
    """{setup: the largest PSNR difference from one device's where both ran} (0.0 if none)."""
    one, *several = setups
    return {s: max((abs(fits[s][c]["psnr"] - fits[one][c]["psnr"]) for c in configs
                    if "psnr" in fits[s][c] and "psnr" in fits[one][c]), default=0.0)
            for s in several}  # fmt: skip


def out_of_memory(fits: dict, setups: dict, configs) -> str:
    """The line that names, per setup, the configurations that ran out of memory."""
    each = [f"{label(setups, s)}: " + (", ".join(name(c) for c in configs if "oom" in fits[s][c])
            or "none") for s in setups]  # fmt: skip
    return "Out of memory: " + "; ".join(each) + "."


def _span(ratio: dict) -> str:
    """The smallest and largest of {configuration: ratio}, naming where each is."""
    lo, hi = min(ratio, key=ratio.get), max(ratio, key=ratio.get)
    if f"{ratio[lo]:.2f}" == f"{ratio[hi]:.2f}":
        return f"{ratio[lo]:.2f} in every configuration"
    return f"{ratio[lo]:.2f} ({name(lo)}) to {ratio[hi]:.2f} ({name(hi)})"


def peak_ratios(fits: dict, setups: dict, configs) -> list[str]:
    """Each part of the peak under each several-device setup against one device's (bytes are
    counts, the same on every run); a part one device does not hold: against the parameters."""
    one, *several = setups
    lines = []
    for s in several:
        for p in PARTS:
            what = f"{label(setups, s)}, {p.replace('_', ' ')} at the peak"
            ratio = {c: fits[s][c]["peak"][p] / fits[one][c]["peak"][p] for c in configs
                     if fits[one][c]["peak"][p]}  # fmt: skip
            if ratio:
                lines.append(f"{what} / one device's: {_span(ratio)}")
                continue
            own = {c: fits[s][c]["peak"][p] / fits[s][c]["peak"]["parameters"] for c in configs}
            lines.append(f"{what}: none on one device; {s}'s {p.replace('_', ' ')} / its "
                         f"parameters: {_span(own)}")  # fmt: skip
    return lines


def samples(fits: dict, setup: str, c) -> list[float]:
    """ms per step: the median of each block of consecutive steps (a stray slow step, another
    process on the core, moves one block's median little instead of deciding a range)."""
    t = fits[setup][c]["seconds"]
    return [1e3 * statistics.median(t[i * len(t) // BLOCKS : (i + 1) * len(t) // BLOCKS])
            for i in range(BLOCKS)]  # fmt: skip


def step_time_verdicts(fits: dict, configs, pairs) -> dict:
    """{(a, b, c): configuration c's step time under setup a against b (a finding), or None
    where either ran out of memory}."""
    out = {}
    for a, b in pairs:
        for c in configs:
            ran = "seconds" in fits[a][c] and "seconds" in fits[b][c]
            out[a, b, c] = (findings.compare({a: samples(fits, a, c), b: samples(fits, b, c)},
                                             "ms", what=f"{name(c)} step time") if ran else None)  # fmt: skip
    return out


def word(f) -> str:
    """A verdict in a table cell: the ratio of the medians and what the samples allow."""
    if f is None:
        return "OOM"
    r = f.numbers["ratio"]
    kind = (
        "indistinguishable" if f.verdict == "indistinguishable" else "slower" if r > 1 else "faster"
    )
    return f"{r:.2f}× ({kind})"


def verdict_counts(verdicts: dict, pairs) -> list[str]:
    """Per pair of setups: how many configurations were slower, faster, indistinguishable."""
    lines = []
    for a, b in pairs:
        ran = {c: f for (a_, b_, c), f in verdicts.items() if (a_, b_) == (a, b) and f is not None}
        if not ran:
            continue
        slower, faster = (sum(f.verdict != "indistinguishable" and (f.numbers["ratio"] > 1) == up
                              for f in ran.values()) for up in (True, False))  # fmt: skip
        ratio = _span({c: f.numbers["ratio"] for c, f in ran.items()})
        lines.append(f"Step time, {a} against {b}, {len(ran)} configurations: slower in {slower}, "
                     f"faster in {faster}, indistinguishable in {len(ran) - slower - faster}; "
                     f"ratio of the medians {ratio}")  # fmt: skip
    return lines


def ratio_case(before: list, after: list, steps_ratio: float, a: int, b: int) -> str:
    """Part 1: where the epoch-time ratio from batch ``a`` to ``b`` lies against its bounds,
    as far as the repeats allow. All of a step's cost fixed: the ratio is the steps ratio; all
    arithmetic (the same per pixel at both sizes): 1. Its range from the repeats (the fastest
    and slowest pairing) is read against both."""
    low, high = min(after) / max(before), max(after) / min(before)
    ratio = statistics.median(after) / statistics.median(before)
    head = (f"batch {a} → {b}: epoch-time ratio {ratio:.2f} (the repeats allow {low:.2f}–{high:.2f}), "
            f"steps ratio {steps_ratio:.2f}: ")  # fmt: skip
    if high < steps_ratio:
        return head + ("wholly below the steps ratio: the larger batch saved more than its steps "
                       "(each pixel's arithmetic got cheaper too, or every repeat of the smaller "
                       "batch was disturbed)")  # fmt: skip
    if low > 1:
        return head + "wholly above 1: each pixel cost more at the larger batch"
    if steps_ratio <= low and high <= 1:
        fixed = (1 - ratio) / (1 - steps_ratio)
        return head + (f"between the bounds: about {fixed:.0%} of a step at batch {a} was its "
                       "fixed cost")  # fmt: skip
    crossed = ["below the steps ratio (all fixed cost)"] if low < steps_ratio else []
    crossed += ["above 1 (all arithmetic)"] if high > 1 else []
    bounds = "those bounds" if len(crossed) > 1 else "that bound"
    return head + (f"reaching {' and '.join(crossed)}: within this run's spread of {bounds}, so "
                   "the run cannot place the ratio more precisely")  # fmt: skip


# -- what the notebook shows: tables, plots and findings from the runs' data --------------------
# Each one shows what it computes (IPython's display for a table, print for a line, a figure of
# its own for a plot, which it returns: a cell ends it with ``;``), in the order the lab's cells
# showed them before they moved here.

PAIRS = [("DDP", "one device"), ("FSDP", "one device"), ("FSDP", "DDP")]


def epoch_table(times: dict, n_pixels: int):
    """Part 1: a row per batch size, its steps per epoch and its epochs' spread in seconds."""
    return pd.DataFrame([{"batch size": b, "steps": math.ceil(n_pixels / b), **spread(t)}
                         for b, t in times.items()])  # fmt: skip


def plot_epochs(by_batch, device_memory: str, n_pixels: int):
    """Part 1: seconds per epoch against the batch size, the median with min–max bars."""
    ax = by_batch.plot(x="batch size", y="median", marker="o", legend=False, capsize=3,
                       yerr=[by_batch["median"] - by_batch["min"], by_batch["max"] - by_batch["median"]],
                       ylabel="seconds per epoch",
                       title=f"One device (1 core, {device_memory}): an epoch of {n_pixels} pixels")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(by_batch["batch size"], by_batch["batch size"])
    ax.set_ylim(bottom=0)
    return ax.figure


def epoch_findings(times: dict, by_batch) -> None:
    """Part 1: each batch size against the one before it, the ratio of the epochs' medians
    beside the ratio of the steps (a table), the comparison of their repeats, where the ratio
    lies against its bounds (``ratio_case``); then the order of every size."""
    from IPython.display import display

    n_steps = dict(zip(by_batch["batch size"], by_batch["steps"], strict=True))
    steps = "steps ratio (the time ratio if a step cost the same at any batch)"
    display(pd.DataFrame([{"from batch": a, "to batch": b,
                           "epoch time ratio (medians)": statistics.median(times[b]) / statistics.median(times[a]),
                           steps: n_steps[b] / n_steps[a]}
                          for a, b in itertools.pairwise(times)]).round(2))  # fmt: skip
    for a, b in itertools.pairwise(times):
        print(
            findings.compare(
                {f"batch {b}": times[b], f"batch {a}": times[a]}, "s", what="epoch time"
            )
        )
        print(ratio_case(times[a], times[b], n_steps[b] / n_steps[a], a, b))
    print(findings.order({f"batch {b}": t for b, t in times.items()}, "s", what="epoch time"))


def heatmaps(fits: dict, setups: dict, depths, widths, device_memory: str, steps: int, heatmap):
    """Part 2: quality, time and memory over depth × width, a row per setup, one colour scale
    per quantity; ``heatmap`` draws one (helpers.plots.heatmap, a layer this one may not import)."""
    import matplotlib.pyplot as plt

    maps, units = grids(fits, setups, depths, widths, device_memory)
    fig, axes = plt.subplots(len(setups), len(units), figsize=(4.6 * len(units), 3.1 * len(setups)))
    for col, kind in enumerate(units):
        low, high = colour_range(maps, kind)  # one colour scale per quantity, in every row
        for row, s in enumerate(setups):
            heatmap(maps[kind, s], depths, widths, value_name=units[kind], ax=axes[row, col],
                    vmin=low, vmax=high)  # fmt: skip
            busy = kind == "time" and setups[s][0] > 1 and world.oversubscribed(setups[s][0])
            axes[row, col].set_title(
                f"{kind}, {label(setups, s)}" + (" OVERSUBSCRIBED" if busy else "")
            )
    fig.suptitle(f"{steps} full-image steps; each device has {device_memory} (grey: out of memory)")
    fig.tight_layout()
    return fig


def fit_results(fits: dict, setups: dict, configs) -> None:
    """Part 2: the results table, then the largest PSNR difference from one device's under
    each other setup; the same update on one device and on several must give the same image."""
    from IPython.display import display

    def params_of(d, w):
        return n_params(make_model(d, w))

    display(pd.DataFrame(results_table(fits, setups, configs, params_of)).round(2))
    for s, gap in psnr_gaps(fits, setups, configs).items():
        print(f"largest PSNR difference between one device and {label(setups, s)} where both "
              f"ran: {gap:.1e} dB")  # fmt: skip
        if not gap < 0.01:
            raise AssertionError(
                "the same update on one device and on several must give the same image"
            )


def show_images(fits: dict, configs, image: dict):
    """Part 2: the image, and FSDP's fits of the last three configurations that ran."""
    import matplotlib.pyplot as plt

    h, w = image["size"]
    shown = [(d, w_) for d, w_ in configs if "image" in fits["FSDP"][d, w_]][-3:]
    fig, axes = plt.subplots(1, len(shown) + 1, figsize=(3 * (len(shown) + 1), 2.4))
    axes[0].imshow(image["pixels"].reshape(h, w, 3))
    axes[0].set_title("the image")
    for ax, (d, w_) in zip(axes[1:], shown, strict=True):
        r = fits["FSDP"][d, w_]
        ax.imshow(r["image"])
        ax.set_title(f"{d}×{w_}: {r['psnr']:.1f} dB")
    for ax in axes:
        ax.axis("off")
    return fig


def by_part(fits: dict, setups: dict, configs, device_memory: str):
    """Part 2: each setup's peak by part on its fullest device, in MB, and whether it fitted."""
    rows = [{"depth": d, "width": w, "setup": s,
             **{p.replace("_", " "): fits[s][d, w]["peak"][p] / 1e6 for p in PARTS},
             f"fits {device_memory}": "oom" not in fits[s][d, w]}
            for d, w in configs for s in setups]  # fmt: skip
    return pd.DataFrame(rows).set_index(["depth", "width", "setup"]).round(3)


def two_devices(fits: dict, setups: dict, configs) -> None:
    """Part 2: where each model fitted; each part of the peak against one device's; the step
    time of each pair of setups, a verdict per configuration (a table) and their counts."""
    from IPython.display import display

    print(out_of_memory(fits, setups, configs))
    print("\n".join(peak_ratios(fits, setups, configs)))
    verdicts = step_time_verdicts(fits, configs, PAIRS)
    display(pd.DataFrame([{"depth": c[0], "width": c[1],
                           **{f"step time, {a} / {b}": word(verdicts[a, b, c]) for a, b in PAIRS}}
                          for c in configs]))  # fmt: skip
    print("\n".join(verdict_counts(verdicts, PAIRS)))


def state_table(predicted: dict, measured: dict, depth: int, width: int):
    """Part 4: the bytes per rank predicted for each stage beside each rank's measured ones
    (stage 2 is not measured). FSDP's (stage 3) parameters and gradients are checked here to be
    its padding of each tensor's dim 0 to a multiple of n, exactly."""
    rows = []
    for stage in (0, 1, 2, 3):
        for part in ("parameters", "gradients", "optimizer_state"):
            row = {"stage": STAGES[stage], "part": part.replace("_", " "),
                   "predicted": predicted[stage][part]}  # fmt: skip
            for rank, m in enumerate(measured.get(stage, [])):
                row[f"rank {rank}"] = m[part]
            rows.append(row)
    shapes = [tuple(p.shape) for p in make_model(depth, width).parameters()]
    numel = sum(fsdp_shard_numel(s, len(measured[3])) for s in shapes)
    if not all(m["parameters"] == m["gradients"] == 4 * numel for m in measured[3]):
        raise AssertionError(measured[3])
    table = pd.DataFrame(rows)
    return table.astype({c: "Int64" for c in table.columns if c.startswith("rank")})
