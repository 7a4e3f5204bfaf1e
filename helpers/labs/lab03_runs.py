"""Lab 03's runs: part 1's device peak and epoch times, part 2's fits of the image, part 3's
ZeroOne training and part 4's bytes kept per rank.

They run the student's code (``psnr``, ``ZeroOne``), passed in as arguments, on the ranks of a
``helpers.launch`` (part 1's peak in the kernel, its epochs in one launched rank); what they
return is data for the notebook's tables and for the tests' probes.
They are machinery, not references: a check never trusts what they return, it recomputes what it
compares against (helpers.labs.lab03). Kept here so the lab's cells hold the student's task.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.labs.lab03 import FEATURES, OPTIMIZERS, zero_batch
from helpers.measure.memory import memory_limit, nbytes, optimizer_tensors
from helpers.measure.tracing import trace
from helpers.parallel.sharding import payload, shard_fully
from helpers.workloads.models import coordinate_mlp

# -- part 1: the device's peak and the epoch times of part 1's model ---------------------------
# ``image`` is the lab's {"inputs", "pixels", "size" (H, W), "budget", "lr"} (its set-up cell).


def make_model(depth: int, width: int, seed: int = 0, dtype=torch.float32):
    """The lab's coordinate MLP: the same initial weights for the same seed (on every rank)."""
    torch.manual_seed(seed)
    return coordinate_mlp(FEATURES, depth, width).to(dtype)


def pixel_batch(image: dict, batch: int, seed: int = 0):
    """``batch`` pixels drawn at random without repeats (the same ones for the same seed)."""
    h, w = image["size"]
    idx = torch.randperm(h * w, generator=torch.Generator().manual_seed(seed))[:batch]
    return image["inputs"][idx].clone(), image["pixels"][idx].clone()


def step_peak(batch: int, image: dict, depth: int, width: int, budget=None):
    """Peak bytes of two Adam steps at ``batch`` pixels (the second holds Adam's state from its
    start), as helpers.memory_limit counts them; None, with the error's first line printed, if
    they ran out of ``budget`` bytes, as a GPU would."""
    h, w = image["size"]
    if not 0 < batch <= h * w:
        raise ValueError(
            f"a batch of {batch} pixels: the image has {h * w}; lower device_memory or enlarge "
            "image_size"
        )
    model = make_model(depth, width)
    opt = torch.optim.Adam(model.parameters(), lr=image["lr"])
    x, y = pixel_batch(image, batch)
    try:
        with memory_limit(budget or 10**15, model, opt) as mem:
            for _ in range(2):
                opt.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
                opt.step()
                mem.check()
    except torch.OutOfMemoryError as oom:
        print(f"batch {batch}: " + str(oom).split(". In use")[0])
        return None
    return mem.peak["total"]


def epoch_times(image: dict, depth: int, width: int, sizes, repeats: int) -> dict:
    """{batch size: seconds of each epoch}: ``repeats`` epochs of training at each of ``sizes``,
    interleaved; round 0 warms up and is not kept. Each epoch's batches are drawn before its
    clock starts (the data is in memory: no loading is timed). Run in a launched rank."""
    h, w = image["size"]
    model = make_model(depth, width)
    opt = torch.optim.Adam(model.parameters(), lr=image["lr"])
    times = {b: [] for b in sizes}
    for r in range(repeats + 1):
        for b in sizes:
            order = torch.randperm(h * w).split(b)
            batches = [(image["inputs"][i], image["pixels"][i]) for i in order]
            start = time.perf_counter()
            for x, y in batches:
                opt.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
                opt.step()
            if r:
                times[b].append(time.perf_counter() - start)
    return times


def _setup(depth: int, width: int, parallel: str | None, lr: float):
    """Part 2's model on this rank: plain, DDP (the batch split) or FSDP (everything sharded),
    with its Adam, and whether DDP keeps its gradient buckets between steps."""
    torch.manual_seed(0)  # every rank builds the same initial weights
    model = coordinate_mlp(FEATURES, depth, width)
    ddp = dist.get_world_size() > 1 and parallel == "ddp"
    if ddp:
        model = DDP(model, gradient_as_bucket_view=True)  # the gradients live in DDP's buckets
    elif dist.get_world_size() > 1:
        shard_fully(model)  # fully_shard on each Linear (gathered layer by layer), then the model
    return model, torch.optim.Adam(model.parameters(), lr=lr), ddp


def _fullest_peak(step, model, opt) -> dict:
    """Every rank's peak by part over two steps; the fullest device's (it decides a fit)."""
    with memory_limit(10**15, model, opt) as mem:  # measure only: no rank fails alone
        for _ in range(2):
            step()
            mem.check()
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, mem.peak)
    return max(peaks, key=lambda p: p["total"])


def _gathered_image(model, x):
    """The prediction for every pixel: each rank's part, gathered in rank order."""
    with torch.no_grad():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, model(x).clamp(0, 1))
    return torch.cat(parts)


def _fit_one(depth: int, width: int, parallel, x, y, image: dict, psnr, steps: int) -> dict:
    """One configuration: its fullest peak; out of memory, or the timed steps, PSNR and image."""
    model, opt, ddp = _setup(depth, width, parallel, image["lr"])

    def step():
        opt.zero_grad(set_to_none=not ddp)  # DDP's buckets stay between steps
        ((model(x) - y) ** 2).mean().backward()
        opt.step()

    peak = _fullest_peak(step, model, opt)
    if peak["total"] > image["budget"]:  # every rank skips it together: none waits alone
        return {"peak": peak, "oom": True}
    seconds = []
    for _ in range(steps - 2):  # the two measured steps were the warm-up
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    whole = _gathered_image(model, x)
    return {"psnr": psnr(whole, image["pixels"]), "seconds": seconds, "peak": peak,
            "image": whole.reshape(*image["size"], 3)}  # fmt: skip


def fit_image(configs, steps: int, parallel, image: dict, psnr) -> dict:
    """{(depth, width): {"psnr", "seconds" (each timed step), "peak" (bytes by part, fullest
    device), "image"} or {"peak", "oom": True}}, rank 0's. ``image``: {"inputs", "pixels",
    "size" (H, W), "budget", "lr"}; ``psnr``: the student's, scoring the gathered prediction. On
    several ranks ``parallel`` is "ddp" (the batch split) or "fsdp"; each rank a copy of its pixels."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = image["inputs"].chunk(n)[rank].clone(), image["pixels"].chunk(n)[rank].clone()
    return {(d, w): _fit_one(d, w, parallel, x, y, image, psnr, steps) for d, w in configs}


def _others(model, rank: int, n: int) -> list:
    """Per parameter, the mask of the numbers outside this rank's shard of s = ⌈P/n⌉."""
    sizes = [p.numel() for p in model.parameters()]
    s = -(-sum(sizes) // n)
    mine = torch.zeros(sum(sizes), dtype=torch.bool)
    mine[rank * s : (rank + 1) * s] = True
    return [~m.view_as(p) for m, p in zip(mine.split(sizes), model.parameters(), strict=True)]


def zero_training(
    zero_class, optimizer="adam", steps=3, depth=2, width=31, dtype="float64", seed=0
):
    """Train DDP + the student's ``zero_class`` (ZeroOne) on this rank: after every step the
    parameters, the bytes step() gathered and the collectives it called; the state it keeps.
    Before each step the gradients outside the rank's shard are garbage: it must not read them."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(coordinate_mlp(FEATURES, depth, width).to(getattr(torch, dtype)))
    others = _others(model, rank, n)
    name, kwargs = OPTIMIZERS[optimizer]
    zero = zero_class(model.parameters(), getattr(torch.optim, name), **kwargs)
    out = {"params": [], "gathered": [], "ops": []}
    for step in range(steps):
        x, y = zero_batch(step, rank, dtype, seed)
        zero.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        with torch.no_grad():  # a ZeRO-1 rank reads only its shard of the gradients
            for p, other in zip(model.parameters(), others, strict=True):
                p.grad[other] = 1e3
        with trace() as calls:
            zero.step()
        out["gathered"].append(sum(payload(calls.records, n).values()))
        out["ops"].append(sorted({c["op"] for c in calls.records}))
        out["params"].append([p.detach().clone() for p in model.parameters()])
    out["state bytes"] = nbytes(optimizer_tensors(getattr(zero, "optimizer", None)))
    return out


def zero_runs(
    zero_class, optimizer="adam", world_size=2, dtype="float64", depth=2, width=31, seed=0
):
    """``zero_training`` on ``world_size`` gloo ranks: one result per rank."""
    from helpers.launcher.launch import launch

    return launch(zero_training, zero_class, optimizer, depth=depth, width=width, dtype=dtype,
                  seed=seed, world_size=world_size, backend="gloo", output="none", timeout=120)  # fmt: skip


def measured_state(stage: int, zero_class, model: dict) -> dict:
    """What this rank keeps, in bytes by part, after one Adam step of coordinate_mlp(26,
    ``model["depth"]``, ``model["width"]``) at ``model["lr"]``: stage 0 DDP, 1 DDP with the
    student's ``zero_class`` (ZeroOne), 3 fully_shard. The batch is random: bytes kept do not
    depend on the values."""
    from helpers.measure.memory import breakdown

    torch.manual_seed(0)  # every rank builds the same initial weights
    net = coordinate_mlp(FEATURES, model["depth"], model["width"])
    if stage == 3:
        shard_fully(net)  # fully_shard on each Linear, then the model
        opt = torch.optim.Adam(net.parameters(), lr=model["lr"])
    else:
        net = DDP(net)
        opt = (zero_class(net.parameters(), torch.optim.Adam, lr=model["lr"]) if stage == 1
               else torch.optim.Adam(net.parameters(), lr=model["lr"]))  # fmt: skip
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(64, FEATURES, generator=g), torch.rand(64, 3, generator=g)
    opt.zero_grad()
    ((net(x) - y) ** 2).mean().backward()
    opt.step()
    state = breakdown(net, getattr(opt, "optimizer", opt))
    return {k: state[k] for k in ("parameters", "gradients", "optimizer_state")}
