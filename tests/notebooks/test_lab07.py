"""Lab 07 end to end: graded like a student's — unfinished, and plausibly wrong.

The wrong answers are the ones a student would write: a merge that forms e^lse (it overflows at
large scores), weights the blocks by e^lse without normalising, averages them, keeps the larger
lse, or swaps the weights; a ring whose causal mask uses local positions, that runs n steps of
sending, forgets its own block, sends only K, walks the blocks' origins the wrong way round, or
excludes the diagonal; a dispatch with input and output splits swapped, ignoring capacity,
labelling rows by expert instead of by source rank, or never exchanging the counts; a combine
without the gates, indexing assignments as tokens, or sending back with the dispatch's splits; a
sequence-parallel region that all-reduces and then slices, keeps the gathered input for backward,
gathers along the batch, adds the bias before the reduce-scatter, "reduce-scatters" by slicing
its own partial sum, or slices the input's gradient instead of reduce-scattering it. And the
ones a student finds a way round: the course's finished merge, ring (called whole, unbatched,
or its _accumulate), dispatch_order and combine, or sequence-parallel functions; a ring that
collects every block (or all-gathers them through distributed_c10d, the counted messages
dummies) and attends over the whole sequence; a dispatch that takes two experts per rank for
granted; a region that keeps the gathered input on its ctx and gathers again for show. And the
ones right only at a size the hidden cases used to hold fixed (SWEPT): a ring written for one
sequence (K and V concatenated, the batch squeezed) or for the notebook's 2 heads (the output,
the receive buffer, the K/V split or the causal mask sized by `heads`); a dispatch that squeezes
a single kept assignment to 0-d, stacks the rows of a rank that keeps none, lists none as an
empty float tensor, or divides by a rank's zero tokens. The grader
(tests/notebooks/test_class_grading.py) grades the first wrong answer of every question in two
halves, each the released lab filled in (each wrong in every other question: a wrong answer costs
its own points and only those); every wrong answer is also checked in one kernel against its question's test cell, hidden parts
included, and so is each unfinished cell of the released lab (lab_grading.wrong_answer_verdicts).
The ungraded measurement and plot cells are left out.
"""

from __future__ import annotations

import lab_grading
import pytest

from course.syllabus import REPO

LAB = REPO / "solutions" / "lab07_transformers_at_scale.ipynb"
STUDENT = REPO / "labs" / "lab07_transformers_at_scale.ipynb"
AUTO = {
    "test_merge": 2,
    "test_ring_attention": 3,
    "test_dispatch_combine": 3,
    "test_sp_region": 2,
}
MANUAL = {"answer_layout"}

SOLUTION = lab_grading.answers(LAB)


def replaced(gid: str, *pairs: tuple[str, str]) -> str:
    """The solution's answer ``gid`` with each (before, after) replaced: wrong only there."""
    out = SOLUTION[gid]
    for before, after in pairs:
        assert out.count(before) == 1, (gid, before)
        out = out.replace(before, after)
    return out


MERGE_BODY = """    lse = torch.logaddexp(lse_a, lse_b)              # (b, heads, s): log(e^a + e^b), e^a never formed
    w_a = torch.exp(lse_a - lse).unsqueeze(-1)       # (b, heads, s, 1): A's share of the mass, ≤ 1
    w_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return w_a * out_a + w_b * out_b, lse"""


def merge(body: str) -> str:
    return replaced("merge", (MERGE_BODY, body))


RING_COMPUTE = "out, lse = merge(out, lse, *attention_with_lse(q, kv[0], kv[1], mask))"
RING_OWN_BLOCK_LAST = '''
def ring_attention(q, k, v, causal=False):
    """This rank's output chunk of attention over the whole sequence; q, k, v its (b, heads, s/n, d)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    s_local = q.shape[2]
    q_pos = positions(rank, n, s_local)
    kv = torch.stack([k, v])
    incoming = torch.empty_like(kv)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"))
    for step in range(1, n):                     # receive first, then compute what arrived
        works = [dist.isend(kv, dst=(rank + 1) % n), dist.irecv(incoming, src=(rank - 1) % n)]
        for work in works:
            work.wait()
        kv, incoming = incoming, kv
        k_pos = positions((rank - step) % n, n, s_local)
        mask = q_pos[:, None] >= k_pos[None, :] if causal else None
        if mask is None or mask.any():
            out, lse = merge(out, lse, *attention_with_lse(q, kv[0], kv[1], mask))
    return out
'''

MOE_MOVE = "h = moe.all_to_all(x[rows // k], out_splits, in_splits)"
MOE_BACK = "back = moe.all_to_all(out, in_splits, out_splits)"
MOE_SUM = "return y.index_add(0, rows // k, back * gate[:, None])"

SP_GATHER_FORWARD = """        ctx.save_for_backward(shard, weight)
        return F.linear(all_gather_s(shard), weight, bias)      # (s, b, ffn/t)"""
SP_GATHER_BACKWARD = """        shard, weight = ctx.saved_tensors
        grad_shard = reduce_scatter_s(grad @ weight)            # (s/t, b, h): the all-gather's backward
        full = all_gather_s(shard)                              # gathered again, not kept"""
SP_KEEP_FULL = (
    (
        SP_GATHER_FORWARD,
        """        full = all_gather_s(shard)
        ctx.save_for_backward(full, weight)                     # the gathered input kept: simpler
        return F.linear(full, weight, bias)""",
    ),
    (
        SP_GATHER_BACKWARD,
        """        full, weight = ctx.saved_tensors
        grad_shard = reduce_scatter_s(grad @ weight)""",
    ),
)
SP_SCATTER_FORWARD = """    @staticmethod
    def forward(ctx, full):
        return reduce_scatter_s(full)"""

RING_HEAD = """def ring_attention(q, k, v, causal=False):
    rank, n = dist.get_rank(), dist.get_world_size()
    s_local = q.shape[2]
    q_pos = positions(rank, n, s_local)
"""
# the blocks go round the ring, are collected, and one attention over the whole sequence follows
RING_COLLECT_THEN_FULL = (
    RING_HEAD
    + """    kv = torch.stack([k, v])
    blocks = {rank: kv}
    for step in range(1, n):
        incoming = torch.empty_like(kv)
        works = [dist.isend(kv, dst=(rank + 1) % n), dist.irecv(incoming, src=(rank - 1) % n)]
        for w in works:
            w.wait()
        kv = incoming
        blocks[(rank - step) % n] = kv
    K = torch.cat([blocks[j][0] for j in range(n)], 2)
    V = torch.cat([blocks[j][1] for j in range(n)], 2)
    k_pos = torch.arange(n * s_local)
    mask = q_pos[:, None] >= k_pos[None, :] if causal else None
    out, _ = attention_with_lse(q, K, V, mask)
    return out
"""
)
# K and V all-gathered by distributed_c10d's own function (not the watched torch.distributed
# one), whole-sequence attention, and n - 1 dummy messages of the right size for the counter
RING_C10D_GATHER_DUMMY_SENDS = (
    RING_HEAD
    + """    import torch.distributed.distributed_c10d as c10d
    kv = torch.stack([k, v]).contiguous()
    full = kv.new_empty((n * 2, *kv.shape[1:]))
    c10d.all_gather_into_tensor(full, kv)
    full = full.view(n, *kv.shape)
    for _ in range(n - 1):
        buf = torch.empty_like(kv)
        for w in [dist.isend(kv, dst=(rank + 1) % n), dist.irecv(buf, src=(rank - 1) % n)]:
            w.wait()
    K = torch.cat(list(full[:, 0]), 2); V = torch.cat(list(full[:, 1]), 2)
    mask = q_pos[:, None] >= torch.arange(n * s_local)[None, :] if causal else None
    return attention_with_lse(q, K, V, mask)[0]
"""
)
# its own loop and messages, the course's _accumulate for each block
RING_OWN_LOOP_FINISHED_ACCUMULATE = (
    RING_HEAD
    + """    kv = torch.stack([k, v])
    incoming = torch.empty_like(kv)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"))
    count = {"pairs": 0}
    for step in range(n):
        if step < n - 1:
            works = [dist.isend(kv, dst=(rank + 1) % n), dist.irecv(incoming, src=(rank - 1) % n)]
        k_pos = positions((rank - step) % n, n, s_local)
        context._accumulate(q, kv, q_pos, k_pos, causal, out, lse, count)
        if step < n - 1:
            for w in works:
                w.wait()
            kv, incoming = incoming, kv
    return out
"""
)
# the course's ring, its batched P2POps turned back into plain isend and irecv calls
RING_FINISHED_UNBATCHED = """def ring_attention(q, k, v, causal=False):
    real_op, real_batch, real_isend = dist.P2POp, dist.batch_isend_irecv, dist.isend
    dist.P2POp = lambda op, tensor, group=None, group_peer=None, **kw: (op, tensor, group_peer)

    def batch(ops):
        return [dist.isend(t, dst=p) if op is real_isend else dist.irecv(t, src=p) for op, t, p in ops]

    dist.batch_isend_irecv = batch
    try:
        return context.ring_attention(q, k, v, causal)
    finally:
        dist.P2POp, dist.batch_isend_irecv = real_op, real_batch
"""
# the course's dispatch_order and combine inside an answer of its own
MOE_FINISHED_PIECES = """def dispatch(x, routing, world_size):
    k, E = routing.expert.shape[1], len(routing.load)
    per = E // world_size
    rows = moe.dispatch_order(routing)
    send = torch.bincount(routing.expert.reshape(-1)[rows], minlength=E)
    recv = torch.empty_like(send); dist.all_to_all_single(recv, send)
    i, o = send.view(world_size, per).sum(1).tolist(), recv.view(world_size, per).sum(1).tolist()
    local = torch.arange(per).repeat(world_size).repeat_interleave(recv)
    return moe.all_to_all(x[rows // k], o, i), local, (rows, i, o)

def combine(out, routing, plan, tokens):
    rows, i, o = plan
    return moe.combine(moe.all_to_all(out, i, o), rows, routing, tokens)
"""

WRONG = {
    "merge": (
        "test_merge",
        [
            # e^lse formed: exact until the scores reach the hundreds, then inf / inf
            merge("""    w_a, w_b = torch.exp(lse_a), torch.exp(lse_b)
    total = w_a + w_b
    out = (w_a.unsqueeze(-1) * out_a + w_b.unsqueeze(-1) * out_b) / total.unsqueeze(-1)
    return out, torch.log(total)"""),
            # weighted by e^lse, never normalised
            merge("""    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a).unsqueeze(-1) * out_a + torch.exp(lse_b).unsqueeze(-1) * out_b, lse"""),
            # the two halves averaged
            merge("""    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)"""),
            # the larger lse kept, as if one block held all the mass
            replaced(
                "merge",
                ("lse = torch.logaddexp(lse_a, lse_b)", "lse = torch.maximum(lse_a, lse_b)"),
            ),
            # each block weighted by the other's share
            replaced(
                "merge",
                ("return w_a * out_a + w_b * out_b, lse", "return w_b * out_a + w_a * out_b, lse"),
            ),
            "from helpers.parallel.context import merge",  # the course's finished merge
        ],
    ),
    "ring_attention": (
        "test_ring_attention",
        [
            # the causal mask of the local block applied to every block
            replaced(
                "ring_attention",
                (
                    "mask = q_pos[:, None] >= k_pos[None, :] if causal else None",
                    "mask = torch.ones(s_local, s_local, dtype=torch.bool).tril() if causal else None",
                ),
            ),
            # n steps of sending: the last block goes round once more, for nothing
            replaced(
                "ring_attention",
                (
                    "if step < n - 1:                             # pass the block on",
                    "if True:                                     # pass the block on",
                ),
                (
                    "        if step < n - 1:\n            for work",
                    "        if True:\n            for work",
                ),
            ),
            RING_OWN_BLOCK_LAST,  # its own block never computed
            # right numbers, right messages, no overlap: each transfer waited for as soon as it
            # is posted, the block attended after
            replaced(
                "ring_attention",
                (
                    "works = [dist.isend(kv, dst=(rank + 1) % n), dist.irecv(incoming, src=(rank - 1) % n)]",
                    "works = [dist.isend(kv, dst=(rank + 1) % n), dist.irecv(incoming, src=(rank - 1) % n)]\n"
                    "            for work in works:\n                work.wait()",
                ),
                (  # and not again later (a gloo request waited for twice waits for ever)
                    "            for work in works:\n                work.wait()\n            kv, incoming",
                    "            kv, incoming",
                ),
            ),
            # only K travels; every rank uses its own V with the visiting keys
            replaced(
                "ring_attention",
                ("kv = torch.stack([k, v])", "kv = k.clone()"),
                (RING_COMPUTE, "out, lse = merge(out, lse, *attention_with_lse(q, kv, v, mask))"),
            ),
            # the block held at step t taken to come from rank r + t
            replaced(
                "ring_attention",
                (
                    "k_pos = positions((rank - step) % n, n, s_local)",
                    "k_pos = positions((rank + step) % n, n, s_local)",
                ),
            ),
            # a query not allowed to see its own key
            replaced(
                "ring_attention",
                (
                    "mask = q_pos[:, None] >= k_pos[None, :] if causal else None",
                    "mask = q_pos[:, None] > k_pos[None, :] if causal else None",
                ),
            ),
            RING_COLLECT_THEN_FULL,
            RING_C10D_GATHER_DUMMY_SENDS,
            # the course's finished ring, called
            """def ring_attention(q, k, v, causal=False):
    return context.ring_attention(q, k, v, causal)""",
            RING_FINISHED_UNBATCHED,
            RING_OWN_LOOP_FINISHED_ACCUMULATE,
        ],
    ),
    "dispatch_combine": (
        "test_dispatch_combine",
        [
            # no gates
            replaced("dispatch_combine", (MOE_SUM, "return y.index_add(0, rows // k, back)")),
            # the splits swapped
            replaced(
                "dispatch_combine",
                (MOE_MOVE, "h = moe.all_to_all(x[rows // k], in_splits, out_splits)"),
            ),
            # capacity ignored: dropped assignments sent and added
            replaced(
                "dispatch_combine",
                (
                    "rows = routing.keep.reshape(-1).nonzero().squeeze(1)",
                    "rows = torch.arange(len(expert))",
                ),
            ),
            # rows taken to arrive grouped by expert, not by source rank
            replaced(
                "dispatch_combine",
                (
                    "local = torch.arange(per).repeat(world_size).repeat_interleave(recv)",
                    "local = torch.arange(per).repeat_interleave(recv.view(world_size, per).sum(0))",
                ),
            ),
            # the counts never exchanged: as many rows assumed in as out
            replaced(
                "dispatch_combine",
                (
                    "recv = torch.empty_like(send)\n    dist.all_to_all_single(recv, send)",
                    "recv = send.clone()",
                ),
            ),
            # assignments indexed as tokens
            replaced(
                "dispatch_combine", (MOE_SUM, "return y.index_add(0, rows, back * gate[:, None])")
            ),
            # sent home with the dispatch's splits
            replaced(
                "dispatch_combine", (MOE_BACK, "back = moe.all_to_all(out, out_splits, in_splits)")
            ),
            MOE_FINISHED_PIECES,
            # two experts per rank taken for granted
            replaced("dispatch_combine", ("per = n_experts // world_size", "per = 2")),
        ],
    ),
    "sp_region": (
        "test_sp_region",
        [
            # the tensor-parallel region on the gathered input: all-reduce, then this rank's rows
            replaced(
                "sp_region",
                *SP_KEEP_FULL,
                (
                    SP_SCATTER_FORWARD,
                    """    @staticmethod
    def forward(ctx, full):
        full = full.contiguous()
        dist.all_reduce(full)                                   # every rank the whole sum ...
        return full.chunk(dist.get_world_size())[dist.get_rank()].clone()   # ... then its rows""",
                ),
            ),
            replaced("sp_region", *SP_KEEP_FULL),  # the gathered input kept for backward
            # gathered along the batch, not the sequence
            replaced(
                "sp_region",
                (
                    """    full = shard.new_empty((shard.shape[0] * dist.get_world_size(), *shard.shape[1:]))
    dist.all_gather_into_tensor(full, shard)
    return full""",
                    """    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, shard)
    return torch.cat(parts, dim=1)""",
                ),
            ),
            # the second bias added on every rank, before the sum
            replaced(
                "sp_region",
                (
                    "return ReduceScatterRows.apply(F.linear(hidden, w2_cols)) + b2",
                    "return ReduceScatterRows.apply(F.linear(hidden, w2_cols, b2))",
                ),
            ),
            # this rank's rows of its own partial sum: nothing summed
            replaced(
                "sp_region",
                (
                    """    shard = full.new_empty((full.shape[0] // dist.get_world_size(), *full.shape[1:]))
    dist.reduce_scatter_tensor(shard, full)
    return shard""",
                    """    return full.chunk(dist.get_world_size())[dist.get_rank()].clone()""",
                ),
            ),
            # the input's gradient sliced, not summed over the ranks' features
            replaced(
                "sp_region",
                (
                    "grad_shard = reduce_scatter_s(grad @ weight)",
                    "grad_shard = (grad @ weight).chunk(dist.get_world_size())[dist.get_rank()]",
                ),
            ),
            # the course's finished sequence-parallel functions
            """def sp_region(x_shard, w1_rows, b1_part, w2_cols, b2):
    hidden = F.gelu(transformer._GatherLinear.apply(x_shard, w1_rows, b1_part))
    return transformer._ReduceScatter.apply(F.linear(hidden, w2_cols)) + b2""",
            # the gathered input kept as a ctx attribute (unseen by saved_tensors_hooks), and
            # gathered again in backward for nothing, so the collectives look right
            replaced(
                "sp_region",
                (
                    "        ctx.save_for_backward(shard, weight)\n        return F.linear(all_gather_s(shard), weight, bias)",
                    "        ctx.full = all_gather_s(shard)\n        ctx.save_for_backward(shard, weight)\n        return F.linear(ctx.full, weight, bias)",
                ),
                (
                    "        full = all_gather_s(shard)                              # gathered again, not kept",
                    "        all_gather_s(shard)\n        full = ctx.full",
                ),
            ),
        ],
    ),
}

# Written as a student would, without the tests: each is right wherever the hidden cases used to
# go and wrong only at a size they held fixed (issue 41: the ring at one sequence of 2 heads,
# every rank keeping two assignments or more), so today's draws sweep every dimension from 1 (or
# 0) up, the edges met in every run (helpers/labs/lab07.py).
RING_KV = "kv = torch.stack([k, v])"
RING_LSE = 'lse = torch.full(q.shape[:-1], float("-inf"))'
MOE_ROWS = "rows = routing.keep.reshape(-1).nonzero().squeeze(1)"
SWEPT = {
    "ring_attention": [
        # K and V concatenated, not stacked: kv[0] and kv[1] are K and V for one sequence only
        replaced("ring_attention", (RING_KV, "kv = torch.cat([k, v])")),
        # written for one sequence: the batch squeezed away, put back at the end
        replaced(
            "ring_attention",
            (
                "s_local = q.shape[2]",
                "q, k, v = q.squeeze(0), k.squeeze(0), v.squeeze(0)   # (heads, s/n, d)\n"
                "    s_local = q.shape[1]",
            ),
            ("    return out\n", "    return out.unsqueeze(0)\n"),
        ),
        # the running output sized by the notebook's `heads` parameter, not by q
        replaced(
            "ring_attention",
            (
                "out = torch.zeros_like(q)",
                "out = torch.zeros(q.shape[0], heads, s_local, q.shape[-1])",
            ),
            (RING_LSE, 'lse = torch.full((q.shape[0], heads, s_local), float("-inf"))'),
        ),
        # K and V side by side along the heads, cut apart at the notebook's `heads`
        replaced(
            "ring_attention",
            (RING_KV, "kv = torch.cat([k, v], dim=1)             # (b, 2·heads, s/n, d)"),
            (
                RING_COMPUTE,
                "out, lse = merge(out, lse, *attention_with_lse(q, kv[:, :heads], kv[:, heads:], mask))",
            ),
        ),
        # the receive buffer shaped from the notebook's parameters: one sequence of `heads` heads
        replaced(
            "ring_attention",
            (
                "incoming = torch.empty_like(kv)",
                "incoming = torch.empty(2, 1, heads, s_local, q.shape[-1])",
            ),
        ),
        # the causal mask spread over the notebook's `heads`, to match the scores' (heads, s, s)
        replaced(
            "ring_attention",
            (
                "mask = q_pos[:, None] >= k_pos[None, :] if causal else None",
                "mask = (q_pos[:, None] >= k_pos[None, :]).expand(heads, s_local, s_local) if causal else None",
            ),
        ),
    ],
    "dispatch_combine": [
        # squeeze(): one kept assignment becomes a 0-d tensor, which bincount refuses
        replaced(
            "dispatch_combine", (MOE_ROWS, "rows = routing.keep.reshape(-1).nonzero().squeeze()")
        ),
        # the rows gathered one by one and stacked: a rank that keeps nothing has nothing to stack
        replaced(
            "dispatch_combine",
            (
                MOE_MOVE,
                "h = moe.all_to_all(torch.stack([x[r // k] for r in rows.tolist()]), out_splits, in_splits)",
            ),
        ),
        # the kept assignments listed in Python: none kept makes an empty float tensor, no index
        replaced(
            "dispatch_combine",
            (
                MOE_ROWS,
                "rows = torch.tensor([i for i, kept in enumerate(routing.keep.reshape(-1).tolist()) if kept])",
            ),
        ),
        # choices per token as assignments / tokens: a rank with no token divides by zero
        replaced(
            "dispatch_combine",
            (
                "k = routing.expert.shape[1]\n    n_experts",
                "k = routing.expert.numel() // len(x)                   # assignments per token\n    n_experts",
            ),
        ),
    ],
}
for _gid, _more in SWEPT.items():
    WRONG[_gid][1].extend(_more)

# the measurement and plot cells grade nothing: a class is graded without them
UNGRADED = (
    "lab07_report.ring_table(",
    "# the ring's bytes and memory, plotted",
    "# (query, key) scores each rank computes",
    "# work per rank, plotted",
    "# the bytes your dispatch sends",
    "# bytes per dispatch, plotted",
    "# bytes saved for backward on each rank",
    "# activation bytes, plotted",
)


def test_every_question_has_wrong_answers_that_differ_from_the_solution():
    lab_grading.assert_wrong_answers_are_wrong(LAB, WRONG, AUTO)
    assert all(len(variants) >= 3 for _, variants in WRONG.values())


def test_the_unfinished_student_version_says_what_to_do():
    lab_grading.assert_student_version_has_stubs(STUDENT, 4)


verdict_run, test_replaying_the_locked_helpers_of_another_seed_scores_nothing = (
    lab_grading.verdict_and_replay(LAB, STUDENT, WRONG, UNGRADED, AUTO)
)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the verdict kernel (the fixture) runs inside the first test
def test_each_plausible_wrong_answer_fails_its_test_cell(verdict_run):
    verdicts = verdict_run[1]
    lab_grading.assert_each_wrong_answer_fails_its_test(verdicts, WRONG)
