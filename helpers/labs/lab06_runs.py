"""Lab 06's runs: the model zoo, the runs to a target loss, the ViT, gloo against NCCL and the
papermill sweep, launched, and what the ranks measured collected.

Nothing here is graded: the lab's tests call the student's functions on cases of their own
(helpers.labs.lab06). Where a run's data goes through the student's code (``comm_share`` here;
``gradient_bytes`` and ``time_to_target`` in helpers.labs.lab06_report), the function is passed
in and called in the kernel, as the lab's cells called it. Kept here so that the lab's cells hold
the student's task; the notebook shows one launch (the ViT's) as a student would write it.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from helpers.launcher.launch import launch
from helpers.launcher.world import device
from helpers.measure import zoo as model_zoo
from helpers.measure.scaling import interleave
from helpers.optimisation import large_batch
from helpers.workloads.models import mlp

SWEEP_DIR = Path("build") / "lab06_sweep"  # relative to the notebook's folder, as papermill runs it
VIT_BATCH = 64  # the ViT's global batch: 64 on one rank, 64 // n on each of n
VIT_LR = 3e-3


def comparisons(zoo_models, target_batches) -> int:
    """The verdicts lab 06 prints, its family (lecture 06): the zoo's share ordering and each
    model's step, compute and extra time on 1 rank against ``world_size``; both orderings of
    part 2 (seconds per epoch, seconds to the target) over ranks x batches; the ViT's epochs."""
    zoo_verdicts = math.comb(len(zoo_models), 2) + 3 * len(zoo_models)
    return zoo_verdicts + 2 * math.comb(2 * len(target_batches), 2) + 1


# -- part 1: the zoo ---------------------------------------------------------------------------


def zoo(models, world_size: int, repeats: int, backend: str, **sizes) -> dict:
    """{(model, ranks): [each repeat's per-rank ``zoo.profile`` results]}: every model on one
    rank and on ``world_size``, ``repeats`` times, interleaved. ``sizes``: image, batch, steps,
    warmup (zoo.profile's)."""

    def run(config):
        name, n = config
        return launch(model_zoo.profile, name, **sizes, world_size=n, backend=backend,
                      output="none", timeout=600)  # fmt: skip

    return interleave([(m, n) for m in models for n in (1, world_size)], run, repeats=repeats)


def slowest_steps(ranks: list[dict]) -> list[dict]:
    """One run's steps, each as its slowest rank saw it: that rank ends the step for everyone."""
    steps = range(len(ranks[0]["records"]))
    return [max((r["records"][i] for r in ranks), key=lambda x: x["total"]) for i in steps]


def _medians(slowest: list[list[dict]], key: str, warmup: int) -> list[float]:
    """Per repeat, the median of ``key`` over its steps after ``warmup``."""
    return [statistics.median(x[key] for x in s[warmup:]) for s in slowest]


def zoo_repeats(zoo_runs: dict, comm_share, warmup: int) -> dict:
    """{(model, ranks): {"step", "compute", "exposed", "share"}}, one value per repeat (each the
    median over the run's steps after ``warmup``): what the findings read. ``comm_share`` is the
    student's, on each run's slowest steps."""
    out = {}
    for config, reps in zoo_runs.items():
        slowest = [slowest_steps(ranks) for ranks in reps]
        out[config] = {"step": _medians(slowest, "total", warmup),
                       "compute": _medians(slowest, "compute", warmup),
                       "exposed": _medians(slowest, "exposed_comm_s", warmup),
                       "share": [comm_share(s, warmup) for s in slowest]}  # fmt: skip
    return out


# -- part 2: time to a target loss -------------------------------------------------------------


def small_mlp():
    """Part 2's model: 2 hidden layers of 128 on the digits."""
    return mlp(hidden=128, depth=2)


def until_target(per_rank_batch: int, train_set, test_set, run: dict) -> list[dict]:
    """On this rank: the MLP trained with SGD (momentum 0.9) at ``per_rank_batch`` samples per
    rank until its training loss is below ``run["target"]`` or ``run["max_epochs"]``; its
    epochs' rows (large_batch.train). ``run``: lr, target, max_epochs."""
    lr = run["lr"]
    batch = per_rank_batch * dist.get_world_size()

    def sgd(params):
        return torch.optim.SGD(params, lr=lr, momentum=0.9)

    recipe = large_batch.Recipe(batch, per_rank_batch, 1, run["max_epochs"], lambda s: lr, sgd,
                                seed=0, stop_below=run["target"])  # fmt: skip
    r = large_batch.train(small_mlp, train_set, test_set, recipe)
    return r["epochs"]


def to_target(batches, world_size: int, repeats: int, backend: str, data: tuple, **run) -> dict:
    """{(ranks, batch per rank): [each repeat's epochs]}: ``until_target`` on one rank and on
    ``world_size`` at each per-rank batch, ``repeats`` times, interleaved. ``data``: (train set,
    test set); ``run``: lr, target, max_epochs."""

    def one(config):
        n, b = config
        return launch(until_target, b, *data, run, world_size=n, backend=backend,
                      output="none")[0]  # fmt: skip

    return interleave([(n, b) for b in batches for n in (1, world_size)], one, repeats=repeats)


# -- parts 3 and 4: the ViT, and gloo against NCCL ---------------------------------------------


def vit():
    """Part 3's model: torchvision's VisionTransformer, 2 layers of width 64, 8 x 8 images in
    2 x 2 patches, 10 classes."""
    from torchvision.models import VisionTransformer  # slow to import; part 3 only (CONTRIBUTING)

    return VisionTransformer(image_size=8, patch_size=2, num_layers=2, num_heads=4,
                             hidden_dim=64, mlp_dim=128, num_classes=10)  # fmt: skip


def rgb(dataset):
    """The digits repeated to 3 channels, as the ViT takes them."""
    x, y = dataset.tensors
    return torch.utils.data.TensorDataset(x.expand(-1, 3, -1, -1).contiguous(), y)


def vit_run(train_set, test_set, epochs: int) -> dict:
    """On this rank: the ViT trained ``epochs`` epochs with AdamW at a global batch of 64; its
    final test accuracy, training seconds and each epoch's seconds."""
    n = dist.get_world_size()

    def adamw(params):
        return torch.optim.AdamW(params, lr=VIT_LR)

    # on a GPU node both backends train on the GPUs (gloo all-reduces CUDA tensors too): only
    # the backend differs; on a CPU there is one device
    dev = device() if torch.cuda.is_available() else None
    recipe = large_batch.Recipe(VIT_BATCH, VIT_BATCH // n, 1, epochs, lambda s: VIT_LR, adamw)
    r = large_batch.train(vit, rgb(train_set), rgb(test_set), recipe, device=dev)
    return {"accuracy": r["epochs"][-1]["test accuracy"],
            "seconds": sum(e["seconds"] for e in r["epochs"]),
            "epoch seconds": [e["seconds"] for e in r["epochs"]]}  # fmt: skip


def gpus() -> int:
    """The GPUs this node has (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def backends(world_size: int, train_set, test_set, epochs: int) -> dict | None:
    """{backend: vit_run's result} for gloo and NCCL on ``world_size`` ranks, when this node has
    a GPU for each rank; None where NCCL cannot run (it needs CUDA tensors, one GPU per rank)."""
    if gpus() < world_size:
        return None
    return {name: launch(vit_run, train_set, test_set, epochs, world_size=world_size,
                         backend=name, output="none")[0] for name in ("gloo", "nccl")}  # fmt: skip


# -- part 5: the papermill sweep ---------------------------------------------------------------


def sweep(model: str, batches, world_size: int, folder=SWEEP_DIR, **point) -> tuple[list, list]:
    """``model_zoo.POINT`` executed by papermill at each per-rank batch x world size (1 and
    ``world_size``), each in a fresh kernel, writing its JSON into ``folder``; (the JSON files
    written, the points that failed, one line each). ``point``: image, steps, warmup, backend."""
    import papermill as pm

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    grid = [{"model": model, "world_size": n, "batch": b, **point}
            for b in batches for n in (1, world_size)]  # fmt: skip
    results, failed = [], []
    for p in grid:
        name = f"{p['model']}-n{p['world_size']}-b{p['batch']}"
        out = (folder / f"{name}.json").resolve()
        out.unlink(missing_ok=True)  # a stale file from an earlier sweep is not a result
        try:
            pm.execute_notebook(model_zoo.POINT, folder / f"{name}.ipynb",
                                kernel_name="multigpu-course", parameters={**p, "out": str(out)},
                                progress_bar=False,
                                extra_arguments=["--IPKernelApp.log_level=CRITICAL"])  # fmt: skip
            results.append(out)
        except Exception as exc:  # one failed point loses that point, not the sweep
            first = str(exc).splitlines()[0] if str(exc) else ""
            failed.append(f"{name}: {type(exc).__name__}: {first}")
    print(f"{len(results)} of {len(grid)} runs; executed notebooks and results in {folder}/")
    for f in failed:
        print("failed:", f)
    return results, failed
