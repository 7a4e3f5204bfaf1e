"""Pipeline parallelism: schedules, a send/recv engine, timelines and the bubble. Lecture 04.

A model is cut into p stages, one per rank, and a batch into m micro-batches. A *schedule* is,
for each stage, the order of its operations: ``("F", i)`` the forward of micro-batch i,
``("B", i)`` its backward.

    gpipe(p, m, s)          all forwards, then all backwards (GPipe): stage s keeps the
                            activations of all m micro-batches at once.
    one_f_one_b(p, m, s)    p−s−1 warm-up forwards, then one forward / one backward in turn,
                            then the remaining backwards (1F1B, "PipeDream-Flush"): at most
                            p−s micro-batches in flight on stage s.

Both leave the same bubble. With every stage taking the same time, the share of the p devices'
time spent idle over one step is (p−1)/(m+p−1) — normalised by the makespan, as measured here
(``bubble``). Papers also quote (p−1)/m: the same idle time over the ideal, bubble-free time.

``simulate`` lays a schedule out in time from the dependencies alone (what the grid stepper of
lecture 04 draws); ``run`` executes it on real ranks with send/recv and records what each rank
did and when, so the same picture can be drawn from a live run and compared.
"""

from __future__ import annotations

import time

F, B = "F", "B"


# -- schedules --------------------------------------------------------------------------------


def gpipe(p: int, m: int, stage: int) -> list[tuple[str, int]]:
    """GPipe on ``stage`` of ``p``: forwards 0..m−1, then backwards 0..m−1."""
    _check(p, m, stage)
    return [(F, i) for i in range(m)] + [(B, i) for i in range(m)]


def one_f_one_b(p: int, m: int, stage: int) -> list[tuple[str, int]]:
    """1F1B on ``stage`` of ``p``: warm-up forwards, one forward / one backward, cool-down."""
    _check(p, m, stage)
    warm = min(p - stage - 1, m)
    ops = [(F, i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        ops += [(F, f), (B, b)]
        f, b = f + 1, b + 1
    ops += [(B, i) for i in range(b, m)]
    return ops


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def _check(p: int, m: int, stage: int) -> None:
    if p < 1 or m < 1:
        raise ValueError(f"a pipeline needs p ≥ 1 stages and m ≥ 1 micro-batches, not p={p}, m={m}")
    if not 0 <= stage < p:
        raise ValueError(f"stage must be in 0..{p - 1}, not {stage}")


def orders(kind: str, p: int, m: int) -> list[list[tuple[str, int]]]:
    """The schedule ``kind`` ("gpipe" or "1f1b") for every stage."""
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, not {kind!r}")
    return [SCHEDULES[kind](p, m, s) for s in range(p)]


def in_flight(order: list[tuple[str, int]]) -> int:
    """The most micro-batches whose activations a stage holds at once under ``order``."""
    held = peak = 0
    for kind, _ in order:
        held += 1 if kind == F else -1
        peak = max(peak, held)
    return peak


# -- theory -----------------------------------------------------------------------------------


def bubble_fraction(p: int, m: int) -> float:
    """Idle share of p devices over one step, equal stage times: (p−1)/(m+p−1)."""
    return (p - 1) / (m + p - 1)


def simulate(
    stage_orders: list[list[tuple[str, int]]],
    forward: float = 1.0,
    backward: float = 2.0,
    comm: float = 0.0,
) -> list[dict]:
    """Lay the schedule out in time: each op starts when its stage is free and its input has
    arrived (``comm`` after the op it depends on). Raises ValueError if the orders deadlock or
    are not a valid schedule (a backward before its forward, a micro-batch missing...)."""
    p = len(stage_orders)
    for s, order in enumerate(stage_orders):
        _valid(order, s)
    ends: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    nxt = [0] * p
    events = []
    while any(nxt[s] < len(stage_orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if nxt[s] >= len(stage_orders[s]):
                continue
            kind, i = stage_orders[s][nxt[s]]
            dep = (F, s - 1, i) if kind == F and s > 0 else None
            if kind == B:
                dep = (B, s + 1, i) if s < p - 1 else (F, s, i)
            if dep is not None and dep not in ends:
                continue
            ready = 0.0 if dep is None else ends[dep] + (comm if dep[1] != s else 0.0)
            start = max(free[s], ready)
            end = start + (forward if kind == F else backward)
            ends[(kind, s, i)] = free[s] = end
            events.append({"rank": s, "op": kind, "micro": i, "start": start, "end": end})
            nxt[s] += 1
            progressed = True
        if not progressed:
            stuck = {s: stage_orders[s][nxt[s]] for s in range(p) if nxt[s] < len(stage_orders[s])}
            raise ValueError(f"the schedule deadlocks: each stage waits on another ({stuck})")
    return events


def _valid(order: list[tuple[str, int]], stage: int) -> None:
    forwards = [i for k, i in order if k == F]
    backwards = [i for k, i in order if k == B]
    if sorted(forwards) != list(range(len(forwards))) or sorted(backwards) != sorted(forwards):
        raise ValueError(
            f"stage {stage}: every micro-batch needs exactly one forward and one backward "
            f"(forwards {forwards}, backwards {backwards})"
        )
    seen = set()
    for kind, i in order:
        if kind == B and i not in seen:
            raise ValueError(
                f"stage {stage}: the backward of micro-batch {i} comes before its forward"
            )
        seen.add(i)


# -- measuring --------------------------------------------------------------------------------


def bubble(events: list[dict]) -> float:
    """Measured idle share: 1 − (busy time of all ranks) / (ranks × makespan).

    ``events`` are compute intervals (``start``, ``end``, ``rank``), from ``simulate`` or from
    ``run`` on every rank (perf_counter is one clock for all processes of one machine)."""
    if not events:
        raise ValueError("no events: run the schedule first")
    ranks = {e["rank"] for e in events}
    span = max(e["end"] for e in events) - min(e["start"] for e in events)
    busy = sum(e["end"] - e["start"] for e in events)
    return 1.0 - busy / (len(ranks) * span)


def run(
    stage,
    order: list[tuple[str, int]],
    inputs=None,
    targets=None,
    loss_fn=None,
    shape=None,
    dtype=None,
) -> dict:
    """Execute this rank's ``order`` of one training step, activations and their gradients
    crossing with send/recv, and record what it did.

    Rank 0 takes ``inputs`` (a list of m micro-batches); the last rank takes ``targets`` and
    ``loss_fn`` (a mean over the micro-batch; each micro-batch's loss is divided by m, so the
    gradients add up to those of the whole batch). Ranks after 0 receive activations of
    ``shape`` (a micro-batch's input to this stage). Sends are ``isend``: a stage never waits
    for its neighbour to take a tensor, which 1F1B needs (both sides may send at once).
    Returns {"loss": mean loss (last rank, else None), "events": [...], "sent_bytes": int}."""
    import torch
    import torch.distributed as dist

    rank, p = dist.get_rank(), dist.get_world_size()
    dtype = dtype or torch.float32
    first, last = rank == 0, rank == p - 1
    m = sum(1 for k, _ in order if k == F)
    held_in, held_out, sending, pending, events = {}, {}, {}, [], []
    loss_sum, sent = 0.0, 0
    for kind, i in order:
        if kind == F:
            if first:
                x = inputs[i]
            else:
                x = torch.empty(shape, dtype=dtype)
                dist.recv(x, src=rank - 1)
                x.requires_grad_(True)
            start = time.perf_counter()
            out = stage(x)
            if last:
                out = loss_fn(out, targets[i]) / m
                loss_sum += out.item()
            events.append(_event(rank, F, i, start))
            held_in[i], held_out[i] = x, out
            if not last:
                sending[i] = dist.isend(out.detach().contiguous(), dst=rank + 1)
                sent += out.numel() * out.element_size()
        else:
            x, out = held_in.pop(i), held_out.pop(i)
            if i in sending:  # arrived long ago (its gradient is back): free the buffer now
                sending.pop(i).wait()
            grad = None
            if not last:
                grad = torch.empty_like(out)
                dist.recv(grad, src=rank + 1)
            start = time.perf_counter()
            out.backward(grad)
            events.append(_event(rank, B, i, start))
            if not first:
                pending.append(dist.isend(x.grad.contiguous(), dst=rank - 1))
                sent += x.grad.numel() * x.grad.element_size()
    for work in pending + list(sending.values()):
        work.wait()
    return {"loss": loss_sum if last else None, "events": events, "sent_bytes": sent}


def _event(rank: int, op: str, micro: int, start: float) -> dict:
    return {"rank": rank, "op": op, "micro": micro, "start": start, "end": time.perf_counter()}


def gather_events(per_rank: list[dict]) -> list[dict]:
    """All ranks' events (``run``'s results, as ``launch`` returns them) on one time axis from 0."""
    events = [e for r in per_rank for e in r["events"]]
    t0 = min(e["start"] for e in events)
    return [{**e, "start": e["start"] - t0, "end": e["end"] - t0} for e in events]


# -- a stage of known cost (the bubble test) -------------------------------------------------


def timed_stage(forward_s: float, backward_s: float, width: int = 8):
    """A stage that takes ``forward_s`` seconds forward and ``backward_s`` backward (sleeping,
    so it costs no core): measured bubbles can be checked against theory on any machine."""
    import torch

    class _Timed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            time.sleep(forward_s)
            return x * 1.0

        @staticmethod
        def backward(ctx, grad):
            time.sleep(backward_s)
            return grad

    class TimedStage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(width))

        def forward(self, x):
            return _Timed.apply(x * self.scale)  # in the graph even when x needs no gradient

    return TimedStage()


def split(model, p: int) -> list:
    """Cut an ``nn.Sequential`` into ``p`` consecutive stages of (nearly) equal length."""
    import torch

    layers = list(model)
    if not 1 <= p <= len(layers):
        raise ValueError(f"cannot cut {len(layers)} layers into {p} stages")
    bounds = [round(k * len(layers) / p) for k in range(p + 1)]
    return [torch.nn.Sequential(*layers[bounds[k] : bounds[k + 1]]) for k in range(p)]
