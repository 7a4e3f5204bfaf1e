"""Context parallelism: ring attention, the sequence cut across ranks. Lecture 08.

Attention over a sequence of s tokens costs an (s × s) score matrix per head; with the sequence
cut into n chunks, rank r keeps its queries and sees every key block in turn. K and V travel
around the ring (rank r sends to r + 1, receives from r - 1), one block per step, n - 1 steps,
and each visiting block's partial attention is folded into the running result by ``merge``, the
online-softmax (log-sum-exp) rule: exact, whatever the order the blocks arrive in.

Causal attention makes the contiguous cut unbalanced (rank 0 attends to one block, rank n - 1 to
all n); ``layout="zigzag"`` cuts the sequence into 2n chunks and gives rank r chunks r and
2n - 1 - r, one early and one late, so every rank does the same work.

Forward only: ``ring_attention`` runs under ``torch.no_grad()``. ``ring_bytes``, ``work_per_rank``
and ``peak_bytes`` are the theory the measured ``stats`` are held against.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

LAYOUTS = ("contiguous", "zigzag")


def attention(q, k, v, causal=False):
    """The one-process reference: softmax(q kᵀ / √d) v, q, k, v shaped (b, heads, s, d)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (b, h, s, s)
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # (b, h, s, d)


def attention_with_lse(q, k, v, mask=None):
    """One block: (out, lse), lse the log-sum-exp of each query row's scores (b, heads, s_q).

    ``mask`` (s_q, s_k), True where a query may see a key. A row that sees no key gets out = 0
    and lse = -inf: it contributes nothing when merged.
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (b, h, s_q, s_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (b, h, s_q)
    # exp(scores - lse) is the softmax; a row with no key has -inf - -inf = NaN, so shift it by 0
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    return probs @ v, lse  # (b, h, s_q, d), (b, h, s_q)


def merge(out_a, lse_a, out_b, lse_b):
    """Combine two partial attentions over disjoint key blocks into the one over both: (out, lse).

    Each ``out`` is softmax-normalised over its own keys; rescaled by exp(lse_side - lse) it
    becomes normalised over both. lse ≥ either side, so every exponent is ≤ 0 (no overflow).
    """
    lse = torch.logaddexp(lse_a, lse_b)  # (b, h, s)
    base = _finite(lse)  # rows where neither side saw a key: weights exp(-inf) = 0, not NaN
    w_a = torch.exp(lse_a - base).unsqueeze(-1)  # (b, h, s, 1)
    w_b = torch.exp(lse_b - base).unsqueeze(-1)
    return w_a * out_a + w_b * out_b, lse


def _finite(lse):
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _check(s, world_size, layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    parts = world_size * (2 if layout == "zigzag" else 1)
    if s % parts:
        raise ValueError(f"a sequence of {s} cannot be cut into {parts} equal chunks ({layout})")


def split(x, rank, world_size, layout="contiguous", dim=2):
    """Rank ``rank``'s share of the full sequence ``x`` along ``dim``."""
    _check(x.shape[dim], world_size, layout)
    if layout == "contiguous":
        return x.chunk(world_size, dim)[rank]
    chunks = x.chunk(2 * world_size, dim)  # one early chunk and its mirror from the end
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim)


def unsplit(chunks, layout="contiguous", dim=2):
    """The full sequence from every rank's share, in rank order (the inverse of ``split``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    if layout == "contiguous":
        return torch.cat(list(chunks), dim)
    halves = [c.chunk(2, dim) for c in chunks]
    # early chunks 0 .. n-1 in rank order, then the late ones n .. 2n-1 held by ranks n-1 .. 0
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def positions(rank, world_size, s_local, layout="contiguous"):
    """Global token positions of rank ``rank``'s ``s_local`` tokens, in the order it holds them."""
    _check(s_local * world_size, world_size, layout)
    if layout == "contiguous":
        return torch.arange(rank * s_local, (rank + 1) * s_local)
    half = s_local // 2
    late = 2 * world_size - 1 - rank
    return torch.cat(
        [torch.arange(rank * half, (rank + 1) * half), torch.arange(late * half, (late + 1) * half)]
    )


def _plan(q_pos, k_pos):
    """What to compute of one (local q) × (visiting k) block: (rows, cols, mask), or None to skip.

    rows and cols are the slices that see anything; mask is None when all of that is visible.
    Contiguous: a past block whole, the diagonal with its triangle, a future block skipped.
    Zigzag: a past rank's block against its early half of keys only, a later rank's block with
    our late half of queries only: half a block, no mask, so every rank does the same work.
    """
    visible = q_pos[:, None] >= k_pos[None, :]  # (s_q, s_k) causal, in global positions
    if not visible.any():
        return None
    rows, cols = _span(visible.any(1)), _span(visible.any(0))
    sub = visible[rows, cols]
    return rows, cols, None if sub.all() else sub


def _span(keep):
    idx = keep.nonzero().flatten()
    return slice(int(idx[0]), int(idx[-1]) + 1)


@torch.no_grad()
def ring_attention(q, k, v, causal=False, group=None, layout="contiguous", stats=False):
    """This rank's output chunk of attention over the whole sequence, q, k, v its (b, h, s/n, d).

    Call on every rank of ``group``. K and V go once round the ring, stacked in one buffer (one
    send and one receive per step, batched), the next block's transfer running while the current one is computed.
    With ``stats=True`` returns (out, {"sends", "bytes_sent", "pairs"}): the isends this rank
    made, the bytes they carried, and the (query, key) scores it computed, over every batch
    element and head (``work_per_rank`` × b × heads).
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    s_local = q.shape[2]
    q_pos = positions(rank, n, s_local, layout)
    kv = torch.stack([k, v])  # (2, b, h, s/n, d): K and V travel together
    incoming = torch.empty_like(kv)
    out = torch.zeros_like(q)  # (b, h, s/n, d)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)  # (b, h, s/n)
    count = {"sends": 0, "bytes_sent": 0, "pairs": 0}
    for step in range(n):
        if step < n - 1:  # start passing the current block on before computing with it
            # one batched pair: on NCCL a lone isend to a peer that first sends to us can hang
            # (with n = 2 both neighbours are the same rank), and a batch posts both at once
            works = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, kv, group=group, group_peer=(rank + 1) % n),
                    dist.P2POp(dist.irecv, incoming, group=group, group_peer=(rank - 1) % n),
                ]
            )
            count["sends"] += 1
            count["bytes_sent"] += kv.numel() * kv.element_size()
        src = (rank - step) % n  # the rank this K, V block started on
        _accumulate(q, kv, q_pos, positions(src, n, s_local, layout), causal, out, lse, count)
        if step < n - 1:
            for work in works:
                work.wait()
            kv, incoming = incoming, kv  # what arrived is next; the sent buffer is free again
    return (out, count) if stats else out


def _accumulate(q, kv, q_pos, k_pos, causal, out, lse, count):
    """Fold one visiting block's attention into (out, lse), in place."""
    every = slice(None)
    plan = _plan(q_pos, k_pos) if causal else (every, every, None)
    if plan is None:  # wholly in the future: nothing to compute
        return
    rows, cols, mask = plan  # planned on CPU positions; the mask goes where the scores are
    mask = None if mask is None else mask.to(q.device)
    k, v = kv[0][:, :, cols], kv[1][:, :, cols]  # (b, h, cols, d)
    o_blk, lse_blk = attention_with_lse(q[:, :, rows], k, v, mask)
    out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o_blk, lse_blk)
    count["pairs"] += o_blk.shape[:3].numel() * k.shape[2]  # b · h · rows · cols


def ring_bytes(b, heads, s, d, world_size, itemsize=4):
    """Bytes each rank sends in one forward: n - 1 steps of its K and V blocks (b, h, s/n, d)."""
    return (world_size - 1) * 2 * b * heads * (s // world_size) * d * itemsize


def work_per_rank(s, world_size, causal=False, layout="contiguous"):
    """(query, key) scores each rank computes, rank by rank, per (batch, head).

    A diagonal block is computed whole and its future half masked away, as block-wise kernels
    do. Causal + contiguous: rank r computes r + 1 blocks of c² (c = s/n), unbalanced; zigzag:
    its diagonal c² plus half a block from each of the n - 1 others, the same on every rank.
    """
    _check(s, world_size, layout)
    c = s // world_size
    if not causal:
        return [c * s] * world_size
    if layout == "contiguous":
        return [(r + 1) * c * c for r in range(world_size)]
    return [c * c + (world_size - 1) * c * c // 2] * world_size


def peak_bytes(b, heads, s, d, world_size, itemsize=4):
    """Theory of the largest tensors live on one rank at once during ``ring_attention``.

    With c = s/n: local q, k, v (3 of b·h·c·d), the K/V buffer being sent and the one being
    received (2 + 2), the output (1): 8·b·h·c·d; one score block b·h·c² (the term that grows as
    s², cut by n² here); lse b·h·c. Temporaries (softmax's copy of the scores, a block's output
    before merging) add about as much again of the same shapes; the s² / n² scaling is the point.
    """
    c = s // world_size
    return itemsize * b * heads * (8 * c * d + c * c + c)
