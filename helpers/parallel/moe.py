"""Mixture of experts, and expert parallelism over all-to-all. Lecture 08.

A mixture-of-experts (MoE) layer swaps one MLP for ``n_experts`` of them and a linear router
that sends each token to its ``top_k`` best experts: parameters grow with the number of
experts, the compute per token does not. Two ideas from GShard (Lepikhin et al. 2020, §2.2)
and the Switch Transformer (Fedus et al. 2021, §2.2) keep it trainable:

* Capacity. Expert i takes at most C = ceil(capacity_factor · tokens · top_k / n_experts)
  token assignments, so every expert's batch has a fixed size. The assignments (token t's
  j-th choice) queue in order of token index, then of choice, first come first served; an
  assignment past C is dropped and that expert adds zero to the token (the residual connection
  around the layer, the caller's, carries the token on).
* Load balancing. aux_loss = n_experts · Σ_i f_i · P_i, f_i the fraction of assignments the
  router gave expert i (before capacity), P_i the router probability of expert i averaged over
  tokens. It is 1 when routing is uniform and n_experts when every token goes to one expert
  with certainty; only P carries a gradient.

The output is Σ_j gate_j · expert_j(x) over a token's kept choices. With top_k = 1 the gate
is the router probability itself (Switch); with top_k > 1 the k chosen probabilities are
renormalised to sum to 1 (GShard's top-2).

Expert parallelism (GShard): on n ranks, rank r holds experts [r·E/n, (r+1)·E/n) and a full
copy of the router. Each rank routes its own tokens, exchanges per-expert counts (a small
all-to-all of ints), **dispatches** the token rows to the ranks that hold their experts
(``all_to_all_single`` with uneven split sizes), runs its experts, and **combines**: the reverse
all-to-all brings the results home, where they are scattered into token order and weighted by
the gates. Backward is the same two all-to-alls in reverse. Every token row crosses the network
twice per forward, (n−1)/n of them leave their rank under uniform routing: ``all_to_all_bytes``.

Capacity is per rank: C comes from the rank's own token count, as GShard's per-group capacity,
so a rank decides its drops without asking anyone. The distributed layer therefore equals the
one-process ``MoE`` applied to each rank's batch shard separately (tested).
"""

from __future__ import annotations

import copy
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def capacity(tokens, n_experts, top_k=1, capacity_factor=1.25):
    """Assignments one expert may take: ceil(capacity_factor · tokens · top_k / n_experts)."""
    if math.isinf(capacity_factor):
        return tokens  # no expert can get more: a token picks each expert at most once
    # round first: 1.1 · 10 is 11.000000000000002 in floating point, and ceil would make it 12
    return math.ceil(round(capacity_factor * tokens * top_k / n_experts, 9))


def all_to_all_bytes(tokens_per_rank, d, world_size, top_k=1, itemsize=4):
    """Bytes one rank sends in one dispatch under uniform routing: (n−1)/n of its T·k rows leave."""
    return tokens_per_rank * top_k * d * itemsize * (world_size - 1) / world_size


class Routing(NamedTuple):
    expert: torch.Tensor  # (T, k) chosen experts, best first
    gate: torch.Tensor  # (T, k) their weights in the combine
    keep: torch.Tensor  # (T, k) bool: the assignment fits in its expert's capacity
    load: torch.Tensor  # (E,) assignments the router gave each expert, before capacity
    aux_loss: torch.Tensor  # () Switch load-balancing loss


def route(logits, top_k, capacity):
    """The router's decisions for logits (T, E): which experts, with what gate, which fit."""
    tokens, n_experts = logits.shape
    probs = logits.softmax(-1)  # (T, E)
    gate, expert = probs.topk(top_k, dim=-1)  # (T, k)
    if top_k > 1:
        gate = gate / gate.sum(-1, keepdim=True)
    # row t·k + j is token t's j-th choice: this row order *is* the first-come-first-served queue
    onehot = F.one_hot(expert.reshape(-1), n_experts)  # (T·k, E)
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # (T·k,) place in its expert's queue
    keep = (position < capacity).reshape(tokens, top_k)
    load = onehot.sum(0)  # (E,)
    f = load.to(probs.dtype) / (tokens * top_k)
    aux_loss = n_experts * (f * probs.mean(0)).sum()
    return Routing(expert, gate, keep, load, aux_loss)


def dispatch_order(r):
    """Kept assignments (rows of the flattened (T·k) list) sorted by expert, then token order."""
    rows = r.keep.reshape(-1).nonzero().squeeze(1)  # (N,)
    by_expert = torch.sort(r.expert.reshape(-1)[rows], stable=True).indices
    return rows[by_expert]


def run_experts(experts, h, which):
    """Row i of h (N, d) through experts[which[i]]; the rows of one expert form one batch."""
    out = torch.zeros_like(h)
    for e, expert in enumerate(experts):
        # run even on zero rows: an idle expert then gets a zero gradient, not None
        idx = (which == e).nonzero().squeeze(1)
        out = out.index_copy(0, idx, expert(h[idx]))
    return out


def combine(out, rows, r, tokens):
    """Sum the expert outputs (N, d), in ``rows`` order, into token order, weighted by gates."""
    top_k = r.expert.shape[1]
    gate = r.gate.reshape(-1)[rows]  # (N,)
    y = out.new_zeros(tokens, out.shape[1])  # (T, d): dropped assignments add nothing
    return y.index_add(0, rows // top_k, out * gate[:, None])


def expert_mlp(d, hidden):
    return nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))


class MoE(nn.Module):
    """A top-k mixture of 2-layer GELU experts, capacity and all, in one process. Lecture 08."""

    def __init__(self, d, hidden, n_experts, top_k=1, capacity_factor=1.25, seed=0):
        super().__init__()
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        with torch.random.fork_rng():  # the same seed gives every rank the same model
            torch.manual_seed(seed)
            self.router = nn.Linear(d, n_experts)
            self.experts = nn.ModuleList(expert_mlp(d, hidden) for _ in range(n_experts))
        self.last = {}

    def forward(self, x):
        """x (tokens, d) → y (tokens, d). ``self.last``: "dropped" (assignments over capacity),
        "load" (assignments per expert, before capacity), "capacity" and "aux_loss"."""
        cap = capacity(len(x), self.n_experts, self.top_k, self.capacity_factor)
        r = route(self.router(x), self.top_k, cap)
        rows = dispatch_order(r)  # (N,)
        out = run_experts(self.experts, x[rows // self.top_k], r.expert.reshape(-1)[rows])
        self.last = _record(r, cap)
        return combine(out, rows, r, len(x))


def _record(r, cap):
    return {
        "dropped": int((~r.keep).sum()),
        "load": r.load,
        "capacity": cap,
        "aux_loss": r.aux_loss,
    }


class _AllToAll(torch.autograd.Function):
    """Rows swapped between ranks by split sizes; the gradient goes back the reverse way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits  # the rows go home: splits swap roles
        grad_x = _AllToAll.apply(grad.contiguous(), in_splits, out_splits, ctx.group)
        return grad_x, None, None, None


def all_to_all(x, out_splits, in_splits, group=None):
    """Send in_splits[j] rows of x to rank j, receive out_splits[j] from it; differentiable.

    Our own autograd.Function: torch.distributed.nn.functional.all_to_all_single does the same
    but is deprecated (a FutureWarning in torch 2.14)."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


class ExpertParallelMoE(nn.Module):
    """An ``MoE`` whose experts are split over ranks, tokens moved by all-to-all. Lecture 08."""

    def __init__(self, router, experts, top_k, capacity_factor, rank, world_size, group=None):
        super().__init__()
        self.router, self.experts = router, experts  # full router, this rank's experts
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.rank, self.world_size, self.group = rank, world_size, group
        self.n_experts = len(experts) * world_size
        self.first_expert = rank * len(experts)  # local expert i is global first_expert + i
        self.last = {}

    @classmethod
    def from_dense(cls, moe, rank=None, world_size=None, group=None):
        """Rank ``rank``'s part of ``moe``: the router, and a contiguous block of experts."""
        if world_size is None:  # one plain process, no process group: the whole layer
            world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank(group) if dist.is_initialized() else 0
        if moe.n_experts % world_size:
            raise ValueError(f"{moe.n_experts} experts do not split over {world_size} ranks")
        per = moe.n_experts // world_size
        experts = nn.ModuleList(copy.deepcopy(moe.experts[rank * per + i]) for i in range(per))
        router = copy.deepcopy(moe.router)
        return cls(router, experts, moe.top_k, moe.capacity_factor, rank, world_size, group)

    def forward(self, x):
        """This rank's tokens x (tokens, d) → y (tokens, d), as ``MoE`` on this shard.

        ``self.last`` as ``MoE``'s, plus "bytes_sent": what this rank sent to other ranks in
        each all-to-all of the forward ("counts", "dispatch", "combine"; rows kept local are
        not sent). The backward sends as much again: the two all-to-alls, reversed."""
        n, per, k = self.world_size, len(self.experts), self.top_k
        cap = capacity(len(x), self.n_experts, k, self.capacity_factor)
        r = route(self.router(x), k, cap)
        rows = dispatch_order(r)  # (N,) grouped by expert, hence by destination rank
        send = torch.bincount(r.expert.reshape(-1)[rows], minlength=self.n_experts)  # (E,)
        recv = self._exchange_counts(send)  # (n, per): rows from rank j for local expert i
        in_splits = send.view(n, per).sum(1).tolist()  # rows to each rank
        out_splits = recv.sum(1).tolist()  # rows from each rank
        h = self._all_to_all(x[rows // k], out_splits, in_splits)  # (M, d) by source, expert
        which = (
            torch.arange(per, device=x.device).repeat(n).repeat_interleave(recv.reshape(-1))
        )  # (M,)
        out = run_experts(self.experts, h, which)
        back = self._all_to_all(out, in_splits, out_splits)  # (N, d) in `rows` order again
        self.last = _record(r, cap)
        row_bytes = x.shape[1] * x.element_size()
        self.last["bytes_sent"] = {
            "counts": (n - 1) * per * send.element_size(),
            "dispatch": (sum(in_splits) - in_splits[self.rank]) * row_bytes,
            "combine": (sum(out_splits) - out_splits[self.rank]) * row_bytes,
        }
        return combine(back, rows, r, len(x))

    def _exchange_counts(self, send):
        """Per-expert counts (E,) out, (n, E/n) in: how many rows each rank will send us."""
        if self.world_size == 1:
            return send.view(1, -1)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # equal splits: E/n counts each
        return recv.view(self.world_size, -1)

    def _all_to_all(self, x, out_splits, in_splits):
        if self.world_size == 1:
            return x  # one process: nothing to move, the same code runs
        return all_to_all(x, out_splits, in_splits, self.group)

    def sync_router_grads(self):
        """Sum the router's gradients over ranks: each copy saw only its own rank's tokens.

        Experts need nothing: the backward all-to-all already brought them every rank's rows.
        So both are sums over ranks, as if the loss were the sum of the ranks' losses."""
        if self.world_size == 1:
            return
        for p in self.router.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
