"""Lab 05's runs of the student's code: the sweeps of parts 2–4 (through the student's ``plan``
and schedules) and the hand-set models test_lars steps with the student's ``LARS``.

What they return is data for the notebook's tables and the tests' probes; a check never trusts
it, it recomputes what it compares against (helpers.labs.lab05). Kept here so the lab's cells
hold the student's task.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from helpers.parallel import large_batch


def _row(method: str, batch: int, seed: int, micro: int, k: int, r: dict, seconds: float) -> dict:
    """One run's row: its last epoch, and whether it failed (no better than guessing, ln 10)."""
    last = r["epochs"][-1]
    return {"method": method, "global batch": batch, "seed": seed, "micro x k": f"{micro} x {k}",
            "steps": r["steps"], "train loss": last["train loss"],
            "train accuracy": last["train accuracy"], "test accuracy": last["test accuracy"],
            "seconds": seconds,
            "failed": r["diverged"] or not last["train loss"] < math.log(10),
            "curve": r["epochs"], "losses": r["losses"]}  # fmt: skip


def run_all(configs, setup: dict, plan, schedule) -> list[dict]:
    """Train every (method, global batch, seed) of ``configs`` on this world; a row per run.
    ``setup``: {"build", "train_set", "test_set", "epochs", "max_micro"}; each batch is split by
    the student's ``plan``, and ``schedule(method, batch)`` gives its (lr_at, make_optimizer)."""
    rows = []
    for method, batch, seed in configs:
        micro, k = plan(batch, dist.get_world_size(), setup["max_micro"])
        lr, optimizer = schedule(method, batch)
        start = time.perf_counter()
        r = large_batch.train(setup["build"], setup["train_set"], setup["test_set"], batch,
                              micro, k, setup["epochs"], lr, optimizer, seed)  # fmt: skip
        rows.append(_row(method, batch, seed, micro, k, r, time.perf_counter() - start))
    return rows


def table(rows):
    """Per method and global batch: steps, micro x k, median train accuracy, test accuracy's
    median, min and max over the seeds, and how many runs failed."""
    import pandas as pd

    return (pd.DataFrame(rows).groupby(["method", "global batch"], sort=False)
            .agg(steps=("steps", "first"), micro_x_k=("micro x k", "first"),
                 train_accuracy=("train accuracy", "median"),
                 accuracy_median=("test accuracy", "median"), accuracy_min=("test accuracy", "min"),
                 accuracy_max=("test accuracy", "max"), failed=("failed", "sum"))
            .reset_index())  # fmt: skip


# -- test_lars: the student's LARS on models set by hand --------------------------------------


def two_layers(w1, b1, w2, b2):
    """``Linear(2, 1)`` then ``Linear(1, 1)`` with the weights and biases given."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.Linear(1, 1))
    with torch.no_grad():
        for p, v in zip(model.parameters(), (w1, b1, w2, b2), strict=True):
            p.copy_(torch.tensor(v, dtype=torch.float32).view_as(p))
    return model


def _set_grads(params, grads) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = None if g is None else torch.tensor(g, dtype=torch.float32).view_as(p)


def lars_steps(lars, grads, w1=((3.0, 4.0),), lrs=None, **hyper) -> list:
    """Parameters (as lists) after one step of the student's ``lars`` per entry of ``grads`` on
    the hand-set model (``lrs``: the learning rate of each step, set as a schedule would)."""
    model = two_layers([list(w) for w in w1], [2.0], [[2.0]], [-1.0])
    opt = lars(model.parameters(), **hyper)
    after = []
    for i, step_grads in enumerate(grads):
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[i]
        _set_grads(list(model.parameters()), step_grads)
        opt.step()
        after.append([p.detach().flatten().tolist() for p in model.parameters()])
    return after


def lars_run(lars, hyper: dict, init, grads) -> list:
    """The parameters after each step of ``lars`` from ``init``; gradients written into the same
    .grad tensors in place after the first step (as zero_grad(set_to_none=False) and backward do)."""
    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = lars(params, **hyper)
    after = []
    for step, gs in enumerate(grads):
        for p, g in zip(params, gs, strict=True):
            if step == 0:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
        opt.step()
        after.append([p.detach().clone() for p in params])
    return after
