"""Lab 05's runs of the student's code: part 1's equivalence check and timed epochs, the sweeps
of parts 2–4 (through the student's ``plan``, ``scaled_lr``, ``lr_at`` and ``LARS``, passed in),
and the hand-set models test_lars steps with the student's ``LARS``.

What they return is data for the notebook's tables (helpers.labs.lab05_report) and the tests'
probes; a check never trusts it, it recomputes what it compares against (helpers.labs.lab05).
Kept here so the lab's cells hold the student's task.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from helpers.optimisation import large_batch
from helpers.workloads import data, models


@dataclass(frozen=True)
class Lab:
    """What every run of the lab shares, from its parameters cell: the data, the MLP (no
    BatchNorm), SGD with momentum 0.9 at ``base_lr``, the epochs, a rank's memory
    (``max_micro`` samples), the seeds, the world, and parts 3–4's schedule settings."""

    train_set: torch.utils.data.TensorDataset
    test_set: torch.utils.data.TensorDataset
    hidden: int
    depth: int
    epochs: int
    max_micro: int
    seeds: tuple
    world_size: int
    backend: str
    base_lr: float
    base_batch: int
    warmup_epochs: int
    lars_lr: float
    trust: float

    @classmethod
    def load(cls, dataset: str, data_root=None, **params) -> Lab:
        """The lab's setting with ``dataset``'s training and test sets (offline for digits)."""
        params["seeds"] = tuple(params["seeds"])
        train, test = (data.load(dataset, data_root, train=t) for t in (True, False))
        return cls(train, test, **params)

    @property
    def n_train(self) -> int:
        return len(self.train_set)

    def build(self):
        """The lab's MLP, fresh (the caller seeds it)."""
        in_shape = tuple(self.train_set.tensors[0].shape[1:])
        return models.mlp(in_shape, hidden=self.hidden, depth=self.depth)

    def sgd(self, params):
        return torch.optim.SGD(params, lr=self.base_lr, momentum=0.9)

    def describe(self, dataset: str, batch_sizes) -> str:
        """The data, the model's size and each batch's steps per epoch, as the set-up prints them."""
        shape = tuple(self.train_set.tensors[0].shape[1:])
        steps = ", ".join(f"{b} -> {self.n_train // b}" for b in batch_sizes)
        return (f"{dataset}: {self.n_train:,} training and {len(self.test_set):,} test images of "
                f"shape {shape}\nMLP {self.hidden}x{self.depth}: "
                f"{models.n_params(self.build()):,} parameters\nsteps per epoch: {steps}")  # fmt: skip


# -- part 1: the same update on one process and on ranks, and what accumulation costs -----------


def first_steps(lab: Lab, global_batch: int, micro: int, k: int, steps: int = 3) -> dict:
    """The weights after ``steps`` steps of SGD at ``base_lr`` from seed 0, and the gradient
    bytes DDP all-reduced per step (0 in one process: nothing is reduced)."""
    from helpers.measure.comm import CommRecorder

    ddp = dist.is_initialized() and dist.get_world_size() > 1
    recorder = CommRecorder() if ddp else None
    recipe = large_batch.Recipe(global_batch, micro, k, 1, lambda s: lab.base_lr, lab.sgd,
                                seed=0, max_steps=steps)  # fmt: skip
    r = large_batch.train(lab.build, lab.train_set, None, recipe,
                          on_model=recorder.register if ddp else None)  # fmt: skip
    if not ddp:
        return {"state": r["state"], "bytes/step": 0}
    recorder.close()
    return {
        "state": r["state"],
        "bytes/step": sum(x["grad_bytes"] for x in recorder.records) / steps,
    }


def micro_timings(lab: Lab, global_batch: int, micros, repeats: int) -> dict:
    """{micro: seconds of one training epoch at ``global_batch`` on ``lab.world_size`` ranks,
    each rank's share in micro-batches of ``micro``, one per repeat}: one untimed warm-up epoch,
    then the repeats interleaved across the micro-batches."""
    from helpers.launcher.launch import launch
    from helpers.measure.scaling import interleave

    def timed(micro):
        k = global_batch // (lab.world_size * micro)
        return launch(large_batch.epoch_seconds, lab.build, lab.train_set, global_batch, micro, k,
                      world_size=lab.world_size, backend=lab.backend, output="none")[0]  # fmt: skip

    timed(micros[0])  # warm-up, not timed
    return interleave(micros, timed, repeats=repeats)


# -- parts 2-4: the sweeps ------------------------------------------------------------------------


def schedule(lab: Lab, method: str, global_batch: int, scaled_lr=None, lr_at=None, lars=None):
    """(the learning rate of each step, the optimizer) of one method at one global batch, from
    the student's ``scaled_lr``, ``lr_at`` and ``lars`` (LARS); the fixed rate needs none."""
    steps_per_epoch = lab.n_train // global_batch
    if method == "fixed lr":
        return (lambda step: lab.base_lr), lab.sgd
    peak = scaled_lr(lab.base_lr, lab.base_batch, global_batch)
    warmup = lab.warmup_epochs * steps_per_epoch
    if method == "scaled lr":
        return (lambda step: peak), lab.sgd
    if method == "scaled + warmup":
        return (lambda step: lr_at(step, lab.base_lr, peak, warmup)), lab.sgd
    if method == "LARS + warmup":
        return ((lambda step: lr_at(step, lab.base_lr, lab.lars_lr, warmup)),
                lambda params: lars(params, lr=lab.lars_lr, momentum=0.9, trust=lab.trust))  # fmt: skip
    raise ValueError(f"unknown method {method!r}")


def _row(method: str, batch: int, seed: int, micro: int, k: int, r: dict, seconds: float) -> dict:
    """One run's row: its last epoch, and whether it failed (no better than guessing, ln 10)."""
    last = r["epochs"][-1]
    return {"method": method, "global batch": batch, "seed": seed, "micro x k": f"{micro} x {k}",
            "steps": r["steps"], "train loss": last["train loss"],
            "train accuracy": last["train accuracy"], "test accuracy": last["test accuracy"],
            "seconds": seconds,
            "failed": r["diverged"] or not last["train loss"] < math.log(10),
            "curve": r["epochs"], "losses": r["losses"]}  # fmt: skip


def run_all(configs, lab: Lab, plan, scaled_lr=None, lr_at=None, lars=None) -> list[dict]:
    """Train every (method, global batch, seed) of ``configs`` on this world; a row per run.
    Each batch is split by the student's ``plan``; the rates and optimizer are ``schedule``'s."""
    rows = []
    for method, batch, seed in configs:
        micro, k = plan(batch, dist.get_world_size(), lab.max_micro)
        lr, optimizer = schedule(lab, method, batch, scaled_lr, lr_at, lars)
        start = time.perf_counter()
        recipe = large_batch.Recipe(batch, micro, k, lab.epochs, lr, optimizer, seed)
        r = large_batch.train(lab.build, lab.train_set, lab.test_set, recipe)
        rows.append(_row(method, batch, seed, micro, k, r, time.perf_counter() - start))
    return rows


def sweep(lab: Lab, methods, batches, plan, scaled_lr=None, lr_at=None, lars=None) -> list[dict]:
    """Every method at every batch from every seed on ``lab.world_size`` ranks (each batch split
    by the student's ``plan``): a row per run, rank 0's (every rank holds the same)."""
    from helpers.launcher.launch import launch

    configs = [(m, b, s) for s in lab.seeds for m in methods for b in batches]
    return launch(run_all, configs, lab, plan, scaled_lr, lr_at, lars, world_size=lab.world_size,
                  backend=lab.backend, output="none", timeout=1800)[0]  # fmt: skip


def same_at_base(
    rows: list[dict], base_batch: int, methods=("scaled lr", "scaled + warmup")
) -> list[dict]:
    """The fixed-rate runs at ``base_batch`` as each of ``methods``: there they are the same run."""
    return [dict(r, method=m) for r in rows if r["global batch"] == base_batch for m in methods]


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
