"""Large-batch training (lab 05): the same epochs at any global batch, on any number of ranks.

    batches = large_batch.epoch_batches(n_samples, global_batch, epoch, seed)   # drop_last
    result = large_batch.train(build, train_set, test_set, global_batch, micro, k, epochs,
                               lr_at=lambda step: 0.1, make_optimizer=sgd, seed=0)

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


def epoch_batches(n_samples: int, global_batch: int, epoch: int, seed: int) -> list:
    """The global batches of one epoch: a permutation seeded by (seed, epoch), cut into whole
    batches of ``global_batch`` (the last, partial one dropped, so every step has the same size)."""
    import torch

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
    import torch
    from torch import nn

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
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def train(
    build,
    train_set,
    test_set,
    global_batch: int,
    micro: int,
    k: int,
    epochs: int,
    lr_at,
    make_optimizer,
    seed: int = 0,
    max_steps: int | None = None,
    on_model=None,
    device=None,
    stop_below: float | None = None,
) -> dict:
    """Train ``build()`` for ``epochs`` at ``global_batch`` on every rank of the current world.

    ``lr_at(step)`` sets the learning rate of every parameter group before each step (a
    schedule); ``make_optimizer(params)`` builds the optimizer. Returns (identical on every
    rank) one row per epoch — train loss (mean over the epoch's steps), test loss and accuracy,
    train accuracy at the end of the epoch,
    the learning rate of the last step — plus ``losses`` (every step's loss on the global
    batch), ``steps``, ``diverged`` (a non-finite loss
    stops the run at the end of its epoch: nothing after it would mean anything) and ``state``, the final parameters.
    ``max_steps`` stops early (the equivalence checks compare a few steps); ``test_set=None``
    skips the evaluation (a timed epoch times training only); ``on_model(model)`` is called
    on the DDP-wrapped model before training (to register a CommRecorder, say). ``device``:
    where the model and data live (default the CPU; ``helpers.device()`` on a GPU node).
    Each epoch's row also has ``seconds``: its training time on this rank (evaluation not
    included), synchronised on a GPU. ``stop_below``: stop after the first epoch whose training
    loss is below it (time to a target loss, lab 06).
    """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world_size = _world()
    torch.manual_seed(seed)  # the same initial weights on every rank and in the 1-process run
    net = build().to(device or "cpu")
    model = DDP(net) if world_size > 1 else net
    if on_model is not None:
        on_model(model)
    opt = make_optimizer(model.parameters())
    x, y = (t.to(device or "cpu") for t in train_set.tensors)
    cuda = torch.device(device or "cpu").type == "cuda"
    rows, step, diverged, curve = [], 0, False, []
    for epoch in range(epochs):
        losses, start = [], time.perf_counter()
        for batch in epoch_batches(len(y), global_batch, epoch, seed):
            lr = lr_at(step)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad()
            step_loss = 0.0
            parts = my_micro_batches(batch, micro, k, rank, world_size)
            for j, idx in enumerate(parts):
                # only the last micro-batch's backward all-reduces (the others accumulate)
                last = j == len(parts) - 1
                sync = contextlib.nullcontext() if last or world_size == 1 else model.no_sync()
                with sync:
                    loss = nn.functional.cross_entropy(model(x[idx]), y[idx]) / k
                    loss.backward()
                step_loss += loss.item()
            opt.step()
            step += 1
            losses.append(step_loss)
            # (a non-finite loss is acted on at the epoch's end, by every rank together: a rank
            # that stopped here alone would leave the others waiting in the next all-reduce)
            if max_steps is not None and step >= max_steps:
                break
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        # the loss of the whole global batch: the mean over ranks of their micro-batch means
        mean = torch.tensor(
            [sum(losses) / max(len(losses), 1)], dtype=torch.float64, device=x.device
        )
        if world_size > 1:
            dist.all_reduce(mean)
        rows.append(
            {
                "epoch": epoch + 1,
                "steps": step,
                "train loss": mean.item() / world_size,
                "lr": lr,
                "seconds": seconds,
            }
        )
        if test_set is not None:
            rows[-1].update(
                {f"test {key}": v for key, v in evaluate(net, test_set, x.device).items()}
            )
            # accuracy on the training set too: under-fitting and a generalisation gap look alike
            rows[-1]["train accuracy"] = evaluate(net, train_set, x.device)["accuracy"]
        curve += losses
        diverged = not math.isfinite(rows[-1]["train loss"])
        if diverged or max_steps is not None and step >= max_steps:
            break
        if stop_below is not None and rows[-1]["train loss"] < stop_below:
            break
    state = {name: p.detach().clone() for name, p in net.named_parameters()}
    curve = torch.tensor(
        curve, dtype=torch.float64, device=x.device
    )  # each step's loss on this rank's share
    if world_size > 1:
        dist.all_reduce(curve)  # once, at the end: no extra communication inside the steps
    losses = (curve / world_size).tolist()
    return {"epochs": rows, "steps": step, "diverged": diverged, "state": state, "losses": losses}


def epoch_seconds(build, train_set, global_batch: int, micro: int, k: int, seed: int = 0) -> float:
    """Wall-clock seconds of one training epoch (plain SGD) at this plan, the slowest rank's."""
    import torch
    import torch.distributed as dist

    _, world_size = _world()
    if world_size > 1:
        dist.barrier()
    start = time.perf_counter()
    train(
        build,
        train_set,
        None,
        global_batch,
        micro,
        k,
        1,
        lambda step: 0.01,
        lambda params: torch.optim.SGD(params, lr=0.01),
        seed,
        max_steps=len(train_set) // global_batch,
    )
    seconds = torch.tensor([time.perf_counter() - start])
    if world_size > 1:
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()
