"""Lab 02's report: the timelines, tables, plots and findings its free cells show.

They read the runs of ``helpers.labs.lab02_harness`` (which run the student's ``dp_step``,
``ScratchDDP`` and ``accumulation_step``); where the student's code computes what is shown
(``epoch_bytes``, one step of ``dp_step``), it is passed in and called as the notebook called
it. Kept here so the lab's cells hold the student's task. Nothing here is graded: the checks
compute their references in ``helpers.labs.lab02``.
"""

from __future__ import annotations

from helpers.labs import lab02, lab02_harness
from helpers.measure import findings
from helpers.measure.comm import gradient_bytes
from helpers.parallel.dataparallel import ThreadDevices


def dp_timeline(dp_step, world_size: int, batch_size: int, hidden: int, depth: int) -> None:
    """Part 1: three steps of the student's DataParallel (``dp_step``) on ``world_size``
    thread-devices, the last one drawn thread by thread."""
    from helpers.parallel.dataparallel import plot_spans

    with ThreadDevices(world_size) as devs:
        model = lab02.make_model(0, hidden, depth)
        for k in range(3):  # the last of three steps is drawn
            devs.reset()
            dp_step(model, *lab02.global_batch(k, world_size * batch_size), devs)
            model.zero_grad()
        spans = list(devs.spans)
    plot_spans(
        spans, title=f"One step of your DataParallel, {world_size} thread-devices in one process"
    )


def timing(runs: dict, world_size: int) -> tuple:
    """Part 2's table from the interleaved runs of ``lab02_harness.IMPLS``, and what the repeats
    allow: the ratios of the medians, then ScratchDDP and the student's DataParallel each against
    torch DDP (two comparisons of the family)."""
    import pandas as pd

    rows, ms = lab02_harness.timing_rows(runs, world_size)
    table = pd.DataFrame(rows)
    step = table["step (ms)"]
    lines = [f"ScratchDDP / torch DDP step time: {step[1] / step[0]:.2f}; your DataParallel / torch DDP: "
             f"{step[2] / step[0]:.2f} (medians of {len(ms['torch DDP'])} repeats each)"]  # fmt: skip
    for impl in ("ScratchDDP", "your DataParallel"):
        lines.append(
            findings.compare({impl: ms[impl], "torch DDP": ms["torch DDP"]}, "ms", what="step time")
        )
    return table, lines


def plot_overlaps(runs: dict, draw) -> None:
    """Both DDPs' buckets on the time axis of one step (rank 0, the last timed step of the first
    repeat), each drawn by ``draw`` (``helpers.plots.overlap``, a layer above this package)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(8, 4.4), sharex=True)
    for ax, impl in zip(axes, lab02_harness.IMPLS[:2], strict=True):
        draw(runs[impl][0][0][-1], ax=ax)
        ax.set_title(f"{impl}: " + ax.get_title(), fontsize=9)
    plt.tight_layout()


def bytes_by_phase(measured: dict, epoch_bytes, sample_bytes: int, world_size: int) -> tuple:
    """Part 3's table: the student's ``epoch_bytes`` for each counted epoch (``measured``, by
    batch size: ``lab02_harness.counted_epoch``'s rank 0), per epoch and per step, and the line
    that says what was counted."""
    import pandas as pd

    rows = []
    for b, m in measured.items():
        per_epoch = epoch_bytes(m["samples"], sample_bytes, b, m["n_params"])
        rows += [{"batch size": b, "phase": k, "per epoch": v, "per step": v / m["steps"]}
                 for k, v in per_epoch.items()]  # fmt: skip
    first = next(iter(measured.values()))
    line = (f"rank 0 of {world_size}: {first['samples']} samples per epoch, an MLP of "
            f"{first['n_params']:,} parameters")  # fmt: skip
    return pd.DataFrame(rows).pivot(index="batch size", columns="phase"), line


def no_sync_line(run: dict, k: int = 4) -> str:
    """Part 4: what ``no_sync`` saved on one rank of ``accumulation_runs`` (k micro-batches)."""
    per_step = run["all-reduced per step"]
    return (f"with no_sync: {sum(per_step) // len(per_step):,} bytes all-reduced per step; without it, "
            f"every micro-batch's backward would all-reduce: {k * gradient_bytes(lab02.accumulation_model()):,}")  # fmt: skip


def compression_tables(rows: list[dict]) -> tuple:
    """Part 5's tables from ``lab02_harness.compression_runs``: every run, and per setting the
    test accuracy's median, min and max over the seeds."""
    import pandas as pd

    results = pd.DataFrame(rows)
    by = results.groupby(["hook", "bytes/step"], sort=False)["test accuracy"]
    return results, by.agg(["median", "min", "max"]).reset_index()


def plot_compression(summary, epochs: int, world_size: int, seeds) -> None:
    """Part 5's plot: test accuracy against bytes per step, bars from min to max over the seeds."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for row in summary.itertuples():
        ax.errorbar(row[2], row.median, yerr=[[row.median - row.min], [row.max - row.median]],
                    fmt="o", capsize=3, label=row.hook)  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("bytes all-reduced per step (log)")
    ax.set_ylabel("test accuracy")
    ax.set_title(
        f"{epochs} epochs on {world_size} ranks; bars: min-max over seeds {seeds}", fontsize=9
    )
    ax.legend(fontsize=7, loc="lower right")


def compression_findings(results) -> list:
    """Each setting against fp32: how many times fewer bytes (exact), and test accuracy only
    where the seeds separate them (one comparison of the family each)."""
    fp32 = results[results.hook == "none"]
    lines = []
    for hook, runs_of in results.groupby("hook", sort=False):
        if hook != "none":
            lines.append(
                f"{hook}: {fp32['bytes/step'].iloc[0] / runs_of['bytes/step'].iloc[0]:.1f}× fewer bytes than fp32"
            )
            lines.append("  " + str(findings.compare(
                {hook: runs_of["test accuracy"].tolist(), "fp32": fp32["test accuracy"].tolist()},
                better="higher", what="test accuracy")))  # fmt: skip
    return lines
