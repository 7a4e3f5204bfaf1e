"""Lab 05's report: the tables, plots and findings of its runs, from the rows of
helpers.labs.lab05_runs (one per run: method, global batch, seed, accuracies, curves, failed).

Every verdict goes through helpers.findings and counts in the notebook's family; the findings
come back as Markdown (``display(*...)`` shows them, each with its record for ``course compare``).
The comparisons made here are the few the lab's questions rest on, so that a family of them
can separate with few seeds: part 1 one, part 2 three, part 3 one per batch it scales, part 4
two at each of the two largest batches; the tables show every other difference as ranges.
"""

from __future__ import annotations

import itertools

from helpers.measure import findings

METHODS = ("fixed lr", "scaled lr", "scaled + warmup", "LARS + warmup")


def accuracies(rows: list[dict], method: str, batch: int, key: str = "test accuracy") -> list:
    """One value per seed: ``key`` of ``method``'s runs at ``batch``."""
    return [r[key] for r in rows if r["method"] == method and r["global batch"] == batch]


def _markdown(text: str):
    from IPython.display import Markdown

    return Markdown(text)


def repeats_line(family, seeds, repeats: int) -> str:
    """The family's level, and whether the seeds and part 1's repeats can separate at it."""
    need = findings.repeats_to_separate()
    lines = [f"{family.expected} comparisons declared: each is judged at a chance of at most "
             f"{family.level:.2g}, which takes at least {need} repeats on each side"]  # fmt: skip
    for what, have in (("the sweeps' seeds", len(seeds)), ("part 1's timing repeats", repeats)):
        lines.append(f"{what}: {have}" + ("" if have >= need else
                     f", too few to separate anything in this family (their verdicts read "
                     f"indistinguishable); {need} would take {need / have:.1f}x the time"))  # fmt: skip
    return "\n".join(lines)


# -- part 1 ---------------------------------------------------------------------------------------


def same_update(one: dict, ranks: dict, world_size: int, gradient_bytes: int, batch: int = 128):
    """The table of part 1's check: each run on ranks ({(micro, k): first_steps' result}) against
    one process on the whole batch (``one``). Raises AssertionError where the weights differ
    beyond rounding or DDP all-reduced other than the gradient once per step."""
    import pandas as pd

    rows = [{"run": f"1 process, 1 x {batch} (the reference)", "max |difference|": 0.0,
             "all-reduced bytes/step": 0}]  # fmt: skip
    for (micro, k), r in ranks.items():
        diff = max((r["state"][n] - p).abs().max().item() for n, p in one["state"].items())
        rows.append({"run": f"{world_size} ranks, {k} x {micro}", "max |difference|": diff,
                     "all-reduced bytes/step": r["bytes/step"]})  # fmt: skip
        if not diff < 1e-5:
            raise AssertionError(f"{rows[-1]} differs from one process")
        if r["bytes/step"] != gradient_bytes:
            raise AssertionError(f"{rows[-1]}: the gradient is {gradient_bytes} bytes, once a step")
    return (pd.DataFrame(rows).style.set_caption(f"gradient: {gradient_bytes:,} bytes")
            .format({"max |difference|": "{:.1e}", "all-reduced bytes/step": "{:,.0f}"}))  # fmt: skip


def label(micro: int, batch: int, world_size: int) -> str:
    return f"{micro} x {batch // (world_size * micro)}"


def timing_table(times: dict, batch: int, world_size: int, oversubscribed: bool = False):
    """An epoch's seconds per micro-batch (median, min, max over the repeats)."""
    import pandas as pd

    from helpers.measure.timing import spread

    table = pd.DataFrame([{"micro-batch": m, "k": batch // (world_size * m),
                           **spread(t)} for m, t in times.items()])  # fmt: skip
    busy = " (oversubscribed: more ranks than cores)" if oversubscribed else ""
    return (table.drop(columns="n").style.set_caption(f"global batch {batch} on {world_size} ranks{busy}")
            .format({"median": "{:.3f} s", "min": "{:.3f} s", "max": "{:.3f} s"}))  # fmt: skip


def timing_findings(times: dict, batch: int, world_size: int) -> list:
    """The largest micro-batch against the smallest: what the fewest micro-batches save."""
    big, small = max(times), min(times)
    return [findings.compare({label(big, batch, world_size): times[big],
                              label(small, batch, world_size): times[small]},
                             "s", what="epoch time (micro-batch x k)")]  # fmt: skip


# -- parts 2-4 ------------------------------------------------------------------------------------


def table(rows: list[dict]):
    """Per method and global batch: steps, micro x k, median train accuracy, test accuracy's
    median, min and max over the seeds, and how many runs failed."""
    import pandas as pd

    return (pd.DataFrame(rows).groupby(["method", "global batch"], sort=False)
            .agg(steps=("steps", "first"), micro_x_k=("micro x k", "first"),
                 train_accuracy=("train accuracy", "median"),
                 accuracy_median=("test accuracy", "median"), accuracy_min=("test accuracy", "min"),
                 accuracy_max=("test accuracy", "max"), failed=("failed", "sum"))
            .reset_index().style.format(precision=3))  # fmt: skip


def batch_findings(fixed: list[dict], batch_sizes) -> list:
    """Part 2 at the fixed rate: test and training accuracy, the smallest batch against the
    largest; training against test accuracy at the largest (under-trained, or over-fitted)."""
    small, big = batch_sizes[0], batch_sizes[-1]

    def at(batch, key="test accuracy"):
        return accuracies(fixed, "fixed lr", batch, key)

    return [
        findings.compare({f"batch {small}": at(small), f"batch {big}": at(big)},
                         better="higher", what="test accuracy, fixed lr"),
        findings.compare({f"batch {small}": at(small, "train accuracy"),
                          f"batch {big}": at(big, "train accuracy")},
                         better="higher", what="training accuracy, fixed lr"),
        findings.compare({"train": at(big, "train accuracy"), "test": at(big)},
                         better="higher", what=f"accuracy at batch {big}, fixed lr"),
    ]  # fmt: skip


def failed_runs(rows: list[dict]) -> str:
    lost = [
        f"{r['method']} at batch {r['global batch']}, seed {r['seed']}" for r in rows if r["failed"]
    ]
    return "Runs that failed to train: " + ("; ".join(lost) if lost else "none") + "."


def schedule_findings(rows: list[dict], batches) -> list:
    """Part 3 at each of ``batches``: scaled + warmup against scaled lr (what warmup adds to the
    rule); then every scaled run that failed to train."""
    out = [findings.compare({"scaled + warmup": accuracies(rows, "scaled + warmup", b),
                             "scaled lr": accuracies(rows, "scaled lr", b)},
                            better="higher", what=f"test accuracy at batch {b}")
           for b in batches]  # fmt: skip
    scaled = [r for r in rows if r["method"] in ("scaled lr", "scaled + warmup")]
    return out + [_markdown(failed_runs(scaled))]


def _shares(rows: list[dict], batch: int, small: int) -> list:
    """Per method, the share of the accuracy fixed lr lost at ``batch`` (against ``small``) that
    it won back, seed by seed (described, not tested)."""
    first = {
        r["seed"]: r["test accuracy"]
        for r in rows
        if r["method"] == "fixed lr" and r["global batch"] == small
    }
    fixed = {
        r["seed"]: r["test accuracy"]
        for r in rows
        if r["method"] == "fixed lr" and r["global batch"] == batch
    }
    if not all(first[s] > fixed[s] for s in fixed):
        return [_markdown(f"At batch {batch} fixed lr lost no accuracy against batch {small} on "
                          "some seed: nothing to win back.")]  # fmt: skip
    out = []
    for m in METHODS[1:]:
        got = {
            r["seed"]: r["test accuracy"]
            for r in rows
            if r["method"] == m and r["global batch"] == batch
        }
        if not got:  # a method this run did not train at this batch
            continue
        won = [100 * (got[s] - fixed[s]) / (first[s] - fixed[s]) for s in fixed]
        out.append(
            findings.value(
                won, "%", f"{m} at batch {batch}, share of fixed lr's lost accuracy won back"
            )
        )
    return out


def lars_findings(rows: list[dict], batch_sizes, lars_lr: float, trust: float) -> list:
    """Part 4 at the two largest batches: LARS against fixed lr and against scaled + warmup; the
    share of fixed lr's lost accuracy each method won back; and how each one's rate was chosen."""
    out = []
    for b in batch_sizes[-2:]:
        lars = accuracies(rows, "LARS + warmup", b)
        for other in ("fixed lr", "scaled + warmup"):
            out.append(findings.compare({"LARS + warmup": lars, other: accuracies(rows, other, b)},
                                        better="higher", what=f"test accuracy at batch {b}"))  # fmt: skip
        out += _shares(rows, b, batch_sizes[0])
    big = batch_sizes[-1]
    rates = [
        r["curve"][-1]["lr"]
        for r in rows
        if r["method"] == "scaled lr" and r["global batch"] == big
    ]
    peak = f"up to {max(rates):g} at batch {big}" if rates else f"at batch {big}"
    return out + [_markdown(
        f"Tuning: LARS ran at lr {lars_lr} and trust {trust}, chosen for this lab; SGD only at the "
        f"linear rule's rate ({peak}), with and without warmup, untuned.")]  # fmt: skip


# -- plots ----------------------------------------------------------------------------------------


def plot_losses(fixed: list[dict], seeds, base_lr: float, epochs: int, axes) -> None:
    """Part 2, on two ``axes``: every seed's training loss against epochs, then against the
    optimizer steps (every step's loss on its global batch, a running mean); a colour per batch."""
    import matplotlib.pyplot as plt
    import pandas as pd

    batches = sorted({r["global batch"] for r in fixed})
    palette = itertools.cycle(plt.rcParams["axes.prop_cycle"].by_key()["color"])
    colours = dict(zip(batches, palette, strict=False))
    by_epoch, by_step = axes
    for r in fixed:  # every seed: one colour per batch
        b = r["global batch"]
        name = f"batch {b}" if r["seed"] == seeds[0] else None
        by_epoch.plot([e["epoch"] for e in r["curve"]], [e["train loss"] for e in r["curve"]], "o-",
                      color=colours[b], lw=1, ms=3, label=name)  # fmt: skip
        window = max(1, len(r["losses"]) // 25)  # a running mean: one step's loss is noisy
        smooth = pd.Series(r["losses"]).rolling(window, min_periods=1).mean()
        by_step.plot(range(1, len(smooth) + 1), smooth, color=colours[b], lw=1, label=name)
    by_epoch.set(
        xlabel="epoch",
        ylabel="training loss (mean over the epoch)",
        yscale="log",
        xticks=range(1, epochs + 1),
        title=f"fixed lr = {base_lr}, one line per seed {list(seeds)}",
    )
    by_step.set(xlabel="optimizer step (log)", ylabel="training loss (running mean)", xscale="log",
                yscale="log", title="the same runs, step by step")  # fmt: skip
    by_epoch.legend(fontsize=8)
    by_step.legend(fontsize=8)
