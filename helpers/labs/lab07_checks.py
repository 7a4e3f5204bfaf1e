"""Lab 07's checks: each judges what a probe returned for one case against a reference it
computes itself, here, in the grader's own interpreter (course/grading/verdict.py): one
process's attention over all keys at once (float64), ``context.attention``, ``moe.MoE`` on each
rank's tokens, the dense MLP region. A check raises AssertionError with what is wrong; it reads
the probe's data as hostile (types, shapes and lengths checked before use).

The cases come from the test cell (its fixed ones) and from ``helpers.labs.lab07`` (those drawn
from the run's seed); the harness that made the data is ``helpers.labs.lab07_runs``, which runs
where the student's code runs and decides nothing.
"""

from __future__ import annotations

import math

import torch

from helpers.labs.lab07_runs import dense_region, output_weights, sees
from helpers.parallel import context, moe


def merge_reference(b, heads, s, d, split, mask, scale, seed, queries=None):
    """Attention of the last ``queries`` rows over all s keys at once and its lse, float64."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, heads, s, d, generator=g).double() for _ in range(3))
    rows = slice(s - (queries or s), s)
    scores = (q[:, :, rows] * scale) @ k.transpose(-2, -1) / math.sqrt(d)
    scores = scores.masked_fill(~sees(s, mask)[rows], float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def check_merge(case, result) -> None:
    """``merge_case(*case)``'s result: the student's own merge, out and lse as one pass."""
    want_out, want_lse = merge_reference(*case)
    assert isinstance(result, dict) and "merged" in result, (
        f"{case}: merge_case returned {type(result)}"
    )
    assert result.get("finished") == [], (
        f"{case}: write merge yourself: it calls {result.get('finished')}"
    )
    got = result["merged"]
    assert isinstance(got, list) and len(got) == 2, f"{case}: merge returns (out, lse)"
    for name, value, want in (("out", got[0], want_out), ("lse", got[1], want_lse)):
        assert isinstance(value, torch.Tensor) and value.shape == want.shape, (
            f"{case}: {name} has shape {getattr(value, 'shape', None)}, not {tuple(want.shape)}"
        )
        worst = (value.double() - want).abs().max().item()
        if name == "out":  # float32 scores of a few hundred: 1e-4 is their rounding
            tol = 1e-5 if case[6] == 1.0 else 1e-3
        else:
            tol = 1e-5 + 1e-6 * want.abs().max().item()
        assert worst <= tol, (
            f"{case}: {name} is off by {worst:.3g} (NaN: an overflow, or a row with no key "
            "that added something)"
        )


def check_ring(per_rank, n, s, causal, d=4, seed=0, b=1, heads=2) -> None:
    """``ring_runs(n, s, causal, ...)``: each rank's chunk of one process's attention, n − 1
    messages of K and V to the next rank, nothing else, no whole-sequence matrix product, and
    the block held attended while the next one travels."""
    where = (
        f"{n} ranks, s = {s}, {'causal' if causal else 'not causal'}, d = {d}, b = {b}, "
        f"{heads} heads"
    )
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, heads, s, d, generator=g) for _ in range(3))
    want = context.attention(q, k, v, causal)  # (b, heads, s, d), one process
    assert isinstance(per_rank, list) and len(per_rank) == n, f"{where}: {n} ranks expected"
    for rank in range(n):
        _ring_rank(per_rank[rank], f"{where}, rank {rank}", rank, n, s, causal, d, b, heads, want)


def _ring_rank(r, where, rank, n, s, causal, d, b, heads, want) -> None:
    c = s // n
    block = 2 * b * heads * c * d * 4  # one K, V block of float32
    most = b * heads * c * max(c, d)  # one block's scores, or one block of K
    assert r.get("finished") == [], (
        f"{where}: write the ring yourself: it calls {r.get('finished')}"
    )
    mine = context.split(want, rank, n)
    out = r["out"]
    assert isinstance(out, torch.Tensor) and out.shape == mine.shape, (
        f"{where}: the output has shape {getattr(out, 'shape', None)}, not {tuple(mine.shape)}"
    )
    worst = (out.double() - mine.double()).abs().max().item()
    assert worst < 1e-5, f"{where}: the output differs from one process's attention by {worst:.3g}"
    assert r["other"] == [], (
        f"{where}: it called {r['other']}; K and V move by dist.isend and dist.irecv only"
    )
    assert isinstance(r.get("biggest"), int) and r["biggest"] <= most, (
        f"{where}: a matrix product held {r.get('biggest')} elements, more than one block's "
        f"scores or one block of K ({most}): the ring attends block by block, never over the "
        "whole sequence's K and V at once"
    )
    assert r["sends"] == [[(rank + 1) % n, block]] * (n - 1), (
        f"{where}: sent {r['sends']} ([peer, bytes]); the ring sends n − 1 = {n - 1} messages "
        f"of {block} bytes (K and V stacked) to rank {(rank + 1) % n}, "
        f"{context.ring_bytes(b, heads, s, d, n)} bytes in all"
    )
    assert r["recvs"] == [[(rank - 1) % n, block]] * (n - 1), (
        f"{where}: received {r['recvs']}; the ring receives n − 1 = {n - 1} blocks of {block} "
        f"bytes from rank {(rank - 1) % n}"
    )
    # each step that receives and has a block to attend attends it while the next one travels:
    # all n − 1 such steps, or under a causal mask at least the first min(rank, n − 2) + 1 (on
    # rank r the blocks of steps after r are wholly in the future: skipping them is allowed)
    busy = n - 1 if not causal else min(rank, n - 2) + 1
    assert isinstance(r.get("overlapped"), list) and set(range(busy)) <= set(r["overlapped"]), (
        f"{where}: of the {n - 1} steps that receive a block, the block held was attended while "
        f"the next one travelled at steps {r.get('overlapped')}; it must be at steps 0 … "
        f"{busy - 1} at least: post the isend and irecv, compute with the block you hold, and "
        "only then wait()"
    )


def _moe_reference(n, tokens, top_k, factor, n_experts, seed, d, hidden):
    """moe.MoE on each rank's tokens (its gradients summed over them), each rank's
    (x, y, capacity, dropped), its kept assignments and the rows it sends to each rank."""
    dense = moe.MoE(d, hidden, n_experts, top_k, factor, seed=seed).double()
    per = n_experts // n
    shards, kept, to = [], [], []
    for rank in range(n):
        g = torch.Generator().manual_seed(1000 * seed + rank)
        x = torch.randn(tokens + rank, d, dtype=torch.float64, generator=g).requires_grad_()
        dy = torch.randn(tokens + rank, d, dtype=torch.float64, generator=g)
        y = dense(x)  # the one-process layer on this rank's tokens
        (y * dy).sum().backward()  # gradients add up over the ranks' tokens
        shards.append((x, y.detach(), dense.last["capacity"], dense.last["dropped"]))
        r = moe.route(dense.router(x), top_k, dense.last["capacity"])
        chosen = r.expert[r.keep]  # the kept assignments' experts
        kept.append(len(chosen))
        to.append([int((chosen // per == j).sum()) for j in range(n)])
    return dense, shards, kept, to


def check_moe(per_rank, n, tokens, top_k, factor, n_experts=4, seed=0, d=6, hidden=8) -> None:
    """``moe_runs(n, tokens, ...)``: moe.MoE on each rank's tokens, forward and backward, and
    four all_to_all_single calls that each move exactly the kept rows out and in."""
    where = (
        f"{n} ranks, {tokens} tokens + rank, top-{top_k}, capacity factor {factor}, "
        f"{n_experts} experts, width {d}"
    )
    assert isinstance(per_rank, list) and len(per_rank) == n, f"{where}: {n} ranks expected"
    dense, shards, kept, to = _moe_reference(n, tokens, top_k, factor, n_experts, seed, d, hidden)
    per = n_experts // n
    for rank in range(n):
        got, (x, y, cap, dropped) = per_rank[rank], shards[rank]
        w = f"{where}, rank {rank}"
        assert got.get("finished") == [], (
            f"{w}: write dispatch and combine yourself: they call {got.get('finished')}"
        )
        for name, value, want in (("the output", got["y"], y), ("the input's gradient", got["x"], x.grad)):  # fmt: skip
            assert isinstance(value, torch.Tensor) and value.shape == want.shape, (
                f"{w}: {name} is missing or shaped {getattr(value, 'shape', None)}, not "
                f"{tuple(want.shape)}"
            )
            worst = (value - want).abs().max().item() if want.numel() else 0.0  # no token
            assert worst < 1e-9, f"{w}: {name} differs from moe.MoE's on this rank's tokens by {worst:.3g}"  # fmt: skip
        for i in range(per):
            expert = rank * per + i
            for got_grad, p in zip(got["experts"][i], dense.experts[expert].parameters(), strict=True):  # fmt: skip
                assert isinstance(got_grad, torch.Tensor) and got_grad.shape == p.grad.shape, (
                    f"{w}: expert {expert} got no gradient"
                )
                assert (got_grad - p.grad).abs().max().item() < 1e-9, (
                    f"{w}: expert {expert}'s gradients differ from moe.MoE's (every rank's "
                    "tokens add to them)"
                )
        incoming = sum(to[j][rank] for j in range(n))
        rows = [[op, nbytes] for op, tensors, nbytes in got["calls"] if "float" in tensors]
        want_rows = [["all_to_all_single", (kept[rank] + incoming) * d * 8]] * 4
        assert rows == want_rows, (
            f"{w}: the token rows moved in {rows} ([call, bytes of its output and input]). With "
            f"capacity {cap}, {kept[rank]} of the {(tokens + rank) * top_k} assignments are kept "
            f"({dropped} dropped) and {incoming} rows come in for this rank's experts: four "
            "all_to_all_single calls (dispatch and combine, forward and backward) of "
            f"{kept[rank]} + {incoming} float64 rows of {d}"
        )
    summed = [sum(r["router"][i] for r in per_rank) for i in range(2)]  # each copy, its tokens
    for got_grad, p in zip(summed, dense.router.parameters(), strict=True):
        assert (
            isinstance(got_grad, torch.Tensor) and (got_grad - p.grad).abs().max().item() < 1e-9
        ), f"{where}: the router's gradients, summed over the ranks, differ from moe.MoE's"


def _dense_reference(s, b, h, ffn, seed=0):
    """The region in one process on the whole sequence, and its gradients."""
    dense, x = dense_region(s, b, h, ffn, seed)
    x.requires_grad_()
    out = dense(x)
    (out * output_weights(s, b, h)).sum().backward()
    return dense, x, out.detach()


def check_sp_dense(per_rank, n, s, b, h, ffn, seed=0) -> None:
    """``sp_runs(n, s, ...)``: each rank's rows of the dense region's output and of its input's
    gradient, its columns of the weights' gradients, and the second bias's summed."""
    where = f"{n} ranks, s = {s}, b = {b}, h = {h}, ffn = {ffn}"
    assert isinstance(per_rank, list) and len(per_rank) == n, f"{where}: {n} ranks expected"
    dense, x, out = _dense_reference(s, b, h, ffn, seed)
    for rank in range(n):
        r = per_rank[rank]
        assert r.get("finished") == [], (
            f"{where}, rank {rank}: write the region yourself: it calls {r.get('finished')}"
        )
        rows = slice(rank * s // n, (rank + 1) * s // n)
        part = slice(rank * ffn // n, (rank + 1) * ffn // n)
        for name, got, want in (
            ("the output", r["y"], out[rows]),
            ("the shard's gradient", r["x"], x.grad[rows]),
            ("the first weight's gradient", r["w1"], dense[0].weight.grad[part]),
            ("the first bias's gradient", r["b1"], dense[0].bias.grad[part]),
            ("the second weight's gradient", r["w2"], dense[2].weight.grad[:, part]),
        ):
            assert isinstance(got, torch.Tensor) and got.shape == want.shape, (
                f"{where}, rank {rank}: {name} is missing or shaped "
                f"{getattr(got, 'shape', None)}, not {tuple(want.shape)}"
            )
            worst = (got - want).abs().max().item()
            assert worst < 1e-5, (
                f"{where}, rank {rank}: {name} differs from the dense region's by {worst:.3g}"
            )
    b2 = sum(r["b2"] for r in per_rank)  # each rank's bias saw its own rows
    assert (
        isinstance(b2, torch.Tensor)
        and b2.shape == dense[2].bias.shape
        and (b2 - dense[2].bias.grad).abs().max().item() < 1e-5
    ), (
        f"{where}: the second bias's gradients, summed over the ranks, differ from the dense region's"
    )


def _kind(op: str) -> str:
    for kind in ("all_gather", "reduce_scatter"):
        if op.startswith(kind):
            return kind
    return op


def check_sp_collectives(per_rank, n, s, b, h, ffn, seed=0) -> None:
    """``sp_runs(n, s, ...)``: forward one all-gather and one reduce-scatter along s, backward
    one reduce-scatter and two all-gathers, nothing else; at most the shard, the GELU's input
    and the row layer's input kept for backward."""
    where = f"{n} ranks, s = {s}, b = {b}, h = {h}, ffn = {ffn}"
    assert isinstance(per_rank, list) and len(per_rank) == n, f"{where}: {n} ranks expected"
    one = (s + s // n) * b * h * 4  # an (s, b, h) tensor and its shard, as handed to the call
    most = (s // n * b * h + 2 * s * b * ffn // n) * 4
    for rank in range(n):
        r = per_rank[rank]
        forward = sorted([_kind(op), nbytes] for op, nbytes in r["forward"])
        assert forward == [["all_gather", one], ["reduce_scatter", one]], (
            f"{where}, rank {rank}: forward called {r['forward']} ([call, bytes]); a "
            "sequence-parallel region all-gathers along s in and reduce-scatters along s out, "
            "nothing else"
        )
        backward = sorted([_kind(op), nbytes] for op, nbytes in r["backward"])
        assert backward == [["all_gather", one], ["all_gather", one], ["reduce_scatter", one]], (
            f"{where}, rank {rank}: backward called {r['backward']}; it reduce-scatters the "
            "input's gradient, all-gathers the output's and all-gathers the kept shard again"
        )
        assert isinstance(r["saved"], int) and r["saved"] <= most, (
            f"{where}, rank {rank}: the region saved {r['saved']} bytes for backward; the shard, "
            f"the GELU's input and the row layer's input are {most} (the all-reduce region "
            f"keeps the whole input: {(s * b * h + 2 * s * b * ffn // n) * 4})"
        )
