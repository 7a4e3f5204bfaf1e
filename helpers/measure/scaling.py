"""Scaling experiments that mean something on a shared machine: repeats, spread, whole batches.

    runs = scaling.interleave(configs, run_one, repeats=3)   # round-robin, not one config at a time
    t = scaling.step_seconds(per_rank, skip=5)               # one run: the slowest rank per step
    timing.spread([...])                                     # median, min, max of the repeats

Repeats are interleaved (config A, B, C, then A, B, C again) so that a slow minute of the
machine (another job, a thermal dip) lands on every configuration instead of biasing one.
Introduced in lab 01.
"""

from __future__ import annotations

import math
import statistics


def interleave(configs, run, repeats: int = 3) -> dict:
    """``{config: [run(config) for each repeat]}``, the repeats taken round-robin over configs."""
    configs = list(configs)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a whole number >= 1, not {repeats!r}")
    if len(set(configs)) != len(configs):
        raise ValueError(f"each configuration once, please: {configs!r} has duplicates")
    results: dict = {cfg: [] for cfg in configs}
    for _ in range(repeats):
        for cfg in configs:
            results[cfg].append(run(cfg))
    return results


def step_seconds(per_rank: list[list[dict]], skip: int = 0, key: str = "total") -> float:
    """One run's seconds per step: a step ends when its slowest rank ends it; median over steps.

    ``per_rank``: each rank's StepTimer records (what launch brings back), warm-up steps first.
    """
    steps = min(len(records) for records in per_rank)
    if steps <= skip:
        raise ValueError(f"{steps} steps recorded, all of them warm-up (skip={skip}): time more")
    return statistics.median(
        max(records[i][key] for records in per_rank) for i in range(skip, steps)
    )


def steps_per_epoch(n_samples: int, batch_size: int, world_size: int) -> int:
    """Optimizer steps in one epoch when each of ``world_size`` ranks takes ``batch_size``."""
    return math.ceil(n_samples / (batch_size * world_size))


def epoch_seconds(step_s: float, n_samples: int, batch_size: int, world_size: int) -> float:
    """Seconds for one epoch of ``n_samples`` at ``step_s`` per step of ``world_size × batch_size``.

    The last, partial step is counted as the fraction of a step it is: with 1,437 samples,
    2 × 512 per step is 1.4 steps, not 2 (a ceiling would charge the larger world for work it
    does not do and hide or invent a speedup in small datasets).
    """
    return step_s * n_samples / (batch_size * world_size)


def shard_batches(shard, batch_size: int, steps: int):
    """``steps`` batches of exactly ``batch_size`` of this rank's indices, cycling over the shard.

    Every batch is whole: a batch larger than the shard is an error, not a silently smaller
    batch (which would make a "batch 512" run train on 8 samples and time nothing real).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size!r}")
    if batch_size > len(shard):
        raise ValueError(
            f"a batch of {batch_size} does not fit in this rank's shard of {len(shard)} samples: "
            "use a smaller batch, fewer ranks, or a larger dataset "
            "(e.g. dataset='digits-shifted', 9× the digits)"
        )
    per_pass = len(shard) // batch_size
    for step in range(steps):
        i = step % per_pass
        yield shard[i * batch_size : (i + 1) * batch_size]
