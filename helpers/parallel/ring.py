"""Ring all-reduce, step by step, simulated (no processes): what each rank holds after each step.

n ranks, each with n chunks. Reduce-scatter: in step s, rank r sends chunk (r - s) mod n to rank
r + 1, which adds it to its own. After n - 1 steps rank r holds the full sum of chunk (r + 1) mod n.
All-gather: n - 1 more steps pass the finished chunks around. Each rank sends one chunk per step:
2(n - 1) chunks of S/n bytes, i.e. 2(n - 1)/n × S — the figure busbw is built on.
Used by lecture 01's step-by-step widget.
"""

from __future__ import annotations


def steps(n: int) -> list[dict]:
    """States 0 .. 2(n-1): {'phase', 'sends': [(src, dst, chunk)], 'held': n×n lists of contributors}."""
    if n < 2:
        raise ValueError("a ring needs at least 2 ranks")
    held = [[{r} for _ in range(n)] for r in range(n)]  # held[rank][chunk] = ranks summed in
    states = [{"phase": "start", "sends": [], "held": [[sorted(c) for c in row] for row in held]}]
    for s in range(n - 1):  # reduce-scatter
        sends = [(r, (r + 1) % n, (r - s) % n) for r in range(n)]
        incoming = [(dst, chunk, set(held[src][chunk])) for src, dst, chunk in sends]
        for dst, chunk, contrib in incoming:
            held[dst][chunk] |= contrib
        states.append(
            {
                "phase": "reduce-scatter",
                "sends": sends,
                "held": [[sorted(c) for c in row] for row in held],
            }
        )
    for s in range(n - 1):  # all-gather
        sends = [(r, (r + 1) % n, (r + 1 - s) % n) for r in range(n)]
        incoming = [(dst, chunk, set(held[src][chunk])) for src, dst, chunk in sends]
        for dst, chunk, contrib in incoming:
            held[dst][chunk] = contrib
        states.append(
            {
                "phase": "all-gather",
                "sends": sends,
                "held": [[sorted(c) for c in row] for row in held],
            }
        )
    return states


def bytes_sent_per_rank(nbytes: int, n: int) -> float:
    """What the simulation sends per rank: 2(n-1) chunks of nbytes/n."""
    return 2 * (n - 1) * nbytes / n
