"""Lab 04's checks: what one process computes for the step a pipeline splits, what the dense MLP
computes for the tensor-parallel one, and the hidden cases of each test, drawn from the run's
seed (``COURSE_HIDDEN_SEED``).

The lab's harnesses build their models and data here too (``engine_model``, ``tp_case``), in
the ranks, so the check's one-process reference is made from the very weights and samples the
student's code was given, by code the student's kernel cannot rebind.
"""

from __future__ import annotations

import random

import torch
from torch import nn

from helpers.parallel import tensor_parallel

KINDS = ("gpipe", "1f1b")


# -- the pipeline engine (test_pipeline_step) ---------------------------------------------------


def engine_model(depth: int, width: int, seed: int) -> nn.Sequential:
    """``depth`` blocks Linear(width, width) + Tanh, seeded."""
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())])


def engine_batch(n: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples and their targets, (n, width) each, from a generator seeded ``seed + 1``."""
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


def one_process_step(n: int, width: int, depth: int, seed: int) -> tuple[float, list]:
    """The step a pipeline must reproduce: the whole batch in one process, the mean squared
    error; (loss, every parameter's gradient in the model's order)."""
    model = engine_model(depth, width, seed)
    x, y = engine_batch(n, width, seed)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.item(), [q.grad for q in model.parameters()]


def engine_cases(seed: int) -> list[tuple]:
    """Three runs of the engine, (kind, p, m, n, width, depth, seed), one from each side of the
    boundaries an engine can get wrong: a single stage (first and last at once); 1F1B with fewer
    micro-batches than stages (m = 1 included); as many micro-batches as stages or more, on 2 to
    4 ranks. Micro-batches of 1 to 3 samples, widths 1 to 8, and depth p to p + 3 layer pairs (so
    a stage may start with a Tanh and the stages differ in length). n is a multiple of m: the
    loss is divided by m, which is one process's mean only over equal micro-batches."""
    rng = random.Random(seed)

    def case(kind: str, p: int, m: int) -> tuple:
        size, width, depth = rng.randint(1, 3), rng.randint(1, 8), rng.randint(p, p + 3)
        return (kind, p, m, m * size, width, depth, rng.randint(1, 2**31 - 2))

    single = case(rng.choice(KINDS), 1, rng.randint(1, 6))
    p = rng.randint(3, 4)
    fewer = case("1f1b", p, rng.randint(1, p - 1))
    p = rng.randint(2, 4)
    more = case(rng.choice(KINDS), p, rng.randint(p, 8))
    return [single, fewer, more]


# -- the tensor-parallel MLP (test_tensor_parallel) ---------------------------------------------


def tp_case(d: int, h: int, n_samples: int, seed: int) -> tuple[nn.Sequential, torch.Tensor]:
    """The dense ``Linear(d, h), ReLU, Linear(h, d)`` (seeded) and its input (seed + 1)."""
    dense = tensor_parallel.mlp(d, h, seed)
    x = torch.randn(n_samples, d, generator=torch.Generator().manual_seed(seed + 1))
    return dense, x.requires_grad_()


def tp_loss(out: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient differs at every output element (a sum would give all ones)."""
    return (out * torch.arange(out.numel()).view_as(out).sin()).sum()


def dense_step(d: int, h: int, n_samples: int, seed: int):
    """The dense MLP's forward and backward on the case: (dense with its gradients, x with its
    gradient, the output)."""
    dense, x = tp_case(d, h, n_samples, seed)
    out = dense(x)
    tp_loss(out).backward()
    return dense, x, out.detach()


def tp_cases(seed: int) -> list[tuple]:
    """Two runs of the tensor-parallel MLP, (n, d, h, n_samples, seed): on 3 ranks and on 4
    (the visible case runs on 2), 1 to 3 hidden features per rank, 1 to 8 model features and
    samples."""
    rng = random.Random(seed)
    return [
        (n, rng.randint(1, 8), n * rng.randint(1, 3), rng.randint(1, 8), rng.randint(1, 2**31 - 2))
        for n in (3, 4)
    ]


# -- formulas and measured events (test_schedules, test_bubble_fraction, test_measured_bubble) --


def schedule_shapes(seed: int) -> list[tuple[int, int]]:
    """(p, m) for both schedules: fixed boundaries (one stage, one micro-batch, fewer micro-
    batches than stages, as many) and eight drawn, 1 to 6 stages, half of them with m ≤ p."""
    rng = random.Random(seed)
    drawn = []
    for _ in range(8):
        p = rng.randint(1, 6)
        drawn.append((p, rng.randint(1, p) if rng.random() < 0.5 else rng.randint(p, 3 * p + 2)))
    return [(4, 8), (3, 2), (4, 2), (1, 3), (3, 1), (5, 7), (1, 1), (3, 3)] + drawn


def bubble_shapes(seed: int) -> list[tuple[int, int]]:
    """(p, m) for the bubble formula: fixed boundaries and eight drawn, 1 to 8 stages, 1 to 64
    micro-batches."""
    rng = random.Random(seed)
    drawn = [(rng.randint(1, 8), rng.randint(1, 64)) for _ in range(8)]
    return [(1, 5), (3, 1), (8, 32), (5, 2)] + drawn


def bubble_steps(seed: int) -> list[list[dict]]:
    """Ten steps' events: 1 to 4 ranks, 1 to 6 micro-batches, random durations and gaps, each
    rank starting when it does, the events listed in a shuffled order."""
    rng = random.Random(seed)
    steps = []
    for _ in range(10):
        events = []
        for r in range(rng.randint(1, 4)):
            t = rng.uniform(0.0, 5.0)
            for i in range(rng.randint(1, 6)):
                for op in "FB":
                    start = t + rng.uniform(0.0, 1.0)
                    t = start + rng.uniform(0.1, 2.0)
                    events.append({"rank": r, "op": op, "micro": i, "start": start, "end": t})
        rng.shuffle(events)
        steps.append(events)
    return steps


# -- the checks' assertions, one case each ---------------------------------------------------------


def assert_schedule(orders, kind: str, p: int, m: int) -> None:
    """test_schedules' check of one shape: ``orders`` (every stage's list of [op, micro-batch]
    from the student's schedule) runs each micro-batch's forward and backward in order, runs to
    the end without deadlock (``pipeline.simulate``), has the bubble of theory and holds the
    micro-batches the schedule holds (GPipe m everywhere, 1F1B p − stage); GPipe forwards first."""
    from helpers.parallel import pipeline as pp

    name = f"{kind} p={p} m={m}"
    assert isinstance(orders, list) and len(orders) == p, f"{name}: {p} stages expected"
    orders = [[(str(k), int(i)) for k, i in stage] for stage in orders]
    for s, order in enumerate(orders):
        for op in ("F", "B"):
            assert [i for k, i in order if k == op] == list(range(m)), (
                f"{name}, stage {s}: the {'forwards' if op == 'F' else 'backwards'} should be "
                f"micro-batches 0..{m - 1} in order, not {order}"
            )
    try:
        events = pp.simulate(orders, 1.0, 2.0)
    except ValueError as exc:
        raise AssertionError(f"{name}: {exc}") from None
    want = pp.bubble_fraction(p, m)
    assert abs(pp.bubble(events) - want) < 1e-9, (
        f"{name}: the bubble is {pp.bubble(events):.3f}, not (p−1)/(m+p−1) = {want:.3f}"
    )
    held = [pp.in_flight(o) for o in orders]
    want_held = [m] * p if kind == "gpipe" else [min(p - s, m) for s in range(p)]
    assert held == want_held, (
        f"{name}: the stages hold {held} micro-batches at most; the schedule holds {want_held}"
    )
    if kind == "gpipe":
        first = [("F", i) for i in range(m)]
        assert all(o[:m] == first for o in orders), f"{name}: GPipe runs every forward first"


def _assert_engine_followed(r: dict, where: str, want_ops: list) -> None:
    """One rank's run: its events in the schedule's order, its stage computed in that order, no
    more forward sends open at once than micro-batches in flight."""
    assert r["ops"] == want_ops and r["ordered"], (
        f"{where}: the events record {r['ops']}, not the order {want_ops}"
    )
    assert r["done"] == [op for op, _ in want_ops], (
        f"{where}: the stage computed {''.join(r['done'])}, not the schedule's order"
    )
    depth = [sum(1 if o == "F" else -1 for o, _ in want_ops[: k + 1]) for k in range(len(want_ops))]
    in_flight = max(depth)
    assert r["open sends"] <= in_flight, (
        f"{where}: {r['open sends']} forward sends were open at once, more than the "
        f"{in_flight} micro-batches in flight: wait() for a micro-batch's send before its backward"
    )


def _assert_compute_only(per_rank: list, where: str) -> None:
    """An event times compute only: a forward starts after the stage before finished it, a
    backward after the stage after finished its own (time spent waiting in recv is not compute)."""
    ends = {(s, op, i): end for s, r in enumerate(per_rank) for op, i, _, end in r["times"]}
    for s, r in enumerate(per_rank):
        for op, i, start, _ in r["times"]:
            before = (s - 1, "F", i) if op == "F" else (s + 1, "B", i)
            assert before not in ends or start >= ends[before], (
                f"{where}, rank {s}: {op}{i} starts before rank {before[0]} finished "
                f"{before[1]}{i}: time only the compute, not the wait in recv"
            )


def assert_like_one_process(per_rank, kind, p, m, n=12, width=6, depth=4, seed=0) -> None:
    """test_pipeline_step's check of one case: these ranks' step (``per_rank``, what the lab's
    ``engine_runs`` returned) against the same step in one process on the whole batch
    (``one_process_step``, computed here): the loss on the last rank only, every gradient, the
    schedule followed, no course engine called, compute timed apart from waiting."""
    from helpers.parallel import pipeline as pp

    where = f"{kind}, p={p}, m={m}"
    want_loss, want = one_process_step(n, width, depth, seed)
    assert isinstance(per_rank, list) and len(per_rank) == p, f"{kind}, p={p}: {p} ranks expected"
    for s, r in enumerate(per_rank):
        assert r.get("finished") == [], (
            f"{where}, rank {s}: write pipeline_step yourself: it calls the course's "
            f"{r.get('finished')}"
        )
    assert all(r["loss"] is None for r in per_rank[:-1]), (
        f"{kind}, p={p}: only the last rank has a loss"
    )
    got_loss = per_rank[-1]["loss"]
    assert got_loss is not None and abs(got_loss - want_loss) < 1e-5, (
        f"{where}: the loss is {got_loss}; one process computes {want_loss:.6f}"
    )
    got = [g for r in per_rank for g in r["grads"]]
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a is not None, f"{where}: parameter {k} got no gradient (was one not sent back?)"
        worst = (a - b).abs().max().item()
        assert worst < 1e-5, (
            f"{where}: parameter {k}'s gradient differs from one process's by {worst:.3g}"
        )
    for s, r in enumerate(per_rank):
        want_ops = [list(op) for op in pp.SCHEDULES[kind](p, m, s)]
        _assert_engine_followed(r, f"{where}, rank {s}", want_ops)
    _assert_compute_only(per_rank, where)


def assert_like_dense(per_rank, n, d, h, n_samples, seed=0) -> None:
    """test_tensor_parallel's check of one case: every rank's output and gradients (``per_rank``,
    what the lab's ``tp_runs`` returned) against the dense MLP's (``dense_step``, computed here),
    one all-reduce of the output forward and one of the input's gradient backward, no course f,
    g or layer called."""
    dense, x, out = dense_step(d, h, n_samples, seed)
    assert isinstance(per_rank, list) and len(per_rank) == n, f"{n} ranks expected"
    one = n_samples * d * 4
    for rank, r in enumerate(per_rank):
        part = slice(rank * h // n, (rank + 1) * h // n)
        where = f"{n} ranks, d={d}, h={h}, rank {rank}"
        assert r.get("finished") == [], (
            f"{where}: write f, g and tp_mlp yourself: they call the course's {r.get('finished')}"
        )
        wanted = (("the output", r["out"], out), ("the input's gradient", r["x"], x.grad),
                  ("the first weight's gradient", r["w1"], dense[0].weight.grad[part]),
                  ("the first bias's gradient", r["b1"], dense[0].bias.grad[part]),
                  ("the second weight's gradient", r["w2"], dense[2].weight.grad[:, part]),
                  ("the second bias's gradient", r["b2"], dense[2].bias.grad))  # fmt: skip
        for name, got, want in wanted:
            assert got is not None and got.shape == want.shape, (
                f"{where}: {name} is missing or has the wrong shape"
            )
            worst = (got - want).abs().max().item()
            assert worst < 1e-5, f"{where}: {name} differs from the dense MLP's by {worst:.3g}"
        for way in ("forward", "backward"):
            assert r[way] == [["all_reduce", one]], (
                f"{where}: {way} ran {r[way]}; it should all-reduce "
                f"{'the output' if way == 'forward' else 'the input gradient'} once ({one} bytes)"
            )
