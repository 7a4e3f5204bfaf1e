"""Lab 04's report: the tables, plots and findings its free cells show, from the runs' data.

The runs (``helpers.labs.lab04_harness``) run the student's engine on ranks; the student's
functions that read them (``measured_bubble``, ``bubble_fraction``, the schedules) are passed in
here and called as the notebook called them, so what is shown is what the student's code made.
Kept here so the lab's cells hold the student's task. Nothing here is graded: the checks compute
their references in ``helpers.labs.lab04``.
"""

from __future__ import annotations

import statistics

from helpers.labs import lab04, lab04_harness
from helpers.launcher import world
from helpers.measure import findings
from helpers.parallel import pipeline as pp

KINDS = {"gpipe": "GPipe", "1f1b": "1F1B"}
PAIRS = (("DP", "PP"), ("DP", "TP"), ("PP", "TP"))  # part 6: every pair of the three ways


def mlp_line(depth: int, width: int, stages: int) -> str:
    """The lab's MLP (``lab04.engine_model``, seeded 0 as every rank builds it) in one line."""
    n = sum(p.numel() for p in lab04.engine_model(depth, width, 0).parameters())
    return (f"the MLP: {depth} layers of {width}, {n:,} parameters; "
            f"cut into {stages} stages of {depth // stages} layers")  # fmt: skip


def plot_schedules(gpipe_order, one_f_one_b_order, draw, p: int = 4, m: int = 6) -> None:
    """Part 1: the student's two schedules laid out in time (forward 1, backward 2), side by side,
    each drawn by ``draw`` (``helpers.plots.pipeline``, a layer above this package: handed in)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 2.6), sharey=True)
    for ax, (kind, fn) in zip(
        axes, (("GPipe", gpipe_order), ("1F1B", one_f_one_b_order)), strict=True
    ):
        grid = pp.simulate([fn(p, m, s) for s in range(p)], 1.0, 2.0)
        draw(grid, ax=ax, title=f"{kind}, p = {p}, m = {m} (your schedule, laid out in time)")
    plt.tight_layout()


def bubble_table(values: dict, bubble_fraction, stages: int):
    """Part 3's table from ``values`` {(kind, m): [the student's measured bubble of each repeat]}:
    per schedule and m, the student's formula, the measured median and range, and their ratio."""
    import pandas as pd

    rows = [{"schedule": kind, "p": stages, "m": m, "theory": bubble_fraction(stages, m),
             "measured (median)": statistics.median(v), "min": min(v), "max": max(v)}
            for (kind, m), v in values.items()]  # fmt: skip
    table = pd.DataFrame(rows).set_index(["schedule", "p", "m"])
    table["measured / theory"] = table["measured (median)"] / table["theory"]
    return table


def bubble_findings(values: dict, bubble_fraction, stages: int, micro_batches) -> list:
    """Per m: how far each schedule's measured bubble sits above the formula (%, its range over
    the repeats), and GPipe against 1F1B (one comparison of the family per m)."""
    lines = []
    for m in micro_batches:
        theory = bubble_fraction(stages, m)
        for kind in KINDS:
            above = [100 * (b / theory - 1) for b in values[kind, m]]
            lines.append(
                findings.value(above, "%", f"{kind}, m = {m}: measured bubble above theory by")
            )
        lines.append(findings.compare({"GPipe": values["gpipe", m], "1F1B": values["1f1b", m]},
                                      better="lower", what=f"bubble at m = {m}"))  # fmt: skip
    return lines


def plot_timeline(events: list[dict], measured_bubble, stages: int, stage_ms, m: int, draw) -> None:
    """Part 3: GPipe's step of m micro-batches in theory, above one measured step (``events``,
    every rank's) and the student's ``measured_bubble`` of it; ``draw``: helpers.plots.pipeline."""
    import matplotlib.pyplot as plt

    t0 = min(e["start"] for e in events)
    live = [{**e, "start": e["start"] - t0, "end": e["end"] - t0} for e in events]
    fig, axes = plt.subplots(2, 1, figsize=(10, 3.8), sharex=True)
    grid = pp.simulate(pp.orders("gpipe", stages, m), stage_ms[0] / 1e3, stage_ms[1] / 1e3)
    draw(grid, ax=axes[0], title=f"GPipe, p = {stages}, m = {m}: theory")
    draw(live, ax=axes[1], title=f"measured with your engine: bubble {measured_bubble(live):.3f}")
    axes[1].set_xlabel("seconds")
    plt.tight_layout()


def memory_table(peaks: dict, gpipe_order, one_f_one_b_order, stages: int, m: int):
    """Part 4's table: each stage's peak of saved activations under each schedule (``peaks``
    {"GPipe": [bytes per rank], "1F1B": [...]}), the micro-batches the student's schedules hold
    at once (``pp.in_flight``), and the ratio of the peaks."""
    import pandas as pd

    memory = pd.DataFrame(peaks, index=pd.Index(range(stages), name="stage"))
    for name, order in (("GPipe", gpipe_order), ("1F1B", one_f_one_b_order)):
        memory[f"micro-batches held, {name}"] = [
            pp.in_flight(order(stages, m, s)) for s in range(stages)
        ]
    memory["1F1B / GPipe"] = memory["1F1B"] / memory["GPipe"]
    return memory


def comparison(per_way: dict) -> tuple:
    """Part 6's table from ``lab04_harness.compare`` on every rank, by way, and every repeat's
    step by way (seconds; a step ends with its slowest rank)."""
    import pandas as pd

    rows, step_times = [], {}
    for way, per_rank in per_way.items():
        row, step_times[way] = lab04_harness.comparison_row(way, per_rank)
        rows.append(row)
    return pd.DataFrame(rows).set_index("way"), step_times


def comparison_findings(step_times: dict, table, batch: int, world_size: int) -> list:
    """What the repeats allow: every pair of ways by step time (3 comparisons of the family);
    the bytes, counts the same on every run, and the batch at which TP's equal DP's."""
    lines = []
    if world.oversubscribed(world_size):
        lines.append(f"{world_size} ranks on {world.cpu_count()} cores: OVERSUBSCRIBED, the times "
                     "measure turn-taking")  # fmt: skip
    ms = {way: [1e3 * s for s in steps] for way, steps in step_times.items()}
    lines += [findings.compare({a: ms[a], b: ms[b]}, "ms", what="step time") for a, b in PAIRS]
    sent = table["MB sent / rank / step"]
    lines.append(f"Bytes: TP all-reduces {sent['TP']:.2f} MB per step at a batch of {batch}, in proportion "
                 f"to the batch; DP all-reduces the gradient, {sent['DP']:.2f} MB, whatever the batch. "
                 f"They are equal at a batch of about {batch * sent['DP'] / sent['TP']:,.0f}.")  # fmt: skip
    return lines
