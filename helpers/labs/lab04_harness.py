"""Lab 04's harness: what its cells run around the student's code, kept out of the notebook.

Each runner takes the student's function as an argument (``pipeline_step``, ``tp_mlp``: a
notebook's functions travel to the ranks by value, with the classes they use) and runs it on
gloo ranks launched by ``helpers.launch``. Where the question is to write what the course has
finished, the runner calls the answer under ``finished_calls`` and reports what it called. What
a runner returns is data: the graded checks judge it against references of their own
(``helpers.labs.lab04``), never against anything computed here, in the student's kernel.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.labs import lab04
from helpers.labs.finished import finished_calls
from helpers.launcher.launch import launch
from helpers.measure import memory
from helpers.measure.comm import CommRecorder
from helpers.measure.memory import memory_limit
from helpers.measure.tracing import trace
from helpers.parallel import pipeline as pp
from helpers.parallel import tensor_parallel as tpl


def _launch(fn, *args, world_size: int, timeout: float | None = 60):
    """``fn`` on ``world_size`` gloo ranks, quietly: every rank's result (plain data)."""
    return launch(fn, *args, world_size=world_size, backend="gloo", output="none", timeout=timeout)


# -- part 2: the engine (test_pipeline_step) -------------------------------------------------------


class _Counted:
    """A forward send's handle, counted open until its first wait()."""

    def __init__(self, work, sends: dict):
        self.work, self.sends, self.open = work, sends, True

    def wait(self, *args, **kwargs):
        if self.open:
            self.open, self.sends["open"] = False, self.sends["open"] - 1
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


@contextlib.contextmanager
def _counted_forward_sends(rank: int):
    """``dist.isend`` to the next rank counted while open: yields {"open", "peak"}."""
    sends, real_isend = {"open": 0, "peak": 0}, dist.isend

    def isend(tensor, dst=None, *args, **kwargs):
        work = real_isend(tensor, dst, *args, **kwargs)
        if dst != rank + 1:
            return work
        sends["open"] += 1
        sends["peak"] = max(sends["peak"], sends["open"])
        return _Counted(work, sends)

    dist.isend = isend
    try:
        yield sends
    finally:
        dist.isend = real_isend


def engine_run(pipeline_step, kind, p, m, n=12, width=6, depth=4, seed=0) -> dict:
    """One step of the student's ``pipeline_step`` on this rank: a seeded MLP of ``depth`` layer
    pairs of ``width``, cut in ``p`` stages, ``n`` samples in ``m`` micro-batches. Besides its
    loss, gradients and events: what the stage really computed, in order (its forward; the end
    of its backward, when its first parameter's gradient is in), how many forward sends were
    open at once, and which of the course's engine functions it called. The events and the
    result alone cannot tell a schedule followed from one reported."""
    rank = dist.get_rank()
    stage = pp.split(lab04.engine_model(depth, width, seed), p)[rank]
    x, y = lab04.engine_batch(n, width, seed)
    xs, ys = list(x.chunk(m)), list(y.chunk(m))
    done = []
    stage.register_forward_hook(lambda *_: done.append("F"))
    next(stage.parameters()).register_post_accumulate_grad_hook(lambda _: done.append("B"))
    order = pp.SCHEDULES[kind](p, m, rank)
    inputs, targets = (xs if rank == 0 else None), (ys if rank == p - 1 else None)
    with _counted_forward_sends(rank) as sends:  # the course's engine: the question is to write it
        (loss, events), called = finished_calls(
            pipeline_step, [pp.run, pp._event, pp.gather_events],
            stage, order, inputs, targets, nn.functional.mse_loss, xs[0].shape,
        )  # fmt: skip
    grads = [q.grad.clone() if q.grad is not None else None for q in stage.parameters()]
    return {"loss": loss, "grads": grads, "ops": [[e["op"], e["micro"]] for e in events],
            "done": done, "open sends": sends["peak"],
            "times": [[e["op"], e["micro"], e["start"], e["end"]] for e in events],
            "ordered": all(e["start"] <= e["end"] for e in events), "finished": called}  # fmt: skip


def engine_runs(pipeline_step, kind, p, m, n=12, width=6, depth=4, seed=0) -> list[dict]:
    """``engine_run`` on ``p`` ranks (plain data, rank order)."""
    return _launch(engine_run, pipeline_step, kind, p, m, n, width, depth, seed, world_size=p)


# -- part 3: the bubble, measured ---------------------------------------------------------------------


def timed_steps(pipeline_step, kind, m, repeats, forward_s, backward_s) -> list[list[dict]]:
    """``repeats`` steps of the student's ``pipeline_step`` on timed stages (``pp.timed_stage``:
    a forward of ``forward_s``, a backward of ``backward_s``), after one warm-up; this rank's
    events of each step."""
    rank, p = dist.get_rank(), dist.get_world_size()
    stage = pp.timed_stage(forward_s, backward_s, width=4)
    xs = [torch.ones(1, 4) for _ in range(m)]
    ys = [torch.zeros(1, 4) for _ in range(m)]
    order = pp.SCHEDULES[kind](p, m, rank)
    out = []
    for step in range(repeats + 1):
        dist.barrier()
        _, events = pipeline_step(stage, order, xs, ys, nn.functional.mse_loss, (1, 4))
        if step:
            out.append(events)
    return out


def timed_runs(pipeline_step, kind, m, repeats, forward_s, backward_s, stages) -> list[list[dict]]:
    """``timed_steps`` on ``stages`` ranks: per repeat, every rank's events (grouped by rank)."""
    args = (pipeline_step, kind, m, repeats, forward_s, backward_s)
    per_rank = _launch(timed_steps, *args, world_size=stages, timeout=None)
    return [[e for r in per_rank for e in r[k]] for k in range(repeats)]


# -- part 4: activation memory ------------------------------------------------------------------------


def activation_peak(pipeline_step, kind, m, depth, width, batch) -> int:
    """This rank's peak of saved activations (bytes) over one step of the student's engine."""
    rank, p = dist.get_rank(), dist.get_world_size()
    stage = pp.split(lab04.engine_model(depth, width, 0), p)[rank]
    x, y = lab04.engine_batch(batch, width, 0)
    xs, ys = list(x.chunk(m)), list(y.chunk(m))
    with memory_limit("1TB", stage) as budget:
        order = pp.SCHEDULES[kind](p, m, rank)
        pipeline_step(stage, order, xs, ys, nn.functional.mse_loss, xs[0].shape)
    return budget.peak_activations


# -- part 5: the tensor-parallel MLP (test_tensor_parallel) ----------------------------------------

# the course's f, g and layers: the question is to write them
TP_FINISHED = [
    tpl._CopyToParallel.forward, tpl._CopyToParallel.backward, tpl._ReduceFromParallel.forward,
    tpl._ReduceFromParallel.backward, tpl.copy_to_parallel, tpl.reduce_from_parallel,
    tpl.ColumnParallelLinear.forward, tpl.RowParallelLinear.forward, tpl.ParallelMLP.forward,
]  # fmt: skip


def _calls(recorded) -> list[list]:
    return [[c["op"], c["bytes"]] for c in recorded.records]


def tp_run(tp_mlp, d, h, n_samples, seed=0) -> dict:
    """The student's ``tp_mlp`` on this rank's shards of a seeded dense MLP (``lab04.tp_case``):
    output, gradients, the collectives of forward and of backward, and which of the course's
    functions it called."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dense, x = lab04.tp_case(d, h, n_samples, seed)
    part = slice(rank * h // n, (rank + 1) * h // n)

    def mine(t):
        return t.detach().clone().requires_grad_()

    w1, b1 = mine(dense[0].weight[part]), mine(dense[0].bias[part])
    w2, b2 = mine(dense[2].weight[:, part]), mine(dense[2].bias)
    with trace() as forward:
        out, called = finished_calls(tp_mlp, TP_FINISHED, x, w1, b1, w2, b2)
    with trace() as backward:  # backward runs in this thread: the hook sees it
        _, called_back = finished_calls(lambda: lab04.tp_loss(out).backward(), TP_FINISHED)
    return {"out": out.detach(), "x": x.grad, "w1": w1.grad, "b1": b1.grad, "w2": w2.grad,
            "b2": b2.grad, "forward": _calls(forward), "backward": _calls(backward),
            "finished": sorted({*called, *called_back})}  # fmt: skip


def tp_runs(tp_mlp, n, d, h, n_samples, seed=0) -> list[dict]:
    """``tp_run`` on ``n`` ranks (plain data, rank order)."""
    return _launch(tp_run, tp_mlp, d, h, n_samples, seed, world_size=n)


# -- part 6: one model, three ways ------------------------------------------------------------------


def _dp_step(model, x, y, rank, n):
    """DDP on this rank's share of the batch; the step returns the bytes its hook counted."""
    net = DDP(model)
    recorder = CommRecorder().register(net)  # DDP all-reduces in C++: its hook counts
    mine = slice(rank * len(x) // n, (rank + 1) * len(x) // n)

    def step():
        recorder.start_step()
        nn.functional.mse_loss(net(x[mine]), y[mine]).backward()
        return recorder.per_step()[-1]["sent_bytes"]

    return step, net


def _pp_step(model, x, y, rank, n):
    """The course's engine, 1F1B over 8 micro-batches; the step returns the bytes it sent."""
    stage = pp.split(model, n)[rank]
    xs, ys, order = list(x.chunk(8)), list(y.chunk(8)), pp.SCHEDULES["1f1b"](n, 8, rank)

    def step():
        return pp.run(stage, order, xs, ys, nn.functional.mse_loss, xs[0].shape)["sent_bytes"]

    return step, stage


def _tp_step(model, x, y, rank, n):
    """The same function: each pair Linear, Tanh, Linear sharded, then the pair's Tanh."""
    blocks = []
    for k in range(len(model) // 4):
        pair = nn.Sequential(model[4 * k], nn.Tanh(), model[4 * k + 2])
        blocks += [tpl.shard(pair, rank, n), nn.Tanh()]
    net = nn.Sequential(*blocks)

    def step():
        nn.functional.mse_loss(net(x), y).backward()

    return step, net


WAYS = {"DP": _dp_step, "PP": _pp_step, "TP": _tp_step}


def _timed(step, held, repeats: int) -> tuple[list[float], int, list]:
    """``repeats`` timed steps after a barrier each: seconds, the bytes the last one counted and
    the collectives it made (traced)."""
    times = []
    for _ in range(repeats):
        for q in held.parameters():
            q.grad = None
        dist.barrier()
        start = time.perf_counter()
        with trace() as calls:
            counted = step() or 0  # DP: its hook's count; PP: the engine's (isend is not traced)
        times.append(time.perf_counter() - start)
    return times, counted, calls.records


def compare(way, depth, width, batch, repeats) -> dict:
    """One rank's step time (each repeat), memory by part, peak activations and bytes handed to
    communication, for the lab's MLP trained by ``way`` (DP, PP or TP) on every rank."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = lab04.engine_model(depth, width, 0)
    x, y = lab04.engine_batch(batch, width, 0)
    step, held = WAYS[way](model, x, y, rank, n)
    step()  # warm-up
    times, counted, records = _timed(step, held, repeats)
    for q in held.parameters():
        q.grad = None
    with memory_limit("1TB", held) as budget:
        step()
    traced = sum(c["bytes"] for c in records if c["op"] == "all_reduce") if way == "TP" else 0
    kept = memory.breakdown(held)  # after the step: the weights and their gradients
    return {"times": times, "kept": kept, "activations": budget.peak_activations,
            "sent": counted + traced}  # fmt: skip


def comparison_row(way: str, per_rank: list[dict]) -> tuple[dict, list[float]]:
    """A row of part 6's table from ``compare`` on every rank, and each repeat's step (seconds):
    a step ends with its slowest rank."""
    repeats = len(per_rank[0]["times"])
    steps = [max(r["times"][k] for r in per_rank) for k in range(repeats)]
    kept = max(r["kept"]["parameters"] + r["kept"]["gradients"] for r in per_rank)
    row = {"way": way, "step ms (median)": 1e3 * statistics.median(steps),
           "min": 1e3 * min(steps), "max": 1e3 * max(steps),
           "weights+grads MB / rank": kept / 1e6,
           "activations MB / rank": max(r["activations"] for r in per_rank) / 1e6,
           "MB sent / rank / step": max(r["sent"] for r in per_rank) / 1e6}  # fmt: skip
    return row, steps
