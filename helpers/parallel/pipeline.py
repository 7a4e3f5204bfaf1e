"""Pipeline parallelism: schedules, a send/recv engine, timelines and the bubble. Lectures 04, 08.

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

Lecture 08 adds two schedules that shrink it (``simulate`` lays them out, ``run`` refuses them):

    interleaved(p, m, s, v) device s holds v model chunks, chunk c being virtual stage c·p + s;
                            ops are (kind, micro-batch, chunk). Fill and drain shrink v-fold:
                            idle share (p−1)/(v·m+p−1) (Narayanan et al. 2021, §2.2.2).
    zb_h1(p, m, s)          the backward split into B (input gradient, which the previous stage
                            waits for) and W (weight gradient, which nobody waits for); 1F1B's
                            order with each W put off by s micro-batches, to fill the drain.
                            Idle time (p−1)(F+B−W) per device against 1F1B's (p−1)(F+B+W)
                            (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §2.1).

``simulate`` lays a schedule out in time from the dependencies alone (what the grid stepper of
lecture 04 draws); ``run`` executes it on real ranks with send/recv and records what each rank
did and when, so the same picture can be drawn from a live run and compared.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

F, B, W = "F", "B", "W"


# -- schedules --------------------------------------------------------------------------------


def gpipe(p: int, m: int, stage: int) -> list[tuple[str, int]]:
    """GPipe on ``stage`` of ``p``: forwards 0..m−1, then backwards 0..m−1."""
    _check(p, m, stage)
    return [(F, i) for i in range(m)] + [(B, i) for i in range(m)]


def one_f_one_b(p: int, m: int, stage: int) -> list[tuple[str, int]]:
    """1F1B on ``stage`` of ``p``: warm-up forwards, one forward / one backward, cool-down."""
    _check(p, m, stage)
    return _warm_then_alternate(
        [(F, i) for i in range(m)], [(B, i) for i in range(m)], p - stage - 1
    )


def _warm_then_alternate(forwards: list, backwards: list, warm: int) -> list:
    """``warm`` forwards, then one forward / one backward in turn, then the remaining backwards."""
    warm = min(warm, len(forwards))
    ops = forwards[:warm]
    for f, b in zip(forwards[warm:], backwards, strict=False):
        ops += [f, b]
    return ops + backwards[len(forwards) - warm :]


def interleaved(p: int, m: int, stage: int, v: int) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B on device ``stage`` of ``p``, which holds ``v`` model chunks (lecture 08).

    Ops are (kind, micro-batch, chunk); chunk c is virtual stage c·p + stage. Micro-batches go
    through the chunks in groups of p (so m must be a multiple of p, as Megatron-LM requires):
    forwards in chunk order, backwards in reverse. Warm-up: (v−1)·p + p−stage−1 forwards.
    Megatron-LM's code doubles the p−stage−1 so that its paired send/recv calls overlap; with
    dependencies alone (``simulate``) both give the same bubble, and this one makes v = 1 1F1B."""
    _check(p, m, stage)
    if v < 1:
        raise ValueError(f"a device needs v ≥ 1 model chunks, not v={v}")
    if m % p:
        raise ValueError(
            f"the interleaved schedule runs micro-batches in groups of p: m must be a multiple "
            f"of p={p}, not m={m}"
        )

    def op(kind: str, k: int) -> tuple[str, int, int]:  # this device's k-th forward (backward)
        group, c = divmod(k // p, v)
        return (kind, group * p + k % p, c if kind == F else v - 1 - c)

    forwards = [op(F, k) for k in range(m * v)]
    backwards = [op(B, k) for k in range(m * v)]
    return _warm_then_alternate(forwards, backwards, (v - 1) * p + p - stage - 1)


def zb_h1(p: int, m: int, stage: int) -> list[tuple[str, int]]:
    """ZB-H1 on ``stage`` of ``p`` (lecture 08): 1F1B with the backward split into B and W, the
    W of micro-batch i done after the B of micro-batch i+stage (the rest at the end). Deeper
    stages warm up with fewer forwards, so they can hold W back longer: every stage then keeps
    p micro-batches until their W, what 1F1B's stage 0 keeps until its backward."""
    ops = []
    for kind, i in one_f_one_b(p, m, stage):
        ops.append((kind, i))
        if kind == B and i >= stage:
            ops.append((W, i - stage))
    return ops + [(W, i) for i in range(max(m - stage, 0), m)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb-h1": zb_h1}


def _check(p: int, m: int, stage: int) -> None:
    if p < 1 or m < 1:
        raise ValueError(f"a pipeline needs p ≥ 1 stages and m ≥ 1 micro-batches, not p={p}, m={m}")
    if not 0 <= stage < p:
        raise ValueError(f"stage must be in 0..{p - 1}, not {stage}")


def orders(kind: str, p: int, m: int, v: int | None = None) -> list[list[tuple]]:
    """The schedule ``kind`` ("gpipe", "1f1b", "interleaved" with ``v`` chunks, "zb-h1") for
    every stage (device)."""
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, not {kind!r}")
    if (v is None) == (kind == "interleaved"):
        raise ValueError("v (model chunks per device) is given for the interleaved schedule only")
    extra = {} if v is None else {"v": v}
    return [SCHEDULES[kind](p, m, s, **extra) for s in range(p)]


def in_flight(order: list[tuple], until: str = B) -> int:
    """The most micro-batches whose activations a stage holds at once under ``order``: from F
    until B frees them, or with ``until="W"`` until W (which still reads the layer inputs) in
    orders that split the backward. Interleaved orders count (micro-batch, chunk) pairs."""
    if until not in (B, W):
        raise ValueError(f"until must be {B!r} or {W!r}, not {until!r}")
    frees = W if until == W and any(op[0] == W for op in order) else B
    held = peak = 0
    for op in order:
        held += (op[0] == F) - (op[0] == frees)
        peak = max(peak, held)
    return peak


# -- theory -----------------------------------------------------------------------------------


def bubble_fraction(p: int, m: int) -> float:
    """Idle share of p devices over one step, equal stage times: (p−1)/(m+p−1)."""
    return (p - 1) / (m + p - 1)


def bubble_fraction_interleaved(p: int, m: int, v: int) -> float:
    """Idle share with v chunks per device (interleaved 1F1B), equal stage times: (p−1)/(v·m+p−1).

    A chunk takes 1/v of a stage, so the fill and the drain take (p−1)(F+B)/v against m(F+B) of
    work; Narayanan et al. (2021, §2.2.2) quote (p−1)/(v·m), the same idle time over the work."""
    interleaved(p, m, 0, v)  # the same refusals as the schedule (m a multiple of p, v ≥ 1)
    return (p - 1) / (v * m + p - 1)


def bubble_fraction_zb_h1(
    p: int, m: int, forward: float = 1.0, backward: float = 1.0, weight: float = 1.0
) -> float:
    """Idle share of ZB-H1 with F, B, W taking ``forward``, ``backward``, ``weight``: each device
    idles (p−1)(F+B−W) against m(F+B+W) of work (Qi et al. 2024, §2.1); 1F1B idles (p−1)(F+B+W),
    three times as long when F = B = W. Exact for m ≥ p and W ≤ min(F, B); past those the W
    put off no longer fits the gaps it fills, and the bubble is larger (``simulate`` it)."""
    _check(p, m, 0)
    if p > 1 and (m < p or weight > min(forward, backward)):
        raise ValueError(
            f"ZB-H1's closed form needs m ≥ p and W ≤ min(F, B), not p={p}, m={m}, "
            f"F={forward}, B={backward}, W={weight}: simulate the schedule instead"
        )
    idle = (p - 1) * (forward + backward - weight)
    return idle / (m * (forward + backward + weight) + idle)


def simulate(
    stage_orders: list[list[tuple]],
    forward: float = 1.0,
    backward: float = 2.0,
    comm: float = 0.0,
    weight: float | None = None,
) -> list[dict]:
    """Lay the schedule out in time: each op starts when its stage is free and its input has
    arrived (``comm`` after the op it depends on). Raises ValueError if the orders deadlock or
    are not a valid schedule (a backward before its forward, a micro-batch missing...).

    Lecture 08: in interleaved orders, (kind, micro-batch, chunk), chunk c of device d is virtual
    stage c·p + d and an op takes 1/v of ``forward`` or ``backward`` (``forward`` stays the time
    of a device's whole share of the model); their events also carry "chunk". In orders with W
    ops, ``backward`` is B alone and W takes ``weight``; W waits only for the same stage's B."""
    p = len(stage_orders)
    v = 1 + max((op[2] for order in stage_orders for op in order if len(op) == 3), default=0)
    for s, order in enumerate(stage_orders):
        _valid(order, s, v)
    if weight is None and any(op[0] == W for order in stage_orders for op in order):
        raise ValueError("the orders split the backward into B and W: give W's time, weight=")
    took = {F: forward / v, B: backward / v, W: (weight or 0.0) / v}
    ends: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> end
    free = [0.0] * p
    nxt = [0] * p
    events = []
    while any(nxt[s] < len(stage_orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if nxt[s] >= len(stage_orders[s]):
                continue
            op = stage_orders[s][nxt[s]]
            kind, i, c = _parts(op)
            q = c * p + s
            dep = (F, q - 1, i) if kind == F and q > 0 else None
            if kind == B:
                dep = (B, q + 1, i) if q < v * p - 1 else (F, q, i)
            if kind == W:
                dep = (B, q, i)
            if dep is not None and dep not in ends:
                continue
            ready = 0.0 if dep is None else ends[dep] + (comm if dep[1] % p != s else 0.0)
            start = max(free[s], ready)
            end = start + took[kind]
            ends[(kind, q, i)] = free[s] = end
            event = {"rank": s, "op": kind, "micro": i, "start": start, "end": end}
            events.append(event if len(op) == 2 else {**event, "chunk": c})
            nxt[s] += 1
            progressed = True
        if not progressed:
            stuck = {s: stage_orders[s][nxt[s]] for s in range(p) if nxt[s] < len(stage_orders[s])}
            raise ValueError(f"the schedule deadlocks: each stage waits on another ({stuck})")
    return events


def _parts(op: tuple) -> tuple[str, int, int]:
    """(kind, micro-batch, chunk) of an op; plain (kind, micro-batch) ops are chunk 0."""
    return op if len(op) == 3 else (*op, 0)


def _valid(order: list[tuple], stage: int, v: int = 1) -> None:
    ops = [_parts(op) for op in order]
    if unknown := {k for k, _, _ in ops} - {F, B, W}:
        raise ValueError(f"stage {stage}: ops are F, B or W, not {sorted(unknown)}")
    if ops and {c for _, _, c in ops} != set(range(v)):
        raise ValueError(f"stage {stage}: every device needs all {v} chunks (0..{v - 1})")
    for c in range(v):
        where = f"stage {stage}" + (f", chunk {c}" if v > 1 else "")
        forwards, backwards, weights = ([i for k, i, cc in ops if (k, cc) == (x, c)] for x in "FBW")
        if sorted(forwards) != list(range(len(forwards))) or sorted(backwards) != sorted(forwards):
            raise ValueError(
                f"{where}: every micro-batch needs exactly one forward and one backward "
                f"(forwards {forwards}, backwards {backwards})"
            )
        if weights and sorted(weights) != sorted(forwards):
            raise ValueError(f"{where}: a split backward needs exactly one W per micro-batch")
    seen, done = set(), set()
    for kind, i, c in ops:
        if kind == B and (i, c) not in seen:
            raise ValueError(
                f"stage {stage}: the backward of micro-batch {i} comes before its forward"
            )
        if kind == W and (i, c) not in done:
            raise ValueError(f"stage {stage}: the W of micro-batch {i} comes before its B")
        (seen if kind == F else done).add((i, c))


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
    Returns {"loss": mean loss (last rank, else None), "events": [...], "sent_bytes": int}.

    One stage per rank, F and B only (GPipe, 1F1B): interleaved and ZB-H1 orders are refused
    with a ValueError; ``simulate`` lays those out."""
    if any(len(op) != 2 or op[0] not in (F, B) for op in order):
        raise ValueError(
            "run executes (F, i) and (B, i) orders, one stage per rank (GPipe, 1F1B); "
            "interleaved and ZB-H1 orders are for simulate"
        )

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
    layers = list(model)
    if not 1 <= p <= len(layers):
        raise ValueError(f"cannot cut {len(layers)} layers into {p} stages")
    bounds = [round(k * len(layers) / p) for k in range(p + 1)]
    return [torch.nn.Sequential(*layers[bounds[k] : bounds[k + 1]]) for k in range(p)]
