"""helpers.parallel.context: the log-sum-exp merge is exact, ring attention on 2-4 gloo ranks equals
one-process attention (causal or not, contiguous or zigzag), and the measured sends, bytes and
score pairs are the theory's."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import helpers
from helpers.parallel import context as cp

B, HEADS, S, D = 2, 2, 24, 8  # S divides into 2n chunks for n = 2, 3, 4
CONFIGS = list(itertools.product([False, True], cp.LAYOUTS))  # (causal, layout)


def qkv(seed=0, s=S):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, HEADS, s, D, generator=g, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("causal", [False, True])
def test_the_reference_is_torchs_attention(causal):
    q, k, v = qkv()
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(cp.attention(q, k, v, causal=causal), expected)


@pytest.mark.parametrize("causal", [False, True])
def test_merging_two_halves_of_the_keys_is_attention_over_all(causal):
    q, k, v = qkv(1)
    mask = torch.ones(S, S, dtype=torch.bool).tril() if causal else None
    out, lse = cp.attention_with_lse(q, k, v, mask)
    torch.testing.assert_close(out, cp.attention(q, k, v, causal=causal))
    torch.testing.assert_close(lse, torch.logsumexp(q @ k.mT / D**0.5 + _bias(mask), -1))
    h = S // 2
    # causal: the first h queries see nothing of the second half, a whole side at lse = -inf
    halves = [
        cp.attention_with_lse(q, k[:, :, sl], v[:, :, sl], None if mask is None else mask[:, sl])
        for sl in (slice(0, h), slice(h, S))
    ]
    merged, merged_lse = cp.merge(*halves[0], *halves[1])
    torch.testing.assert_close(merged, out)
    torch.testing.assert_close(merged_lse, lse)
    merged, merged_lse = cp.merge(*halves[1], *halves[0])  # order does not matter
    torch.testing.assert_close(merged, out)


def _bias(mask):
    return 0.0 if mask is None else torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))


def test_merge_is_stable_where_a_side_saw_no_keys_or_scores_are_large():
    out = torch.randn(1, 1, 3, 4, dtype=torch.float64)
    inf = float("-inf")
    lse_a = torch.tensor([[[inf, 1000.0, inf]]], dtype=torch.float64)
    lse_b = torch.tensor([[[2.0, inf, inf]]], dtype=torch.float64)
    merged, lse = cp.merge(out, lse_a, 2 * out, lse_b)
    assert not merged.isnan().any()
    torch.testing.assert_close(merged[..., 0, :], 2 * out[..., 0, :])  # only b saw keys
    torch.testing.assert_close(merged[..., 1, :], out[..., 1, :])  # only a, at exp(1000)
    torch.testing.assert_close(merged[..., 2, :], torch.zeros(1, 1, 4, dtype=torch.float64))
    assert lse.tolist() == [[[2.0, 1000.0, inf]]]
    # a query row that sees no key in its block: out 0, lse -inf, no NaN
    q, k, v = qkv(2, s=4)
    none = torch.zeros(4, 4, dtype=torch.bool)
    o, lse = cp.attention_with_lse(q, k, v, none)
    assert (o == 0).all() and (lse == inf).all()


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_split_and_unsplit_are_inverse_and_match_positions(n, layout):
    x = torch.arange(S).view(1, 1, S, 1)
    parts = [cp.split(x, r, n, layout) for r in range(n)]
    torch.testing.assert_close(cp.unsplit(parts, layout), x)
    for r, part in enumerate(parts):
        assert part.flatten().tolist() == cp.positions(r, n, S // n, layout).tolist()
    if layout == "zigzag" and n == 2:
        assert [p.flatten().tolist() for p in parts] == [
            [0, 1, 2, 3, 4, 5, 18, 19, 20, 21, 22, 23],
            [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
        ]
    with pytest.raises(ValueError, match="cannot be cut"):
        cp.split(torch.zeros(1, 1, 10, 1), 0, 4, layout)
    with pytest.raises(ValueError, match="layout must be one of"):
        cp.split(x, 0, n, "striped")


def _ring(configs):
    """On every rank: the full q, k, v from one seed, this rank's share, ring attention on it."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    q, k, v = qkv()
    results = {}
    for causal, layout in configs:
        local = [cp.split(t, rank, n, layout) for t in (q, k, v)]
        results[causal, layout] = cp.ring_attention(
            *local, causal=causal, layout=layout, stats=True
        )
    if n == 3:  # a ring on a subgroup: group ranks 0, 1 are global ranks 1, 2
        group = dist.new_group([1, 2])
        if rank in (1, 2):
            local = [cp.split(t, rank - 1, 2, "zigzag") for t in (q, k, v)]
            results["group"] = cp.ring_attention(*local, causal=True, group=group, layout="zigzag")
    return results


@pytest.fixture(scope="module", params=[2, 3, 4])
def runs(request):
    n = request.param
    return n, helpers.launch(_ring, CONFIGS, world_size=n, output="none")


def test_ring_attention_equals_one_process_attention(runs):
    n, results = runs
    q, k, v = qkv()
    for causal, layout in CONFIGS:
        got = cp.unsplit([r[causal, layout][0] for r in results], layout)
        expected = cp.attention(q, k, v, causal=causal)
        torch.testing.assert_close(
            got, expected, msg=lambda m, c=causal, lay=layout: f"causal={c} {lay}: {m}"
        )
    if n == 3:
        got = cp.unsplit([results[1]["group"], results[2]["group"]], "zigzag")
        torch.testing.assert_close(got, cp.attention(q, k, v, causal=True))


def test_measured_sends_bytes_and_pairs_are_the_theory(runs):
    n, results = runs
    for causal, layout in CONFIGS:
        stats = [r[causal, layout][1] for r in results]
        assert [st["sends"] for st in stats] == [n - 1] * n
        sent = cp.ring_bytes(B, HEADS, S, D, n, itemsize=8)
        assert [st["bytes_sent"] for st in stats] == [sent] * n
        theory = cp.work_per_rank(S, n, causal, layout)
        assert [st["pairs"] for st in stats] == [B * HEADS * w for w in theory], (causal, layout)


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    for n in (2, 3, 4, 8):
        contiguous = cp.work_per_rank(48, n, causal=True, layout="contiguous")
        zigzag = cp.work_per_rank(48, n, causal=True, layout="zigzag")
        assert contiguous == sorted(contiguous) and contiguous[-1] == n * contiguous[0]
        assert len(set(zigzag)) == 1
        # balanced, and no more work in total than the contiguous cut
        assert sum(zigzag) <= sum(contiguous)
        assert cp.work_per_rank(48, n) == [48 * 48 // n] * n


def test_peak_bytes_counts_the_live_tensors_and_the_score_block_shrinks_as_n_squared():
    b, h, s, d, n = 2, 2, 64, 8, 4
    c = s // n
    shapes = [(b, h, c, d)] * 3 + [(2, b, h, c, d)] * 2 + [(b, h, c, c), (b, h, c, d), (b, h, c)]
    expected = sum(torch.zeros(shape).nbytes for shape in shapes)
    assert cp.peak_bytes(b, h, s, d, n) == expected
    scores = [cp.peak_bytes(1, 1, 4096, 0, n) for n in (1, 2, 4)]  # d = 0: the s² term alone
    assert scores[0] / scores[1] == pytest.approx(4, rel=1e-3)
    assert scores[0] / scores[2] == pytest.approx(16, rel=1e-3)
