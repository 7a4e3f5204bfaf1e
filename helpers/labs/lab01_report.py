"""Lab 01's report: the tables, plots and findings its free cells show, from the runs' data.

``runs`` is ``helpers.scaling.interleave``'s {(world size, per-rank batch): [each repeat's
``lab01_harness.run_config``, every rank's]}; part 1's ``one_device`` is {batch: [each repeat's
rank-0 run]}. Where the student's code reads a run (``ring_bytes_per_rank``), it is passed in and
called as the notebook called it. Nothing here is graded: the checks compute their references in
``helpers.labs.lab01``.
"""

from __future__ import annotations

import math

from helpers.measure import findings, scaling, timing


def budget_line(n: int, budgets: list[dict]) -> str:
    """Part 0: each rank's threads and cores in a world of ``n`` (``world.budget`` on every rank)."""
    ranks = ", ".join(
        f"rank {r}: {b['threads']} thread(s) on cores {b['cores']}" for r, b in enumerate(budgets)
    )
    return f"world size {n}: {ranks}" + (
        "  (oversubscribed)" if budgets[0]["oversubscribed"] else ""
    )


def doublings(largest: int | None, start: int = 32) -> list[int]:
    """start, 2·start, ... up to ``largest`` (none if nothing fits): part 1's batch sizes."""
    return [start * 2**k for k in range(int(math.log2(largest // start)) + 1)] if largest else []


def _epochs(rs: list, n_train: int, bs: int, warmup: int) -> list[float]:
    """Each one-device repeat's epoch time at batch ``bs`` (seconds)."""
    return [scaling.epoch_seconds(scaling.step_seconds([run["timing"]], skip=warmup), n_train, bs, 1)
            for run in rs]  # fmt: skip


def by_batch(one_device: dict, n_train: int, warmup: int):
    """Part 1's table: per batch size the epoch time's median, min and max over the repeats."""
    import pandas as pd

    rows = []
    for bs, rs in one_device.items():
        spread = timing.spread(scaling.step_seconds([run["timing"]], skip=warmup) for run in rs)
        rows.append({"batch size": bs, **{k: scaling.epoch_seconds(v, n_train, bs, 1)
                                          for k, v in spread.items() if k != "n"}})  # fmt: skip
    return pd.DataFrame(rows)


def batch_order(one_device: dict, n_train: int, warmup: int):
    """What the repeats allow: the batch sizes ordered by epoch time (each pair a comparison)."""
    epochs = {f"batch {bs}": _epochs(rs, n_train, bs, warmup) for bs, rs in one_device.items()}
    return findings.order(epochs, "s", what="epoch time")


def plot_by_batch(table, memory_budget: str):
    """Part 1's plot: epoch time against batch size on one device, bars from min to max."""
    ax = table.plot(x="batch size", y="median", marker="o", ylabel="seconds per epoch (compute)",
                    legend=False, capsize=3,
                    yerr=[[table["median"] - table["min"], table["max"] - table["median"]]],
                    title=f"One device ({memory_budget}, 1 core): epoch time vs batch size (bars: min-max)")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(table["batch size"], table["batch size"])
    ax.set_ylim(bottom=0)
    return ax


def epoch_times(runs: dict, n_train: int, warmup: int) -> dict:
    """{(world size, per-rank batch): each repeat's epoch time}: a step lasts as long as its
    slowest rank, an epoch of ``n_train`` samples is n_train / (n·b) steps."""
    return {(ws, bs): [scaling.epoch_seconds(scaling.step_seconds([r["timing"] for r in run], skip=warmup),
                                             n_train, bs, ws) for run in repeats]
            for (ws, bs), repeats in runs.items()}  # fmt: skip


def runs_line(runs: dict, oversubscribed: dict) -> str:
    """How many configurations and repeats ran, naming the oversubscribed ones."""
    repeats = len(next(iter(runs.values())))
    over = [f"n={ws} b={bs}" for (ws, bs), o in oversubscribed.items() if o]
    return f"{len(runs)} configurations × {repeats} repeats done" + (
        "; oversubscribed: " + ", ".join(over) if over else ""
    )


def scaling_findings(epoch_times: dict, oversubscribed: dict) -> list:
    """Each world against one rank at the same per-rank batch, by epoch time (one comparison of
    the family each), the oversubscribed ones marked."""
    lines = []
    for ws, bs in sorted(epoch_times):
        if ws > 1 and (1, bs) in epoch_times:
            mark = " (oversubscribed)" if oversubscribed[(ws, bs)] else ""
            lines.append(findings.compare({"1 rank": epoch_times[1, bs], f"{ws} ranks": epoch_times[ws, bs]}, "s",
                                          what=f"epoch time at per-rank batch {bs}{mark}"))  # fmt: skip
    return lines


def comm_rows(runs: dict, warmup: int, oversubscribed: dict, ring_bytes_per_rank) -> list[dict]:
    """Part 5's table: per configuration, rank 0's step by phase (medians over the repeats), the
    bytes DDP all-reduced, the wire bytes the student's ``ring_bytes_per_rank`` gives for them,
    and the bandwidth those bytes achieved over the communication time."""
    rows = []
    for ws, bs in runs:
        per_repeat = [timing.median_step(run[0]["timing"], skip=warmup) for run in runs[(ws, bs)]]

        def med(key, per_repeat=per_repeat):
            return timing.spread(m.get(key, 0.0) for m in per_repeat)["median"]

        comm_s, sent = med("comm_s"), med("comm_bytes")
        wire = ring_bytes_per_rank(sent, ws)
        step = timing.spread(m["total"] for m in per_repeat)
        hidden = (
            timing.overlap_fraction(runs[(ws, bs)][0][0]["timing"], skip=warmup) if ws > 1 else None
        )
        rows.append({"world_size": ws, "batch_size": bs, "step (s)": step["median"], "step min": step["min"],
                     "step max": step["max"], "compute": med("compute"),
                     "exposed_comm_s": med("exposed_comm_s"), "comm_s": comm_s, "hidden": hidden,
                     "bytes/step": sent, "wire bytes/rank": wire,
                     "achieved GB/s": wire / comm_s / 1e9 if comm_s else None,
                     "oversubscribed": oversubscribed[(ws, bs)]})  # fmt: skip
    return rows


def overlap_step(runs: dict, world_sizes, batch_sizes, oversubscribed: dict) -> dict | None:
    """Rank 0's last timed step of the largest world that is not oversubscribed, at the largest
    batch, for ``helpers.plots.overlap`` (ranks taking turns would show nothing); None where
    every world is."""
    fair = [ws for ws in world_sizes if ws > 1 and not oversubscribed[(ws, max(batch_sizes))]]
    return runs[(max(fair), max(batch_sizes))][0][0]["timing"][-1] if fair else None
