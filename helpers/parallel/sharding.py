"""ZeRO and FSDP: who keeps which shard of the training state, and what that costs per rank.

Stage 0 (DDP) keeps everything on every rank. ZeRO (Rajbhandari et al. 2020) shards, over n
ranks: stage 1 the optimizer state, stage 2 the gradients as well, stage 3 the parameters as
well; PyTorch's FSDP (``fully_shard``) is stage 3. ``bytes_per_rank`` is the paper's arithmetic;
``measure`` trains a small model under one of them on every rank of a launch and reports
what each rank really holds (``helpers.memory.track``). Introduced in lecture 03.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.measure.memory import bytes_per_param

STAGES = {
    0: "DDP: everything replicated",
    1: "ZeRO-1: optimizer state sharded",
    2: "ZeRO-2: + gradients sharded",
    3: "ZeRO-3 / FSDP: + parameters sharded",
}
# what each stage shards (stage 0 shards nothing)
SHARDED = {
    0: (),
    1: ("optimizer_state",),
    2: ("optimizer_state", "gradients"),
    3: ("optimizer_state", "gradients", "parameters"),
}


def bytes_per_rank(
    n_params: float,
    world_size: int,
    stage: int,
    optimizer: str = "adam",
    precision: str = "fp32",
) -> dict:
    """Bytes of parameters, gradients and optimizer state one rank keeps, with total.

    The ZeRO paper's formula: (2 + 2 + K)·Ψ for DDP in mixed precision, and each part a stage
    shards divided by n (Ψ = ``n_params``). Peaks come on top: activations, and under stage 3
    the full parameters of the layer being computed (gathered, then freed).
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, not {stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size!r}")
    per = bytes_per_param(optimizer, precision)
    out = {
        part: n_params * b / (world_size if part in SHARDED[stage] else 1)
        for part, b in per.items()
    }
    out["total"] = sum(out.values())
    return out


def fsdp_shard_numel(shape, world_size: int) -> int:
    """Numbers of one tensor that each rank stores under FSDP: dim 0 padded to a multiple of n."""
    rows = math.ceil(shape[0] / world_size) if shape else 1
    return rows * math.prod(shape[1:])


# -- a measured run, one rank's part --------------------------------------------------------


def _model(hidden: int, depth: int, dtype: str = "float32", seed: int = 0):
    from helpers.workloads.models import mlp

    torch.manual_seed(seed)  # every rank builds the same weights
    return mlp(hidden=hidden, depth=depth).to(getattr(torch, dtype))


def _batch(step: int, batch: int, rank: int, world_size: int, dtype: str = "float32"):
    """Rank ``rank``'s share of the global batch of ``step``: the same samples at every n."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch, 1, 8, 8, generator=g).to(getattr(torch, dtype))  # (B, 1, 8, 8)
    y = torch.randint(10, (batch,), generator=g)  # (B,)
    return x.chunk(world_size)[rank], y.chunk(world_size)[rank]


def wrap(model, stage: int, lr: float = 1e-3):
    """``model`` and an Adam optimizer set up for ``stage`` on the current process group.

    0: DDP; 1: DDP + ZeroRedundancyOptimizer (PyTorch's ZeRO-1: each rank owns the optimizer
    state of whole tensors, about 1/n of them); 3: ``fully_shard`` on every Linear, then on the
    whole model (FSDP2: parameters, gradients and state sharded along dim 0).
    """
    if stage in (0, 1):
        model = DDP(model)
        # the same all-reduce DDP makes, from Python: helpers.trace sees it (lecture 02)
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    if stage == 0:
        return model, torch.optim.Adam(model.parameters(), lr=lr)
    if stage == 1:
        # 0.4 s to import (torch 2.14): import helpers does not pay it, only a stage-1 run
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=lr)
        return model, opt
    if stage == 3:
        return shard_fully(model), torch.optim.Adam(model.parameters(), lr=lr)
    raise ValueError(
        f"stage {stage!r}: measured runs cover 0 (DDP), 1 (ZeroRedundancyOptimizer) and 3 "
        "(fully_shard); stage 2 is the formula only (DeepSpeed's stage 2 is not in PyTorch)"
    )


def shard_fully(model):
    """FSDP2 (``fully_shard``) on every Linear of ``model``, then on the whole, where it is.

    Every Linear its own unit: one all-gather per layer, so only one layer is ever whole. The
    mesh is that of the device the parameters are on. ``fully_shard``'s default mesh is the
    accelerator's whenever there is one: on a GPU node it moved a CPU model onto the GPU
    (leaving the targets behind on the CPU), and with more ranks than GPUs it picked GPU number
    LOCAL_RANK, which does not exist ("invalid device ordinal"; both seen on a one-GPU H200
    node, torch 2.11). Returns ``model``, sharded in place.
    """
    # 0.4 s to import (torch 2.14): import helpers does not pay it, only an FSDP run
    from torch.distributed.fsdp import fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.modules():
        if layer is not model and isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _local_optimizer(opt):
    """The optimizer whose ``state`` this rank holds (ZeroRedundancyOptimizer keeps an inner one)."""
    return getattr(opt, "optim", opt)


def full_parameters(model) -> list:
    """Every parameter whole, in model order (a DTensor shard is gathered from all ranks)."""
    out = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(full.detach().clone())
    return out


def measure(
    stage: int,
    hidden: int = 256,
    depth: int = 4,
    batch: int = 64,
    steps: int = 3,
    dtype: str = "float32",
):
    """Train ``steps`` Adam steps under ``stage`` on this rank; return what it held, measured.

    To compare parameters with one process, train in ``dtype="float64"``: in float32 the ranks
    sum the gradients in another order than one process does, and after a few steps such a
    rounding can flip a ReLU whose input was within 1e-7 of zero, after which Adam (which
    normalises each gradient by its size) turns that into a difference of about its step size.

    Returns {'rank', 'world_size', 'stage', 'n_params', 'steady': bytes by part after the last
    step (gradients kept: what a step needs), 'peak': the largest total during the last step,
    'comm': {collective: bytes it carried in the last step}, 'params': the full parameters
    after training}. Run it with ``helpers.launch``.
    """
    from helpers.measure.memory import track
    from helpers.measure.tracing import trace

    rank, n = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    model = _model(hidden, depth, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    model, opt = wrap(model, stage)
    for k in range(steps):
        x, y = _batch(k, batch, rank, n, dtype)
        opt.zero_grad(set_to_none=True)
        with track(model, _local_optimizer(opt), x, y) as mem, trace() as calls:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            steady = mem.now()
    return {
        "rank": rank,
        "world_size": n,
        "stage": stage,
        "n_params": n_params,
        "steady": steady,
        "peak": mem.peak,
        "comm": payload(calls.records, n),
        "params": full_parameters(model),
    }


# one rank's 1/n in, the full tensor out (or the reverse); FSDP2 calls the *_single forms
GATHER_SCATTER = (
    "all_gather",  # a list of n outputs and one input
    "reduce_scatter",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
)


def payload(records: list[dict], world_size: int) -> dict:
    """Bytes each collective carried, by op: the full tensor it reduces, gathers or broadcasts.

    The tracer counts every tensor passed in; an all-gather gets the full output and this
    rank's 1/n input (a reduce-scatter the reverse), so its payload is n/(n+1) of that.
    """
    out: dict = {}
    for r in records:
        b = r["bytes"]
        if r["op"] in GATHER_SCATTER:
            b = b * world_size // (world_size + 1)
        out[r["op"]] = out.get(r["op"], 0) + b
    return out


def reference(
    hidden: int = 256, depth: int = 4, batch: int = 64, steps: int = 3, dtype: str = "float32"
) -> list:
    """The same training on one process without any wrapper: the parameters to compare with."""
    model = _model(hidden, depth, dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for k in range(steps):
        x, y = _batch(k, batch, 0, 1, dtype)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def calculator(
    n_params: float = 7e9,
    optimizer: str = "adam",
    precision: str = "mixed",
    stage: int = 3,
    world_size: int = 8,
):
    """An ipywidgets calculator: model size, optimizer, precision, stage, ranks -> bytes per rank.

    The widgets start at the arguments; the table under them is ``bytes_per_rank`` (GB).
    """
    import ipywidgets as w
    from IPython.display import display

    from helpers.measure.memory import OPTIMIZER_STATE, PRECISIONS

    def show(billions, optimizer, precision, stage, world_size):
        per = bytes_per_rank(billions * 1e9, world_size, stage, optimizer, precision)
        print(
            f"{STAGES[stage]}, {world_size} ranks, {billions:g} B parameters, "
            f"{optimizer} in {precision}:"
        )
        for part, b in per.items():
            print(f"  {part.replace('_', ' '):>16}: {b / 1e9:10.2f} GB per rank")

    ui = w.interactive(
        show,
        billions=w.FloatLogSlider(
            value=n_params / 1e9, base=10, min=-3, max=3, step=0.05, description="params (B)"
        ),
        optimizer=w.Dropdown(options=list(OPTIMIZER_STATE), value=optimizer),
        precision=w.Dropdown(options=list(PRECISIONS), value=precision),
        stage=w.Dropdown(options=[(v, k) for k, v in STAGES.items()], value=stage),
        world_size=w.IntSlider(value=world_size, min=1, max=1024, description="ranks"),
    )
    display(ui)
    return ui
