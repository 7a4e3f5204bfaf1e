"""A transformer block under tensor and sequence parallelism, and its activation memory. Lecture 08.

``Block`` is a pre-norm block in Megatron's (s, b, h) layout: x + Attn(LN(x)), then + MLP(LN(x)).
``TensorParallelBlock.from_dense`` cuts it over t ranks with lecture 04's layers: attention heads
split (column-parallel QKV, row-parallel output projection), the MLP column then row, the
LayerNorms replicated. Without sequence parallelism f and g bracket each half: two all-reduces
forward, two backward. With it (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models"), x arrives as (s/t, b, h) shards, LayerNorm, dropout and the residuals
run on the shard, an all-gather along s replaces f and a reduce-scatter along s replaces g.

Per-layer activation memory, section 4 and Table 2 of the paper (16-bit activations, 1-byte
dropout masks, a heads, t tensor-parallel ranks), in bytes, by the tensor each term keeps:
    norms: LayerNorm inputs                  4sbh      the two LayerNorms' inputs
    attention: QKV input                     2sbh      LayerNorm output, into the fused QKV
    attention: Q, K (QK^T inputs)            4sbh/t    kept by the QKᵀ matmul
    attention: softmax output                2as²b/t   kept by softmax's backward
    attention: dropout mask                  as²b/t    dropout on the probabilities
    attention: dropout output                2as²b/t   kept by the product with V
    attention: V                             2sbh/t    kept by the same product
    attention: output projection input       2sbh/t
    MLP: first linear input                  2sbh
    MLP: GELU input                          8sbh/t
    MLP: second linear input                 8sbh/t
    dropout masks: after attention and MLP   2sbh      sbh each
That is sbh(34 + 5as/h) at t = 1 and sbh(10 + 24/t + 5as/(ht)) under tensor parallelism: the 10
are the terms tensor parallelism leaves whole, which sequence parallelism splits too, giving
sbh/t·(34 + 5as/h) (the column layers keep their input's shard and all-gather it again in
backward, as Megatron does). Selective recomputation (section 5) keeps Q, K, V and reruns the
softmax, its dropout and the product with V in backward: the 5as/h term goes.
``activation_bytes_cpu_by_part`` gives the same terms for what ``saved_activation_bytes``
measures on CPU.
"""

from __future__ import annotations

import copy
import math
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from helpers.measure.bandwidth import bus_factor
from helpers.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

RECOMPUTE = ("none", "selective")
# The terms that grow with s²: selective recomputation drops exactly these.
SCORES = ("attention: softmax output", "attention: dropout mask", "attention: dropout output")


# -- theory -----------------------------------------------------------------------------------


def activation_bytes_by_part(
    s, b, h, heads, itemsize=2, recompute="none", tp=1, sp=False,
    dropout=True, mask_itemsize=1, norm_stats=False,
) -> dict:  # fmt: skip
    """The paper's per-layer activation bytes on one rank, by part (see the module docstring).

    Defaults are the paper's setting. ``norm_stats`` adds each LayerNorm's mean and 1/std per
    token, which PyTorch keeps too (in fp32, or the input's dtype if wider); the paper omits them.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, not {recompute!r}")
    sbh, t = s * b * h, tp
    whole = t if sp else 1  # what tensor parallelism leaves whole, sequence parallelism splits
    scores = heads * s * s * b / t  # one (s, s) matrix per sample and head; heads split by t
    parts = {
        "norms: LayerNorm inputs": 2 * sbh / whole * itemsize,
        "attention: QKV input": sbh / whole * itemsize,
        "attention: Q, K (QK^T inputs)": 2 * sbh / t * itemsize,
        "attention: softmax output": scores * itemsize,
        "attention: V": sbh / t * itemsize,
        "attention: output projection input": sbh / t * itemsize,
        "MLP: first linear input": sbh / whole * itemsize,
        "MLP: GELU input": 4 * sbh / t * itemsize,
        "MLP: second linear input": 4 * sbh / t * itemsize,
    }
    if dropout:
        parts["attention: dropout mask"] = scores * mask_itemsize
        parts["attention: dropout output"] = scores * itemsize
        parts["dropout masks: after attention and MLP"] = 2 * sbh / whole * mask_itemsize
    if norm_stats:
        parts["norms: mean and 1/std"] = 4 * s * b / whole * max(itemsize, 4)
    if recompute == "selective":
        parts = {k: v for k, v in parts.items() if k not in SCORES}
    return parts


def activation_bytes(s, b, h, heads, itemsize=2, recompute="none", tp=1, sp=False, **kw) -> float:
    """Korthikanti et al.'s per-layer total: sbh(34 + 5as/h) at the defaults, t = 1."""
    return sum(activation_bytes_by_part(s, b, h, heads, itemsize, recompute, tp, sp, **kw).values())


def activation_bytes_cpu_by_part(
    s, b, h, heads, itemsize=4, recompute="none", tp=1, sp=False, dropout=0.0
) -> dict:
    """The formula's terms for ``Block`` on CPU, which ``saved_activation_bytes`` measures exactly.

    Three differences from the paper: activations are ``itemsize`` bytes (4: fp32); dropout at
    p = 0 saves nothing, so there are no masks and the probabilities are the softmax output; a
    CPU dropout keeps its mask as a tensor of the activation's dtype (not 1 byte as on a GPU);
    and the LayerNorm statistics are counted.
    """
    return activation_bytes_by_part(
        s, b, h, heads, itemsize, recompute, tp, sp, dropout > 0, itemsize, norm_stats=True
    )


def comm_bytes_per_block(s, b, h, tp, sequence_parallel, itemsize=4) -> dict:
    """Bytes each rank sends per block in ring collectives of the (s, b, h) activation.

    All-reduce sends 2(t−1)/t·N, all-gather and reduce-scatter (t−1)/t·N each: the same total
    with sequence parallelism as without (``fg_total``). Sequence parallelism adds the backward
    "regather" of each stored input shard (Megatron overlaps it with the input-gradient matmul)
    and, per step, an all-reduce of the gradients of the parameters that saw one shard ("grads").
    """
    n = s * b * h * itemsize

    def op(kind, calls, nbytes=n):
        factor = bus_factor("all_gather" if kind == "regather" else kind, tp)
        return {"calls": calls, "bytes": calls * factor * nbytes}

    if not sequence_parallel:
        out = {"forward": {"all_reduce": op("all_reduce", 2)}}
        out["backward"] = {"all_reduce": op("all_reduce", 2)}
    else:
        out = {"forward": {"all_gather": op("all_gather", 2)}}
        out["forward"]["reduce_scatter"] = op("reduce_scatter", 2)
        out["backward"] = {**out["forward"], "regather": op("regather", 2)}
        out["grads"] = {"all_reduce": op("all_reduce", 1, 6 * h * itemsize)}  # 2 norms, 2 biases
    out["fg_total"] = sum(
        v["bytes"] for p in ("forward", "backward") for k, v in out[p].items() if k != "regather"
    )
    return out


# -- measurement ------------------------------------------------------------------------------


def saved_activation_bytes(module, x, by_module=False):
    """Bytes of the distinct storages autograd saves for backward in ``module(x)``.

    Each storage counts once, under the (innermost) submodule that saved it first; parameters are
    not activations. ``by_module``: a dict {submodule name: bytes} instead of the total.
    """
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    names = {m: name or "(block)" for name, m in module.named_modules()}
    stack, seen, kept = [], {}, []

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.data_ptr() not in seen:
            seen[st.data_ptr()] = (stack[-1], st.nbytes())
            kept.append(st)  # held until we return: a freed address could be reused
        return t

    def enter(m, args):
        stack.append(names[m])

    def leave(m, args, out):  # returns None: a hook's return value would replace ``out``
        stack.pop()

    handles = [m.register_forward_pre_hook(enter) for m in module.modules()]
    handles += [m.register_forward_hook(leave) for m in module.modules()]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = module(x)
    finally:
        for handle in handles:
            handle.remove()
    del out
    if not by_module:
        return sum(n for _, n in seen.values())
    grouped = Counter()
    for name, n in seen.values():
        grouped[name] += n
    return dict(grouped)


# -- the dense block --------------------------------------------------------------------------


def split_heads(qkv, heads):
    """(s, b, 3·a·d) laid out [q | k | v] → q, k, v, each (b·a, s, d), contiguous."""
    s, b, _ = qkv.shape
    # contiguous: each becomes a tensor of its own, so bmm keeps exactly s·b·h of it
    return [t.reshape(s, b * heads, -1).transpose(0, 1).contiguous() for t in qkv.chunk(3, -1)]


def merge_heads(ctx, b):
    """(b·a, s, d) → (s, b, a·d): the heads side by side again, as the projection expects."""
    return ctx.transpose(0, 1).reshape(ctx.shape[1], b, -1)  # (s, b, a·d)


class Core(nn.Module):
    """softmax(QKᵀ/√d)·V over a batch of heads: the part whose memory grows with s²."""

    def __init__(self, causal=True, dropout=0.0, recompute="none"):
        super().__init__()
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, not {recompute!r}")
        self.causal, self.dropout, self.recompute = causal, dropout, recompute

    def forward(self, q, k, v):  # each (b·a, s, d)
        if self.recompute == "selective" and torch.is_grad_enabled():
            # keep q, k, v only; softmax and its dropout are rerun in backward (paper, section 5)
            return checkpoint(self._attend, q, k, v, use_reentrant=False)
        return self._attend(q, k, v)

    def _attend(self, q, k, v):
        s, d = q.shape[1], q.shape[2]
        scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(d)  # (b·a, s, s)
        if self.causal:  # added, not masked_fill: `+` keeps nothing, masked_fill keeps a mask
            scores = scores + torch.full((s, s), -math.inf, dtype=q.dtype, device=q.device).triu(1)
        p = F.dropout(torch.softmax(scores, dim=-1), self.dropout, self.training)
        return torch.bmm(p, v)  # (b·a, s, d)


class _Layers(nn.Module):
    """The forward both blocks share; they differ in how a linear layer is entered and left."""

    def forward(self, x):  # (s, b, h); (s/t, b, h) under sequence parallelism
        x = x + F.dropout(self._attention(self.ln1(x)), self.dropout, self.training)
        return x + F.dropout(self._mlp(self.ln2(x)), self.dropout, self.training)

    def _attention(self, y):
        qkv = self._column(self.qkv, y)  # (s, b, 3h/t)
        ctx = self.core(*split_heads(qkv, self.local_heads))  # (b·a/t, s, d)
        return self._row(self.proj, merge_heads(ctx, qkv.shape[1]))

    def _mlp(self, y):
        return self._row(self.fc2, self.act(self._column(self.fc1, y)))

    def _column(self, layer, y):
        return layer(y)

    def _row(self, layer, z):
        return layer(z)


class Block(_Layers):
    """Pre-norm block: fused QKV Linear(h, 3h), Linear(h, h); MLP Linear(h, ffn·h), GELU, back."""

    def __init__(self, h, heads, ffn=4, dropout=0.0, seed=0, causal=True, recompute="none"):
        super().__init__()
        if h % heads:
            raise ValueError(f"width {h} must be divisible by the {heads} heads")
        torch.manual_seed(seed)
        self.heads = self.local_heads = heads
        self.dropout = dropout
        self.ln1, self.qkv = nn.LayerNorm(h), nn.Linear(h, 3 * h)
        self.core, self.proj = Core(causal, dropout, recompute), nn.Linear(h, h)
        self.ln2, self.fc1 = nn.LayerNorm(h), nn.Linear(h, ffn * h)
        self.act, self.fc2 = nn.GELU(), nn.Linear(ffn * h, h)


# -- sequence-parallel communication ----------------------------------------------------------


def _all_gather_s(shard):  # (s/t, b, h) → (s, b, h)
    shard = shard.contiguous()
    out = shard.new_empty((shard.shape[0] * dist.get_world_size(), *shard.shape[1:]))
    dist.all_gather_into_tensor(out, shard)  # s is dim 0: each rank's piece is one block
    return out


def _reduce_scatter_s(full):  # (s, b, h), partial sums → (s/t, b, h), summed
    full = full.contiguous()
    out = full.new_empty((full.shape[0] // dist.get_world_size(), *full.shape[1:]))
    dist.reduce_scatter_tensor(out, full)
    return out


class _GatherLinear(torch.autograd.Function):
    """All-gather along s, then a column-parallel linear, keeping only the shard for backward."""

    @staticmethod
    def forward(ctx, shard, weight, bias):
        ctx.save_for_backward(shard, weight)
        return F.linear(_all_gather_s(shard), weight, bias)

    @staticmethod
    def backward(ctx, grad):  # (s, b, out/t)
        shard, weight = ctx.saved_tensors
        grad_shard = _reduce_scatter_s(grad @ weight)  # the all-gather's backward
        full = _all_gather_s(shard)  # regather: t× less memory kept, one all-gather more
        grad_w = grad.reshape(-1, grad.shape[-1]).T @ full.reshape(-1, full.shape[-1])
        return grad_shard, grad_w, grad.sum(dim=(0, 1))


class _ReduceScatter(torch.autograd.Function):
    """Sum partial outputs and keep this rank's s/t rows; backward: all-gather the gradient."""

    @staticmethod
    def forward(ctx, full):
        return _reduce_scatter_s(full)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_s(grad)


class SequenceParallelColumnLinear(ColumnParallelLinear):
    """Lecture 04's column-parallel layer, entered by an all-gather along s instead of f."""

    def forward(self, shard):  # (s/t, b, h) → (s, b, out/t)
        return _GatherLinear.apply(shard, self.weight, self.bias)


class SequenceParallelRowLinear(RowParallelLinear):
    """Lecture 04's row-parallel layer, left by a reduce-scatter along s instead of g."""

    def forward(self, x_part):  # (s, b, in/t) → (s/t, b, out)
        return _ReduceScatter.apply(F.linear(x_part, self.weight)) + self.bias


def sequence_shard(x, rank, world_size):
    """This rank's rows of an (s, b, h) tensor along s: (s/t, b, h), in a storage of its own."""
    if x.shape[0] % world_size:
        raise ValueError(f"sequence length {x.shape[0]} must be divisible by {world_size} ranks")
    # cloned: a view would keep (and be measured as) the whole of x; a previous layer's
    # reduce-scatter hands each rank a tensor of its own too
    return x.chunk(world_size, dim=0)[rank].clone()


# -- the tensor-parallel block ----------------------------------------------------------------


class TensorParallelBlock(_Layers):
    """This rank's part of a ``Block``; ``comm`` counts {phase: {kind: {calls, bytes sent}}}.

    Phases: "forward", "backward", and "grads" (``sync_sequence_parallel_grads``); kinds:
    all_reduce, all_gather, reduce_scatter, regather; bytes as in ``comm_bytes_per_block``.
    """

    @classmethod
    def from_dense(cls, block, rank, world_size, sequence_parallel=False):
        """Heads a/t and MLP features ffn·h/t of ``block`` on this rank; LayerNorms replicated."""
        return cls(block, rank, world_size, sequence_parallel)

    def __init__(self, block, rank, world_size, sequence_parallel=False):
        super().__init__()
        h, ffn, t = block.qkv.in_features, block.fc1.out_features, world_size
        if block.heads % t or ffn % t:
            raise ValueError(f"{block.heads} heads and width {ffn} must be divisible by {t} ranks")
        self.rank, self.world_size, self.sequence_parallel = rank, t, sequence_parallel
        self.heads, self.local_heads, self.dropout = block.heads, block.heads // t, block.dropout
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)  # replicated
        self.core, self.act = copy.deepcopy(block.core), copy.deepcopy(block.act)
        column, row = (ColumnParallelLinear, RowParallelLinear)
        if sequence_parallel:
            column, row = SequenceParallelColumnLinear, SequenceParallelRowLinear
        mine = slice(rank * h // t, (rank + 1) * h // t)  # this rank's heads' features
        wide = slice(rank * ffn // t, (rank + 1) * ffn // t)  # its MLP features
        # fused [q | k | v]: this rank's heads are one slice in each of the three blocks
        qkv = torch.cat([torch.arange(3 * h)[i * h : (i + 1) * h][mine] for i in range(3)])
        with torch.no_grad():
            self.qkv = column(block.qkv.weight[qkv], block.qkv.bias[qkv])
            self.proj = row(block.proj.weight[:, mine], block.proj.bias)
            self.fc1 = column(block.fc1.weight[wide], block.fc1.bias[wide])
            self.fc2 = row(block.fc2.weight[:, wide], block.fc2.bias)
        self.comm: dict = {}

    def _count(self, phase, kind, nbytes):
        factor = bus_factor("all_gather" if kind == "regather" else kind, self.world_size)
        rec = self.comm.setdefault(phase, {}).setdefault(kind, {"calls": 0, "bytes": 0.0})
        rec["calls"] += 1
        rec["bytes"] += factor * nbytes

    def _on_backward(self, tensor, *ops):
        def hook(grad):  # runs when the gradient reaches ``tensor``, beside its collectives
            for kind, nbytes in ops:
                self._count("backward", kind, nbytes)

        if tensor.requires_grad:
            tensor.register_hook(hook)

    def _full_bytes(self, tensor):  # the (s, b, ·) tensor a collective moves, not the shard
        shards = self.world_size if self.sequence_parallel else 1
        return tensor.numel() * tensor.element_size() * shards

    def _column(self, layer, y):
        n = self._full_bytes(y)
        if self.sequence_parallel:
            self._count("forward", "all_gather", n)
            self._on_backward(y, ("reduce_scatter", n), ("regather", n))
        else:
            self._on_backward(y, ("all_reduce", n))  # f
        return layer(y)

    def _row(self, layer, z):
        out = layer(z)
        n = self._full_bytes(out)
        self._count("forward", "reduce_scatter" if self.sequence_parallel else "all_reduce", n)
        if self.sequence_parallel:
            self._on_backward(out, ("all_gather", n))
        return out

    def sync_sequence_parallel_grads(self):
        """All-reduce the gradients of parameters that saw one shard: norms and row biases.

        Under sequence parallelism each rank's LayerNorms and row-parallel biases saw only s/t
        tokens, so their gradients are partial sums (Megatron all-reduces them over the tensor
        group too). Without it every rank saw all s and holds the full gradient already.
        """
        if not self.sequence_parallel:
            return
        params = [*self.ln1.parameters(), *self.ln2.parameters(), self.proj.bias, self.fc2.bias]
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # one call, not six
        dist.all_reduce(flat)
        self._count("grads", "all_reduce", flat.numel() * flat.element_size())
        for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p))
