"""Putting a layout together: data × tensor (× pipeline) parallelism on one mesh. Lecture 08.

``train_layout`` runs on dp·tp ranks: a ``DeviceMesh`` of shape (dp, tp) names the groups; each
"tp" row holds one copy of a stack of lecture 08's ``Block``s cut by tensor parallelism, each
"dp" column a slice of the global batch, and the gradients are averaged over "dp" before plain
SGD. ``train_reference`` is the same training on one process; the two end at the same weights.

``plan`` lists the layouts dp × tp × pp = gpus of a transformer (``Model``: L layers, width h, a
heads) on a ``Cluster``, at sequence s and micro-batch b, with the memory one GPU needs and the
bytes it sends per step:

    parameters     per layer 12h² + 13h: 12h² + 7h split by t (QKV, projection, MLP weights,
                   column biases), 6h replicated (two LayerNorms, two row biases); a GPU of the
                   first stage holds L/p layers and the vocab-parallel embedding vocab·h/t
    state          bytes per parameter of ``measure.memory.bytes_per_param`` (ZeRO paper: mixed
                   precision 2 + 2 + 12 with Adam); ZeRO-1 divides the optimizer state by dp
    activations    L/p layers × min(p, m) micro-batches in flight (1F1B: the first stage holds
                   p of them) × ``transformer.activation_bytes`` (Korthikanti et al. 2022)
    tp bytes       ``transformer.comm_bytes_per_block`` (forward + backward) × L/p × m; under
                   sequence parallelism + L/p × its gradient all-reduce, once per step
    dp bytes       2(dp−1)/dp × parameters per GPU × itemsize: the gradient all-reduce (ZeRO-1's
                   reduce-scatter + all-gather sends the same)
    pp bytes       2·m·sbh·itemsize for an interior stage (its output forward, its input's
                   gradient back), 0 at p = 1; without Megatron's scatter/gather optimisation
    bubble         (p − 1)/(m + p − 1), m = global_batch/(dp·b) (Narayanan et al. 2021)
    comm seconds   each group's bytes over its bandwidth, no overlap: intra-node if the group
                   lies within one node, inter-node if it spans nodes

Ranks are laid out tp fastest, then pp, then dp (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM": TP within a node, PP across nodes,
DP outermost), so tp ≤ gpus per node keeps the most frequent collectives on the fast links.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from helpers.measure.bandwidth import bus_factor
from helpers.measure.memory import bytes_per_param
from helpers.parallel.tensor_parallel import copy_to_parallel, reduce_from_parallel
from helpers.parallel.transformer import (
    Block,
    TensorParallelBlock,
    activation_bytes,
    comm_bytes_per_block,
    saved_activation_bytes,
)

GB = 1e9  # bandwidths are GB/s, 1 GB = 1e9 bytes (nccl-tests)


# -- tensor parallelism inside a sub-group of the mesh: tensor_parallel's f and g over it ---------


class GroupTensorParallelBlock(TensorParallelBlock):
    """``TensorParallelBlock`` whose f and g all-reduce over ``group`` (a mesh's "tp"), not the
    world; counts ``comm`` as its parent does. No sequence parallelism: its all-gathers and
    reduce-scatters use the world."""

    def __init__(self, block, group):
        super().__init__(block, dist.get_rank(group), dist.get_world_size(group))
        self.group = group

    # the parent counts the bytes and calls layer(y): we hand it the same layer, f or g in group
    def _column(self, layer, y):
        def column(y):  # ColumnParallelLinear.forward
            return F.linear(copy_to_parallel(y, self.group), layer.weight, layer.bias)

        return super()._column(column, y)

    def _row(self, layer, z):
        def row(z):  # RowParallelLinear.forward
            return reduce_from_parallel(F.linear(z, layer.weight), self.group) + layer.bias

        return super()._row(row, z)


# -- the run on a mesh, and the reference --------------------------------------------------


def stack(h, heads, layers=1, seed=0, dtype=torch.float64):
    """``layers`` dense ``Block``s in a row, block i seeded ``seed + i``."""
    return nn.Sequential(*[Block(h, heads, seed=seed + i) for i in range(layers)]).to(dtype)


def _batch(step, s, b, h, seed, dtype):
    """Step ``step``'s global batch: inputs and targets, each (s, b, h)."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    x = torch.randn(s, b, h, generator=g, dtype=dtype)
    return x, torch.randn(s, b, h, generator=g, dtype=dtype)


@torch.no_grad()
def sgd(params, lr):
    """Plain SGD, p ← p − lr·∇p, and the gradients dropped (``torch.optim``'s first use imports
    its compiler: seconds in every rank)."""
    for p in params:
        p -= lr * p.grad
        p.grad = None


def train_layout(dp, tp, steps, s, b, h, heads, layers=1, seed=0, lr=0.1, dtype=torch.float64):
    """Train on a (dp, tp) mesh of dp·tp ranks, ``b`` the global batch; one rank's result.

    Returns {'rank', 'dp_rank', 'tp_rank', 'params': this rank's shards by name, 'comm': bytes
    sent per step {'tp': f and g all-reduces, 'dp': the gradient all-reduce}, 'activations':
    bytes saved for backward by one forward of this rank's micro-batch}. ``dense_parameters``
    puts the shards back together. Run it with ``helpers.launch(..., world_size=dp * tp)``.
    """
    if b % dp:
        raise ValueError(f"global batch {b} must be divisible by dp = {dp}")
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    # the groups of mesh["tp"] and mesh["dp"], without slicing sub-meshes (the first slice
    # imports DTensor's machinery: seconds in every rank)
    tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
    dp_rank = mesh.get_local_rank("dp")
    model = nn.Sequential(
        *[GroupTensorParallelBlock(blk, tp_group) for blk in stack(h, heads, layers, seed, dtype)]
    )
    params = list(model.parameters())

    def mine(step):  # this replica's b/dp samples; every rank of a tp group gets the same
        x, y = _batch(step, s, b, h, seed, dtype)
        # contiguous: a copy of its own; a view would keep (and be measured as) the whole batch
        return [t.chunk(dp, dim=1)[dp_rank].contiguous() for t in (x, y)]  # (s, b/dp, h) each

    saved = saved_activation_bytes(model, mine(0)[0])  # a forward of its own ...
    for block in model:
        block.comm.clear()  # ... whose collectives are not a step's
    dp_bytes = 0.0
    for step in range(steps):
        x, y = mine(step)
        F.mse_loss(model(x), y).backward()  # the mean over this replica's samples
        # the mean of the dp replicas' means is the mean over the global batch (equal slices)
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # one call, not one per tensor
        dist.all_reduce(flat, group=dp_group)
        dp_bytes += bus_factor("all_reduce", dp) * flat.numel() * flat.element_size()
        for p, g in zip(params, flat.div_(dp).split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p))
        sgd(params, lr)
    tp_bytes = sum(
        op["bytes"] for block in model for phase in block.comm.values() for op in phase.values()
    )
    return {
        "rank": dist.get_rank(),
        "dp_rank": dp_rank,
        "tp_rank": mesh.get_local_rank("tp"),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "comm": {"tp": tp_bytes / steps, "dp": dp_bytes / steps},
        "activations": saved,
    }


def train_reference(steps, s, b, h, heads, layers=1, seed=0, lr=0.1, dtype=torch.float64):
    """The same training on one process, the whole global batch ``b`` at once: dense weights."""
    model = stack(h, heads, layers, seed, dtype)
    for step in range(steps):
        x, y = _batch(step, s, b, h, seed, dtype)
        F.mse_loss(model(x), y).backward()
        sgd(model.parameters(), lr)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def dense_parameters(results):
    """Dense weights by name from ``train_layout``'s results (the tp ranks of replica 0)."""
    shards = [r["params"] for r in sorted(results, key=lambda r: r["tp_rank"]) if r["dp_rank"] == 0]
    out = {}
    for name in shards[0]:
        pieces = [p[name] for p in shards]
        kind = name.split(".", 1)[1]
        if kind.startswith("qkv"):  # each rank: its heads' [q | k | v]; the q's together, ...
            out[name] = torch.cat([torch.cat([p.chunk(3)[i] for p in pieces]) for i in range(3)])
        elif kind.startswith("fc1"):  # column-parallel: output features
            out[name] = torch.cat(pieces)
        elif kind in ("proj.weight", "fc2.weight"):  # row-parallel: input features
            out[name] = torch.cat(pieces, dim=1)
        else:  # LayerNorms and row biases: replicated
            out[name] = pieces[0]
    return out


# -- the planner ----------------------------------------------------------------------------


def transformer_params(layers, h, vocab=0, biases=False):
    """12·L·h² (+ 13·L·h biases and LayerNorms) (+ vocab·h): QKV 3h², projection h², MLP 8h².

    The usual count (Kaplan et al. 2020; Narayanan et al. 2021 add the embedding vocab·h).
    """
    return 12 * layers * h * h + (13 * layers * h if biases else 0) + vocab * h


def _params_per_gpu(layers, h, vocab, tp, pp):
    """A first-stage GPU's parameters: L/p layers of (12h² + 7h)/t + 6h, plus vocab·h/t."""
    return layers // pp * ((12 * h * h + 7 * h) / tp + 6 * h) + vocab * h / tp


def _spans_nodes(size, stride, gpus, gpus_per_node):
    """Whether a group of ``size`` ranks ``stride`` apart holds ranks of more than one node."""
    nodes = torch.arange(gpus).reshape(-1, size, stride) // gpus_per_node  # groups along dim 1
    return bool((nodes != nodes[:, :1]).any())


def _layouts(gpus, layers, heads):
    """(dp, tp, pp) with dp·tp·pp = gpus, t dividing the heads and p the layers."""
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    for tp, pp in itertools.product(divisors, repeat=2):
        if gpus % (tp * pp) == 0 and heads % tp == 0 and layers % pp == 0:
            yield gpus // (tp * pp), tp, pp


@dataclass(frozen=True)
class Model:
    """A transformer as the planner counts it: ``layers`` of width ``h`` with ``heads`` attention
    heads, and a ``vocab``·h embedding (0: none counted)."""

    layers: int
    h: int
    heads: int
    vocab: int = 0


@dataclass(frozen=True)
class Cluster:
    """``gpus`` in nodes of ``gpus_per_node``, ``memory_bytes`` each, links of ``intra_bw`` GB/s
    inside a node and ``inter_bw`` GB/s between nodes."""

    gpus: int
    gpus_per_node: int
    memory_bytes: float
    intra_bw: float
    inter_bw: float

    def __post_init__(self):
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(
                f"gpus ({self.gpus}) and gpus_per_node ({self.gpus_per_node}) must be at least 1"
            )
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(
                f"{self.gpus} GPUs do not fill whole nodes of {self.gpus_per_node}: gpus must "
                "be divisible by gpus_per_node"
            )


@dataclass(frozen=True)
class _Step:
    """What every layout of one plan shares: the work of a step and how its state is kept."""

    seq: int
    micro_batch: int
    state: dict  # bytes per parameter by part (measure.memory.bytes_per_param)
    itemsize: int
    zero1: bool
    recompute: str
    sp: bool
    activation_kw: dict


def plan(
    model: Model, cluster: Cluster, seq, global_batch, micro_batch=1, precision="mixed",
    itemsize=None, zero1=False, recompute="none", sp=False, activation_kw=None,
):  # fmt: skip
    """Candidate layouts of ``model`` on ``cluster``, best first.

    One row per (dp, tp, pp) with dp·tp·pp = gpus (t | heads, p | layers, dp·b | global batch):
    memory per GPU by part and ``fits`` (≤ the cluster's memory), bytes each GPU sends per step
    by group, the seconds they take over the cluster's links, and the bubble; formulas in the
    module docstring. ``itemsize``: bytes of an activation and of a gradient on the wire
    (default the precision's gradient bytes). ``activation_kw`` goes to ``activation_bytes``
    (``dropout=False, norm_stats=True``: the CPU setting ``saved_activation_bytes`` measures).
    Sorted: layouts that fit first, then by communication seconds.
    """
    import pandas as pd

    if not isinstance(model, Model) or not isinstance(cluster, Cluster):
        raise TypeError(
            "plan(model, cluster, ...) takes a layout.Model(layers, h, heads, vocab) and a "
            f"layout.Cluster(gpus, gpus_per_node, memory_bytes, intra_bw, inter_bw), not "
            f"{type(model).__name__} and {type(cluster).__name__}"
        )
    state = bytes_per_param("adam", precision)
    step = _Step(
        seq, micro_batch, state, state["gradients"] if itemsize is None else itemsize, zero1,
        recompute, sp, activation_kw or {},
    )  # fmt: skip
    rows = [
        _row(model, cluster, step, dp, tp, pp, global_batch // (dp * micro_batch))
        for dp, tp, pp in _layouts(cluster.gpus, model.layers, model.heads)
        if global_batch % (dp * micro_batch) == 0  # else no whole micro-batches per replica
    ]
    if not rows:
        raise ValueError(
            f"no layout of {cluster.gpus} GPUs splits {model.heads} heads, {model.layers} layers "
            f"and a global batch of {global_batch} into micro-batches of {micro_batch}"
        )
    table = pd.DataFrame(rows)
    return table.sort_values(["fits", "comm_seconds"], ascending=[False, True], ignore_index=True)


def _row(model: Model, cluster: Cluster, step: _Step, dp, tp, pp, m) -> dict:
    """One layout's memory per GPU, bytes sent per step, their seconds, and its bubble."""
    layers, h = model.layers, model.h
    n = _params_per_gpu(layers, h, model.vocab, tp, pp)
    memory = {
        "params_bytes": n * step.state["parameters"],
        "grads_bytes": n * step.state["gradients"],
        "optimizer_bytes": n * step.state["optimizer_state"] / (dp if step.zero1 else 1),
        "activation_bytes": layers // pp * min(pp, m) * activation_bytes(
            step.seq, step.micro_batch, h, model.heads, step.itemsize, step.recompute, tp,
            step.sp, **step.activation_kw,
        ),
    }  # fmt: skip
    block = comm_bytes_per_block(step.seq, step.micro_batch, h, tp, step.sp, step.itemsize)
    per_micro = sum(op["bytes"] for p in ("forward", "backward") for op in block[p].values())
    per_step = sum(op["bytes"] for op in block.get("grads", {}).values())  # sp only
    sent = {
        "tp_bytes": layers // pp * (m * per_micro + per_step),
        "dp_bytes": bus_factor("all_reduce", dp) * n * step.itemsize,
        "pp_bytes": 0 if pp == 1 else 2 * m * step.seq * step.micro_batch * h * step.itemsize,
    }
    gpus, per_node = cluster.gpus, cluster.gpus_per_node
    spans = {  # layout (dp, pp, tp), tp fastest: strides 1, tp and tp·pp
        "tp": _spans_nodes(tp, 1, gpus, per_node),
        "pp": _spans_nodes(pp, tp, gpus, per_node),
        "dp": _spans_nodes(dp, tp * pp, gpus, per_node),
    }
    seconds = sum(
        sent[f"{g}_bytes"] / ((cluster.inter_bw if spans[g] else cluster.intra_bw) * GB)
        for g in spans
    )
    total = sum(memory.values())
    return {
        "dp": dp, "tp": tp, "pp": pp, "micro_batches": m, "tp_within_node": not spans["tp"],
        "dp_spans_nodes": spans["dp"], "pp_spans_nodes": spans["pp"], "params_per_gpu": n,
        **memory, "memory_bytes": total, "fits": total <= cluster.memory_bytes,
        **sent, "comm_bytes": sum(sent.values()), "comm_seconds": seconds,
        "bubble": (pp - 1) / (m + pp - 1),
    }  # fmt: skip
