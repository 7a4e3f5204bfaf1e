"""Lab 07's hidden cases, drawn from the run's seed (``COURSE_HIDDEN_SEED``): the probe draws
them and runs the student's code on each, the check draws them again and judges each one.

Its references need nothing of their own: the checks compute them with the course's
one-process versions (``context.attention``, ``moe.MoE``, a dense ``nn.Sequential``).

Every run sweeps every dimension of every input, each from its size-1 (or empty) edge up, so an
answer written for one of them held fixed (one sequence, the notebook's two heads, a rank that
keeps at least two assignments, a single query row never...) fails in every run, not only in
the runs that happen to draw that edge (tests/notebooks/test_lab07.py, SWEPT). Where an edge must be met, one of the draws takes it and
the seed picks which; the other sizes are drawn.
"""

from __future__ import annotations

import random

MASKS = ("none", "causal", "anti-causal")


def merge_cases(seed: int) -> list[tuple]:
    """Six merges, (b, heads, s, d, split, mask, scale, seed, queries): s keys of 2 to 12 cut
    at ``split``, the last ``queries`` query rows. Each of b (to 3), heads (to 4), d (to 8) and
    queries (to s) is 1 in two of the six and at least 2 in the others; two have a block of a
    single key; every mask twice, each scale three times."""
    rng = random.Random(seed)
    n = 6
    ones = {dim: set(rng.sample(range(n), 2)) for dim in ("b", "heads", "d", "queries", "key")}
    masks = rng.sample(MASKS * 2, n)  # in an order the seed picks
    scales = rng.sample((1.0, 300.0) * 3, n)
    cases = []
    for i in range(n):

        def size(dim: str, top: int, i: int = i) -> int:
            return 1 if i in ones[dim] else rng.randint(2, top)

        s = rng.randint(2, 12)
        split = rng.choice((1, s - 1)) if i in ones["key"] else rng.randint(1, s - 1)
        b, heads, d, queries = size("b", 3), size("heads", 4), size("d", 8), size("queries", s)
        cases.append((b, heads, s, d, split, masks[i], scales[i], rng.randint(0, 9999), queries))
    return cases


def ring_cases(seed: int) -> list[tuple]:
    """Three rings, (n, s, causal, d, seed, b, heads): one on each of 2, 3 and 4 ranks. Batch:
    1 in one, 2 or 3 in another; heads: 1 (causal) in one, 3 or 4 (not causal) in another;
    tokens per rank: 1 in one, 2 to 5 in another (head size 1 there: at one token and d = 1
    q kᵀ is no matrix product, and the overlap check would not see the block attended); the
    third draws each of them (b to 3, heads to 4, tokens to 5, causal or not); head sizes 2 to
    8 elsewhere.
    """
    rng = random.Random(seed)
    ns = rng.sample((2, 3, 4), 3)  # each edge met by one of the three, which one the seed picks
    bs = rng.sample((1, rng.randint(2, 3), rng.randint(1, 3)), 3)
    # (heads, causal): a causal mask with heads other than 2, and both masks met
    heads_causal = rng.sample(
        ((1, True), (rng.randint(3, 4), False), (rng.randint(1, 4), rng.random() < 0.5)), 3
    )
    # (tokens per rank, head size): one token; a head of size 1; both drawn
    shapes = [
        (1, rng.randint(2, 8)),
        (rng.randint(2, 5), 1),
        (rng.randint(1, 5), rng.randint(2, 8)),
    ]
    shapes = rng.sample(shapes, 3)
    return [
        (n, n * chunk, causal, d, rng.randint(0, 9999), b, h)
        for n, b, (h, causal), (chunk, d) in zip(ns, bs, heads_causal, shapes, strict=True)
    ]


def moe_cases(seed: int) -> list[tuple]:
    """Three expert-parallel layers, (n, tokens, top_k, factor, n_experts, seed, d): rank r has
    tokens + r tokens. One with tokens = 0 and top-1: rank 0 has no token (keeps nothing), rank
    1 one token and keeps exactly that assignment; the others 1 to 16 tokens, top-2 and top-3
    (at most E). 1, 2 and 3 experts per rank, one each; 2 to 4 ranks; capacity factors from 0.5
    (half the mean load) to 4 (nothing dropped); token widths 1 to 8, one of them 1."""
    rng = random.Random(seed)
    pers = rng.sample((1, 2, 3), 3)  # each edge met by one of the three, which one the seed picks
    widths = rng.sample((1, rng.randint(2, 8), rng.randint(1, 8)), 3)
    top_ks = [1, *rng.sample((2, 3), 2)]
    cases = []
    for i in range(3):
        n = rng.choice((2, 3, 4))
        n_experts = n * pers[i]
        tokens = 0 if i == 0 else rng.randint(1, 16)
        factor = rng.choice((0.5, 0.75, 1.0, 1.25, 1.5, 4.0))
        top_k = min(top_ks[i], n_experts)
        cases.append((n, tokens, top_k, factor, n_experts, rng.randint(0, 9999), widths[i]))
    return cases


def sp_cases(seed: int) -> list[tuple]:
    """Two sequence-parallel regions, (n, s, b, h, ffn, seed), on two of 2, 3 and 4 ranks: each
    of tokens per rank (to 4), batch (to 3), width h (to 6) and hidden features per rank (to 4)
    is 1 in one of the two and at least 2 in the other."""
    rng = random.Random(seed)
    ns = rng.sample((2, 3, 4), 2)
    one = {dim: rng.randrange(2) for dim in ("s", "b", "h", "ffn")}
    cases = []
    for i, n in enumerate(ns):

        def size(dim: str, top: int, i: int = i) -> int:
            return 1 if one[dim] == i else rng.randint(2, top)

        s, b, h, ffn = size("s", 4), size("b", 3), size("h", 6), size("ffn", 4)
        cases.append((n, n * s, b, h, n * ffn, rng.randint(0, 9999)))
    return cases
