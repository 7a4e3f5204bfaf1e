"""Predict a DDP step from its parts: compute time, bucket sizes, and the α-β fit.

DDP all-reduces each gradient bucket as soon as backward has produced it, one bucket after
another, while backward goes on. The model plays that out: bucket i is ready when backward has
produced the bytes up to it (gradients come out at an even rate), its all-reduce starts when it
is ready and the previous one has finished, and takes α + S_i/β. The step ends when both
backward and the last all-reduce are done; what sticks out past backward is exposed.
"""

from __future__ import annotations


def predict_step(
    forward_s: float,
    backward_s: float,
    optimizer_s: float,
    bucket_bytes: list[int],
    alpha: float,
    beta: float,
    overlap: bool = True,
) -> dict:
    """Predicted seconds: {'step', 'comm', 'exposed_comm'} for one DDP step.

    ``bucket_bytes`` in the order DDP reduces them (the first ready first); ``alpha`` in
    seconds, ``beta`` in bytes/s. ``overlap=False`` starts communication after backward.
    """
    if alpha < 0 or beta <= 0:
        raise ValueError("alpha must be >= 0 and beta > 0")
    total = sum(bucket_bytes)
    ready, done, comm, produced = 0.0, 0.0, 0.0, 0
    for size in bucket_bytes:
        produced += size
        ready = backward_s * produced / total if (overlap and total) else backward_s
        cost = alpha + size / beta
        done = max(ready, done) + cost
        comm += cost
    exposed = max(0.0, done - backward_s) if bucket_bytes else 0.0
    return {
        "step": forward_s + backward_s + exposed + optimizer_s,
        "comm": comm,
        "exposed_comm": exposed,
    }


def predict_scaling(compute: dict, bucket_bytes: list[int], fits: dict, world_sizes) -> list[dict]:
    """Predicted step time per world size; ``fits`` maps world size -> AlphaBeta (n=1: none).

    ``compute``: {'forward', 'backward', 'optimizer'} seconds of one rank's step at its batch,
    either one dict for every world size or ``{world_size: dict}``: the compute measured at
    each world size (on a CPU, ranks sharing memory bandwidth compute slower than one alone,
    and a model that assumes otherwise predicts a speedup nobody measures). Each row says
    which compute it used in 'compute_from'.
    """
    per_n = all(isinstance(k, int) for k in compute)
    rows = []
    for n in world_sizes:
        if per_n and n not in compute:
            raise KeyError(f"no measured compute for world size {n}: measure it, or pass one dict")
        c = compute[n] if per_n else compute
        source = f"compute measured at world size {n}" if per_n else "one compute for all sizes"
        if n == 1:
            step = c["forward"] + c["backward"] + c["optimizer"]
            rows.append(
                {
                    "world_size": 1,
                    "step": step,
                    "comm": 0.0,
                    "exposed_comm": 0.0,
                    "compute_from": source,
                }
            )
            continue
        if n not in fits:
            raise KeyError(
                f"no α-β fit for world size {n}: benchmark all_reduce at that size first"
            )
        fit = fits[n]
        pred = predict_step(
            c["forward"], c["backward"], c["optimizer"], bucket_bytes, fit.alpha, fit.beta
        )
        rows.append({"world_size": n, **pred, "compute_from": source})
    return rows
