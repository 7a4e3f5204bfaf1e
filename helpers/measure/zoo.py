"""The model zoo of a benchmark study (lab 06): torchvision's classifiers, untrained, timed per step.

    rows = helpers.launch(zoo.profile, "resnet18", image=64, batch=4, steps=3, warmup=2,
                          world_size=2)          # each rank's StepTimer records and its bytes

The Princeton benchmark of this course's seeds timed ResNet18, VGG16, SqueezeNet, DenseNet121 and
AlexNet under data parallelism. Their parameter counts span 0.7 M to 134 M, so the gradient a
step all-reduces spans 3 MB to 537 MB while the compute per image does not follow: the share of
a step spent communicating is a property of the model, not only of the network. No weights are
downloaded (``weights=None``); a smaller image keeps the compute small on a CPU, and leaves the
parameter count (and the bytes) exactly those of the real model.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

# A parameterised notebook that times one model on one world and writes a JSON file: one point
# of a papermill sweep (lab 06).
POINT = Path(__file__).parent / "notebooks" / "step_benchmark.ipynb"
ZOO = ("squeezenet1_0", "densenet121", "resnet18", "alexnet", "vgg16")
MIN_IMAGE = {"alexnet": 63}  # AlexNet's three max-pools need at least 63 x 63 pixels


def build(name: str, image: int = 64, classes: int = 10):
    """An untrained torchvision classifier for 3 x image x image inputs (no download)."""
    if image < MIN_IMAGE.get(name, 32):
        raise ValueError(
            f"{name} needs images of at least {MIN_IMAGE.get(name, 32)} pixels, not {image}: "
            "raise image"
        )
    from helpers.workloads import models

    return models.build(name, in_shape=(3, image, image), classes=classes)


def profile(name: str, image: int = 64, batch: int = 4, steps: int = 3, warmup: int = 2) -> dict:
    """Train ``name`` for ``warmup + steps`` steps of ``batch`` random images per rank.

    One rank: the plain model, nothing communicated (the baseline). Several: DDP, with every
    bucket's all-reduce recorded. On a GPU node each rank computes on its own GPU (CUDA-event
    timing). Returns this rank's StepTimer records (warm-up steps first: DDP rebuilds its
    buckets in step 2), the parameter count and the gradient bytes DDP all-reduced per step.
    """
    from helpers.launcher.world import device
    from helpers.measure.comm import CommRecorder
    from helpers.measure.timing import StepTimer

    n = dist.get_world_size() if dist.is_initialized() else 1
    dev = device()
    torch.manual_seed(0)
    model = build(name, image).to(dev)
    recorder = None
    if n > 1:
        model = DDP(model)
        recorder = CommRecorder().register(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(dist.get_rank() if n > 1 else 0)
    timer = StepTimer(dev, comm=recorder)
    for _ in range(warmup + steps):
        x = torch.randn(batch, 3, image, image, generator=gen).to(dev)
        y = torch.randint(10, (batch,), generator=gen).to(dev)
        timer.start()
        loss = nn.functional.cross_entropy(model(x), y)
        timer.mark("forward")
        opt.zero_grad()
        loss.backward()
        timer.mark("backward")
        opt.step()
        timer.mark("optimizer")
        timer.stop()
    if recorder is not None:
        recorder.close()
    per_step = [s["grad_bytes"] for s in recorder.per_step()] if recorder else []
    module = model.module if n > 1 else model
    return {
        "records": [
            {k: v for k, v in r.items() if k not in ("spans", "buckets")} for r in timer.records
        ],
        "params": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "bytes/step": per_step,
    }
