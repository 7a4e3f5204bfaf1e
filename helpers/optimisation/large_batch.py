"""Large-batch training (lab 05): the same epochs at any global batch, on any number of ranks.

    batches = large_batch.epoch_batches(n_samples, global_batch, epoch, seed)   # drop_last
    recipe = large_batch.Recipe(global_batch, micro, k, epochs, lr_at=lambda step: 0.1,
                                make_optimizer=sgd, seed=0)
    result = large_batch.train(build, train_set, test_set, recipe)

A step of global batch B on n ranks with k accumulation steps: every rank takes its B/n samples
of the step in k micro-batches of B/(n k), scales each micro-batch's mean loss by 1/k, and DDP
all-reduces (averages) the gradient once, on the last micro-batch. The update is one process's
update on the whole batch B (for a model without BatchNorm, whose statistics would be per
micro-batch): a 2-core laptop reaches the global batch of a 4-GPU node, just more slowly.
The same code runs in a plain process (no process group: n = 1, no DDP).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def epoch_batches(n_samples: int, global_batch: int, epoch: int, seed: int) -> list:
    """The global batches of one epoch: a permutation seeded by (seed, epoch), cut into whole
    batches of ``global_batch`` (the last, partial one dropped: every step has the same size)."""
    if not 1 <= global_batch <= n_samples:
        raise ValueError(
            f"a global batch of {global_batch} needs between 1 and {n_samples} samples per "
            f"step (the training set has {n_samples}): choose a smaller batch or a larger dataset"
        )
    order = torch.randperm(
        n_samples, generator=torch.Generator().manual_seed(seed * 10_007 + epoch)
    )
    steps = n_samples // global_batch
    return list(order[: steps * global_batch].view(steps, global_batch))


def my_micro_batches(batch, micro: int, k: int, rank: int = 0, world_size: int = 1) -> list:
    """This rank's k micro-batches of ``micro`` indices: its contiguous share of the global batch."""
    if micro * k * world_size != len(batch):
        raise ValueError(
            f"{world_size} ranks x {k} micro-batches x {micro} samples = "
            f"{micro * k * world_size}, not the global batch of {len(batch)}: plan them again"
        )
    mine = batch[rank * micro * k : (rank + 1) * micro * k]
    return list(mine.split(micro))


def evaluate(model, dataset, device=None, batch: int = 1024) -> dict:
    """Mean cross-entropy and accuracy of ``model`` on a whole TensorDataset."""
    x, y = dataset.tensors
    loss, correct = 0.0, 0
    with torch.no_grad():
        for xb, yb in zip(x.split(batch), y.split(batch), strict=True):
            xb, yb = xb.to(device or "cpu"), yb.to(device or "cpu")
            out = model(xb)
            loss += nn.functional.cross_entropy(out, yb, reduction="sum").item()
            correct += (out.argmax(1) == yb).sum().item()
    return {"loss": loss / len(y), "accuracy": correct / len(y)}


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclass(frozen=True)
class Recipe:
    """How ``train`` trains: steps of ``global_batch`` samples, each rank's share in ``k``
    micro-batches of ``micro``, for ``epochs``; ``lr_at(step)`` the schedule,
    ``make_optimizer(params)`` the optimizer; ``seed`` the initial weights and the shuffling.
    ``max_steps`` stops early (the equivalence checks compare a few steps); ``stop_below``
    stops after the first epoch whose training loss is below it (time to a target loss)."""

    global_batch: int
    micro: int
    k: int
    epochs: int
    lr_at: Callable[[int], float]
    make_optimizer: Callable
    seed: int = 0
    max_steps: int | None = None
    stop_below: float | None = None


def train(build, train_set, test_set, recipe: Recipe, on_model=None, device=None) -> dict:
    """Train ``build()`` as ``recipe`` says, on every rank of the current world.

    Returns (identical on every rank) one row per epoch — train loss (mean over the epoch's
    steps), test loss and accuracy, train accuracy at the end of the epoch, the learning rate
    of the last step, ``seconds``: its training time on this rank (evaluation not included),
    synchronised on a GPU — plus ``losses`` (every step's loss on the global batch), ``steps``,
    ``diverged`` (a non-finite loss stops the run at the end of its epoch: nothing after it
    would mean anything) and ``state``, the final parameters. ``test_set=None`` skips the
    evaluation (a timed epoch times training only); ``on_model(model)`` is called on the
    DDP-wrapped model before training (to register a CommRecorder, say). ``device``: where the
    model and data live (default the CPU; ``helpers.device()`` on a GPU node).
    """
    _, world_size = _world()
    r = recipe
    torch.manual_seed(r.seed)  # the same initial weights on every rank and in the 1-process run
    net = build().to(device or "cpu")
    model = DDP(net) if world_size > 1 else net
    if on_model is not None:
        on_model(model)
    data = [t.to(device or "cpu") for t in train_set.tensors]
    plan = (r.global_batch, r.micro, r.k)
    run = _Steps(net, model, r.make_optimizer(model.parameters()), data, plan, r.lr_at, r.seed)
    rows, curve, diverged = [], [], False
    for epoch in range(r.epochs):
        losses, seconds = run.epoch(epoch, r.max_steps)
        rows.append(run.row(epoch, losses, seconds, train_set, test_set))
        curve += losses
        diverged = not math.isfinite(rows[-1]["train loss"])
        if diverged or r.max_steps is not None and run.step >= r.max_steps:
            break
        if r.stop_below is not None and rows[-1]["train loss"] < r.stop_below:
            break
    state = {name: p.detach().clone() for name, p in net.named_parameters()}
    losses = run.global_losses(curve)
    return {
        "epochs": rows,
        "steps": run.step,
        "diverged": diverged,
        "state": state,
        "losses": losses,
    }


class _Steps:
    """``train``'s steps on this rank: the model (DDP-wrapped on several ranks), its optimizer,
    the training data on the device, the plan (global batch, micro-batch, k) and the schedule."""

    def __init__(self, net, model, opt, data: list, plan: tuple[int, int, int], lr_at, seed: int):
        self.net, self.model, self.opt = net, model, opt
        self.x, self.y = data
        self.global_batch, self.micro, self.k = plan
        self.lr_at, self.seed = lr_at, seed
        self.rank, self.world_size = _world()
        self.step, self.lr = 0, None  # steps taken, and the last one's learning rate

    def epoch(self, epoch: int, max_steps: int | None) -> tuple[list[float], float]:
        """One epoch's steps (until ``max_steps`` in all): each one's loss on this rank's share,
        and the seconds they took (synchronised on a GPU)."""
        losses, start = [], time.perf_counter()
        for batch in epoch_batches(len(self.y), self.global_batch, epoch, self.seed):
            losses.append(self.take(batch))
            # (a non-finite loss is acted on at the epoch's end, by every rank together: a rank
            # that stopped here alone would leave the others waiting in the next all-reduce)
            if max_steps is not None and self.step >= max_steps:
                break
        if self.x.device.type == "cuda":
            torch.cuda.synchronize()
        return losses, time.perf_counter() - start

    def take(self, batch) -> float:
        """One step on the global ``batch``: this rank's k micro-batches, their gradients
        accumulated and all-reduced once. Returns this rank's share of the step's loss."""
        self.lr = self.lr_at(self.step)
        for group in self.opt.param_groups:
            group["lr"] = self.lr
        self.opt.zero_grad()
        step_loss = 0.0
        parts = my_micro_batches(batch, self.micro, self.k, self.rank, self.world_size)
        for j, idx in enumerate(parts):
            # only the last micro-batch's backward all-reduces (the others accumulate)
            last = j == len(parts) - 1
            alone = last or self.world_size == 1
            with contextlib.nullcontext() if alone else self.model.no_sync():
                loss = nn.functional.cross_entropy(self.model(self.x[idx]), self.y[idx]) / self.k
                loss.backward()
            step_loss += loss.item()
        self.opt.step()
        self.step += 1
        return step_loss

    def row(self, epoch: int, losses: list, seconds: float, train_set, test_set) -> dict:
        """The epoch's row, the same on every rank (its training loss all-reduced)."""
        # the loss of the whole global batch: the mean over ranks of their micro-batch means
        mean = torch.tensor(
            [sum(losses) / max(len(losses), 1)], dtype=torch.float64, device=self.x.device
        )
        if self.world_size > 1:
            dist.all_reduce(mean)
        row = {"epoch": epoch + 1, "steps": self.step, "train loss": mean.item() / self.world_size}
        row.update({"lr": self.lr, "seconds": seconds})
        if test_set is not None:
            tested = evaluate(self.net, test_set, self.x.device)
            row.update({f"test {key}": v for key, v in tested.items()})
            # accuracy on the training set too: under-fitting and a generalisation gap look alike
            row["train accuracy"] = evaluate(self.net, train_set, self.x.device)["accuracy"]
        return row

    def global_losses(self, curve: list) -> list:
        """Every step's loss on the global batch, from each rank's share (``curve``)."""
        curve = torch.tensor(curve, dtype=torch.float64, device=self.x.device)
        if self.world_size > 1:
            dist.all_reduce(curve)  # once, at the end: no extra communication inside the steps
        return (curve / self.world_size).tolist()


def epoch_seconds(build, train_set, global_batch: int, micro: int, k: int, seed: int = 0) -> float:
    """Wall-clock seconds of one training epoch (plain SGD) at this plan, the slowest rank's."""
    _, world_size = _world()
    if world_size > 1:
        dist.barrier()
    start = time.perf_counter()
    sgd = lambda params: torch.optim.SGD(params, lr=0.01)  # noqa: E731
    steps = len(train_set) // global_batch
    train(
        build, train_set, None, Recipe(global_batch, micro, k, 1, lambda _: 0.01, sgd, seed, steps)
    )
    seconds = torch.tensor([time.perf_counter() - start])
    if world_size > 1:
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()
