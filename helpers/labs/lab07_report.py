"""Lab 07's measurements and tables: what the student's ring, dispatch and sequence-parallel
region moved and kept, beside the course's formulas, and the planner's layouts of part 5.

The runs take the student's functions as arguments and start the same ranks the lab's cells
started (``helpers.launch`` of ``helpers.labs.lab07_runs``, gloo, one core each); the rest turns
each rank's results into the table the notebook shows, under the line that says what it counts.
Nothing here judges an answer: the graded checks are ``helpers.labs.lab07_checks``. The plots
draw on a figure of their own and return it (a cell ends them with ``;``).
"""

from __future__ import annotations

import math

import pandas as pd

from helpers.labs import lab07_runs
from helpers.launcher.launch import launch
from helpers.parallel import context, layout, moe

# -- part 2: the ring's bytes and memory, the work per rank under a causal mask ----------------


def ring_table(ring_attention, world_size: int, seq_lens, heads: int, head_dim: int):
    """The student's ring on ``world_size`` ranks at each of ``seq_lens`` (one sequence, not
    causal): messages and bytes each rank sent (the largest rank's), against
    ``context.ring_bytes``, and the peak bytes in theory on the ranks and in one process."""
    causal, seed, b = False, 0, 1  # one seeded sequence; the bytes are the same causal or not
    rows = []
    for s in seq_lens:
        per_rank = launch(lab07_runs.ring_run, ring_attention, s, causal, head_dim, seed, b, heads,
                          world_size=world_size, backend="gloo", output="none", timeout=60)  # fmt: skip
        peak = {n: context.peak_bytes(1, heads, s, head_dim, n) for n in (world_size, 1)}
        rows.append({
            "s": s,
            "messages / rank": max(len(r["sends"]) for r in per_rank),
            "bytes sent / rank": max(sum(nbytes for _, nbytes in r["sends"]) for r in per_rank),
            "context.ring_bytes": context.ring_bytes(1, heads, s, head_dim, world_size),
            f"peak bytes, {world_size} ranks (theory)": peak[world_size],
            "peak bytes, one process (theory)": peak[1],
        })  # fmt: skip
    print(f"your ring on {world_size} ranks, {heads} heads of {head_dim}, one sequence:")
    return pd.DataFrame(rows).set_index("s")


def plot_ring(table, world_size: int):
    """The ring's bytes against ``context.ring_bytes``; the peak bytes on the ranks and in one."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    axes[0].plot(
        table.index, table["context.ring_bytes"], "-", color="0.6", label="context.ring_bytes"
    )
    axes[0].plot(table.index, table["bytes sent / rank"], "o", label="your ring, counted")
    axes[0].set(
        xlabel="sequence length s",
        ylabel="bytes sent per rank",
        title=f"{world_size} ranks: bytes grow as s",
    )
    for column, style in (
        (f"peak bytes, {world_size} ranks (theory)", "o-"),
        ("peak bytes, one process (theory)", "s--"),
    ):
        axes[1].plot(table.index, table[column], style, label=column.replace(" (theory)", ""))
    axes[1].set(
        xscale="log",
        yscale="log",
        xlabel="sequence length s",
        ylabel="bytes live at once",
        title="memory: the s² scores cut by n²",
    )
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    return fig


def work_table(per_rank: list, s: int, heads: int):
    """The (query, key) scores each rank computed in each layout (``lab07_runs.work_run``'s
    results, one per rank) beside ``context.work_per_rank`` times the heads; prints the slowest
    rank's in each layout, which sets the pace."""
    n = len(per_rank)
    work = pd.DataFrame(
        {f"{lay}, measured": [r[lay] for r in per_rank] for lay in context.LAYOUTS},
        index=pd.Index(range(n), name="rank"),
    )
    for lay in context.LAYOUTS:
        work[f"{lay}, theory"] = [heads * w for w in context.work_per_rank(s, n, True, lay)]
    slowest = {lay: work[f"{lay}, measured"].max() for lay in ("contiguous", "zigzag")}
    print(
        f"causal attention, s = {s}, on {n} ranks: (query, key) scores each rank computes; "
        f"the slowest rank sets the pace: contiguous {slowest['contiguous']:,}, "
        f"zigzag {slowest['zigzag']:,} ({slowest['contiguous'] / slowest['zigzag']:.2f}×)"
    )
    return work


def plot_work(work, s: int):
    """Bars of the scores each rank computed, contiguous against zigzag."""
    import matplotlib.pyplot as plt

    ax = work[[f"{lay}, measured" for lay in context.LAYOUTS]].plot.bar(figsize=(6, 3.2), rot=0)
    ax.set(ylabel="(query, key) scores", title=f"causal, s = {s}: contiguous vs zigzag")
    plt.tight_layout()
    return ax.figure


# -- part 3: the bytes of one dispatch ---------------------------------------------------------


def moe_table(
    dispatch,
    world_size: int,
    moe_tokens,
    capacity_factor: float,
    d_model: int,
    n_experts: int,
    top_k: int,
):
    """The bytes the student's ``dispatch`` sends from each rank to the others in one forward
    (``lab07_runs.moe_bytes_run``, float32), at each of ``moe_tokens`` per rank, with room for
    every assignment and at ``capacity_factor``; means over the ranks, against
    ``moe.all_to_all_bytes`` (uniform routing)."""
    rows = []
    for tokens in moe_tokens:
        for factor in (math.inf, capacity_factor):
            per_rank = launch(
                lab07_runs.moe_bytes_run,
                dispatch,
                tokens,
                factor,
                d_model,
                n_experts,
                top_k,
                world_size=world_size,
                backend="gloo",
                output="none",
            )
            theory = moe.all_to_all_bytes(tokens, d_model, world_size, top_k)
            sent = sum(r["sent"] for r in per_rank) / world_size
            rows.append(
                {
                    "tokens / rank": tokens,
                    "capacity factor": factor,
                    "capacity": moe.capacity(tokens, n_experts, top_k, factor),
                    "dropped / rank": sum(r["dropped"] for r in per_rank) / world_size,
                    "bytes sent / rank": sent,
                    "moe.all_to_all_bytes": theory,
                    "sent / uniform": sent / theory,
                }
            )
    print(
        f"your dispatch, {world_size} ranks, {n_experts} experts, top-{top_k}, tokens of width "
        f"{d_model}, float32 (mean over ranks):"
    )
    return pd.DataFrame(rows).set_index(["tokens / rank", "capacity factor"])


def plot_moe(table, capacity_factor: float, d_model: int, world_size: int, top_k: int):
    """Bytes per dispatch at each capacity factor, against ``moe.all_to_all_bytes``."""
    import matplotlib.pyplot as plt

    tokens = list(dict.fromkeys(table.index.get_level_values("tokens / rank")))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for factor, style in ((math.inf, "o"), (capacity_factor, "s")):
        part = table.xs(factor, level="capacity factor")
        ax.plot(
            part.index,
            part["bytes sent / rank"],
            style,
            label=f"your dispatch, capacity factor {factor}",
        )
    ax.plot(
        tokens,
        [moe.all_to_all_bytes(t, d_model, world_size, top_k) for t in tokens],
        "-",
        color="0.6",
        label="moe.all_to_all_bytes (uniform)",
    )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="tokens per rank",
        ylabel="bytes sent per rank, one dispatch",
        title=f"{world_size} ranks, top-{top_k}",
    )
    ax.legend()
    fig.tight_layout()
    return fig


# -- part 4: activation memory per rank --------------------------------------------------------

REGIONS = ("SP", "TP", "one process")


def memory_table(per_rank: list, seq_lens, d_model: int, ffn: int):
    """The bytes saved for backward (``lab07_runs.activation_run``'s results, one per rank; the
    largest rank's) by the SP region, the TP region and one process, beside their theory in
    4-byte units (sbh/t + 2 sb·ffn/t, sbh + 2 sb·ffn/t, sbh + 2 sb·ffn) and TP − SP."""
    t = len(per_rank)
    rows = []
    for i, s in enumerate(seq_lens):
        row = {
            "s": s,
            **{f"{name}, measured": max(r[i][name] for r in per_rank) for name in REGIONS},
        }
        row["SP, theory"] = 4 * (s * d_model // t + 2 * s * ffn // t)
        row["TP, theory"] = 4 * (s * d_model + 2 * s * ffn // t)
        row["one process, theory"] = 4 * (s * d_model + 2 * s * ffn)
        row["TP − SP"] = row["TP, measured"] - row["SP, measured"]
        rows.append(row)
    print(
        f"bytes saved for backward per rank (the largest rank), h = {d_model}, ffn = {ffn}, "
        f"{t} ranks:"
    )
    return pd.DataFrame(rows).set_index("s")


def plot_memory(table, d_model: int, ffn: int, world_size: int):
    """Measured bytes saved for backward per rank, each over its theory (grey)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name, style in (("one process", "s"), ("TP", "^"), ("SP", "o")):
        ax.plot(table.index, table[f"{name}, theory"], "-", color="0.75")
        ax.plot(table.index, table[f"{name}, measured"], style, label=f"{name}, measured")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="sequence length s",
        ylabel="bytes saved for backward per rank",
        title=f"one MLP region, h = {d_model}, ffn = {ffn}, {world_size} ranks (grey: theory)",
    )
    ax.legend()
    fig.tight_layout()
    return fig


# -- part 5: the planner's layouts -------------------------------------------------------------

SHOWN = ["dp", "tp", "pp", "fits", "tp_within_node", "bubble", "comm_seconds"]


def planned(model, cluster, seq: int, global_batch: int, sp: bool):
    """``layout.plan``'s layouts of ``model`` (a ``layout.Model``) on ``cluster`` (a
    ``layout.Cluster``) with ZeRO-1 and selective recomputation, best first, with the memory
    and activations per GPU in GB."""
    table = layout.plan(model, cluster, seq, global_batch, zero1=True, sp=sp, recompute="selective")
    shown = table[SHOWN].copy()
    shown["memory GB"] = table["memory_bytes"] / 1e9
    shown["activations GB"] = table["activation_bytes"] / 1e9
    return shown


def layouts(model, cluster, seq: int, global_batch: int):
    """Prints the planner's first six layouts without and with sequence parallelism, at ``seq``
    and at twice it, and what sequence parallelism adds to the communication seconds of each
    layout that fits either way (the backward regather). Returns those added shares."""
    print(
        f"{layout.transformer_params(model.layers, model.h) / 1e9:.2f} billion parameters "
        f"(12·L·h²), {global_batch} sequences a step, {cluster.gpus} GPUs in nodes of "
        f"{cluster.gpus_per_node}, {cluster.memory_bytes / 1e9:.0f} GB each"
    )
    for s in (seq, 2 * seq):
        for sp in (False, True):
            table = planned(model, cluster, s, global_batch, sp)
            print(
                f"\ns = {s}, {'with' if sp else 'without'} sequence parallelism: "
                f"{int(table['fits'].sum())} of {len(table)} layouts fit; the first six:"
            )
            print(table.head(6).round(3).to_string(index=False))
    without, with_sp = (planned(model, cluster, seq, global_batch, sp) for sp in (False, True))
    both = without.merge(with_sp, on=["dp", "tp", "pp"], suffixes=("", ", SP"))
    both = both[both["fits"] & both["fits, SP"]]
    sp_extra = both["comm_seconds, SP"] / both["comm_seconds"] - 1
    print(
        f"\ns = {seq}, the {len(both)} layouts that fit either way: with sequence parallelism "
        f"their communication seconds are {sp_extra.min():+.0%} to {sp_extra.max():+.0%} "
        "against the same layout without it"
    )
    return sp_extra
