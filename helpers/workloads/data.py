"""Datasets that work offline. The default is real: scikit-learn's bundled handwritten digits.

``load("digits")`` needs no file and no network (1,797 8×8 images, 10 classes). CIFAR-10 and
MNIST are read from their usual files when you have them (nothing is ever downloaded):
CIFAR-10 from the python batches (``cifar-10-batches-py/data_batch_1`` ... ``test_batch``),
MNIST from the idx files (``train-images-idx3-ubyte`` ... , optionally gzipped).
Every loader returns a TensorDataset of (float32 images, int64 labels).
"""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import torch

DATASETS = ("digits", "digits-shifted", "cifar10", "mnist")


def digits(train: bool = True, test_fraction: float = 0.2, seed: int = 0):
    """scikit-learn's digits as (N, 1, 8, 8) images scaled to [0, 1]; a fixed train/test split."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(len(y) * (1 - test_fraction))
    idx = order[:cut] if train else order[cut:]
    return torch.utils.data.TensorDataset(x[idx], y[idx])


def shifted(dataset, pixels: int = 1):
    """Each image and its copies moved by up to ``pixels`` in x and y (zeros fill the border).

    With pixels=1 that is 9 copies of every image: real handwriting, 9× the samples, for runs
    whose global batch (4 ranks × 512) is larger than the 1,437 digits of the training split.
    Every copy of an image stays in the split the image is in, so train and test never mix.
    """
    x, y = dataset.tensors
    copies = []
    for dy in range(-pixels, pixels + 1):
        for dx in range(-pixels, pixels + 1):
            moved = torch.zeros_like(x)
            h, w = x.shape[-2:]
            moved[..., max(dy, 0) : h + min(dy, 0), max(dx, 0) : w + min(dx, 0)] = x[
                ..., max(-dy, 0) : h + min(-dy, 0), max(-dx, 0) : w + min(-dx, 0)
            ]
            copies.append(moved)
    return torch.utils.data.TensorDataset(torch.cat(copies), y.repeat(len(copies)))


def cifar10(root, train: bool = True):
    """CIFAR-10 from the python batches in ``root`` (or root/cifar-10-batches-py): (N, 3, 32, 32)."""
    import numpy as np

    root = Path(root)
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
    missing = [n for n in names if not (root / n).exists()]
    if missing:
        raise FileNotFoundError(
            f"CIFAR-10 files {', '.join(missing)} are not in {root}. Put the extracted "
            "cifar-10-batches-py folder there (nothing is downloaded), or use dataset='digits'."
        )
    xs, ys = [], []
    for name in names:
        with open(root / name, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        xs.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        ys.extend(batch[b"labels"])
    x = torch.from_numpy(np.concatenate(xs)).float() / 255.0
    return torch.utils.data.TensorDataset(x, torch.tensor(ys, dtype=torch.int64))


def _idx(path: Path):
    import numpy as np

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        zero, dtype, ndim = struct.unpack(">HBB", f.read(4))
        if zero != 0 or dtype != 0x08:
            raise ValueError(f"{path} is not an idx file of unsigned bytes")
        shape = struct.unpack(">" + "I" * ndim, f.read(4 * ndim))
        return np.frombuffer(f.read(), dtype=np.uint8).reshape(shape)


def mnist(root, train: bool = True):
    """MNIST from the idx files in ``root`` (plain or .gz): (N, 1, 28, 28)."""
    root = Path(root)
    prefix = "train" if train else "t10k"
    found = {}
    for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
        for name in (f"{prefix}-{kind}", f"{prefix}-{kind}.gz"):
            if (root / name).exists():
                found[kind] = root / name
        if kind not in found:
            raise FileNotFoundError(
                f"MNIST file {prefix}-{kind}[.gz] is not in {root} (nothing is downloaded)."
            )
    images = torch.from_numpy(_idx(found["images-idx3-ubyte"]).copy()).float().unsqueeze(1) / 255.0
    labels = torch.from_numpy(_idx(found["labels-idx1-ubyte"]).copy()).long()
    if len(images) != len(labels):
        raise ValueError(f"MNIST in {root}: {len(images)} images but {len(labels)} labels")
    return torch.utils.data.TensorDataset(images, labels)


def load(name: str = "digits", root=None, train: bool = True):
    """One entry point for the labs' ``dataset`` parameter."""
    if name == "digits":
        return digits(train)
    if name == "digits-shifted":
        return shifted(digits(train))
    if name in ("cifar10", "mnist"):
        if root is None:
            raise ValueError(
                f"dataset={name!r} needs data_root=<folder with its files>; 'digits' needs none"
            )
        return cifar10(root, train) if name == "cifar10" else mnist(root, train)
    raise ValueError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}")


SAMPLE_IMAGES = ("china.jpg", "flower.jpg")  # scikit-learn ships these two photographs


def image(name: str = "china.jpg", size=(24, 36), frequencies: int = 6):
    """A photograph as a regression task for a coordinate network (lab 03's deep & wide model).

    Returns (inputs, pixels, (h, w)): ``pixels`` (h·w, 3) RGB in [0, 1], row by row, from
    scikit-learn's bundled sample image ``name`` averaged down to ``size``; ``inputs`` (h·w, F)
    the pixel's coordinates (x, y) in [-1, 1] with sin and cos of them at ``frequencies``
    octaves (F = 2 + 4·frequencies): without those Fourier features a ReLU network fits only a
    blur of the image (Tancik et al. 2020). Offline: the file is inside scikit-learn.
    """
    import math

    from sklearn.datasets import load_sample_image

    if name not in SAMPLE_IMAGES:
        raise ValueError(f"image {name!r}: scikit-learn ships {', '.join(SAMPLE_IMAGES)}")
    h, w = (int(s) for s in size)
    if h < 1 or w < 1:
        raise ValueError(f"size must be two positive numbers (height, width), not {size!r}")
    photo = torch.tensor(load_sample_image(name), dtype=torch.float32) / 255.0  # (427, 640, 3)
    small = torch.nn.functional.interpolate(photo.permute(2, 0, 1)[None], size=(h, w), mode="area")
    pixels = small[0].permute(1, 2, 0).reshape(h * w, 3).contiguous()  # (h·w, 3)
    ys, xs = torch.meshgrid(torch.linspace(-1, 1, h), torch.linspace(-1, 1, w), indexing="ij")
    xy = torch.stack([xs, ys], dim=-1).reshape(h * w, 2)
    features = [xy]
    for k in range(frequencies):
        features += [torch.sin(2**k * math.pi * xy), torch.cos(2**k * math.pi * xy)]
    return torch.cat(features, dim=1), pixels, (h, w)
