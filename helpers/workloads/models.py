"""Models for the labs: small enough for a laptop CPU by default, torchvision's when asked."""

from __future__ import annotations

from torch import nn


def mlp(in_shape=(1, 8, 8), hidden: int = 128, depth: int = 2, classes: int = 10):
    """A multilayer perceptron: ``depth`` hidden layers of width ``hidden``."""
    import math

    layers, width = [nn.Flatten()], math.prod(in_shape)
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def cnn(in_shape=(1, 8, 8), channels: int = 32, classes: int = 10):
    """Two 3×3 convolutions and a linear head; works for 8×8, 28×28 and 32×32 inputs."""
    return nn.Sequential(
        nn.Conv2d(in_shape[0], channels, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),  # (B, channels * 16)
        nn.Linear(channels * 16, classes),
    )


def coordinate_mlp(in_features: int, depth: int = 4, width: int = 128, out_features: int = 3):
    """Lab 03's deep & wide model: pixel coordinates in, colour out; ``depth`` ReLU layers of
    ``width``. Every parameter is a Linear's, so FSDP can shard it layer by layer."""
    layers, d = [], in_features
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    layers.append(nn.Linear(d, out_features))
    return nn.Sequential(*layers)


def build(name: str = "mlp", in_shape=(1, 8, 8), classes: int = 10, **kwargs):
    """'mlp', 'cnn', or a torchvision classifier by name ('resnet18', 'vgg16', ...), untrained."""
    if name == "mlp":
        return mlp(in_shape, classes=classes, **kwargs)
    if name == "cnn":
        return cnn(in_shape, classes=classes, **kwargs)
    import torchvision  # slow to import; only the torchvision models need it (CONTRIBUTING)

    if not hasattr(torchvision.models, name):
        raise ValueError(f"unknown model {name!r}: use 'mlp', 'cnn' or a torchvision model name")
    model = getattr(torchvision.models, name)(weights=None, num_classes=classes)
    if in_shape[0] != 3:
        raise ValueError(f"{name} expects 3-channel images; dataset gives {in_shape[0]} channel(s)")
    return model


def n_params(model, trainable: bool = True) -> int:
    """Number of (trainable) parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)
