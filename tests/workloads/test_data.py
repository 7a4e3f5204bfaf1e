"""Offline data (digits, and CIFAR-10 / MNIST from tiny files made here), models, ring steps."""

from __future__ import annotations

import gzip
import pickle
import struct

import numpy as np
import pytest
import torch

import helpers
from helpers.parallel import ring
from helpers.workloads import data, models


def test_digits_is_real_offline_and_split_without_overlap():
    train, test = data.load("digits"), data.load("digits", train=False)
    assert len(train) + len(test) == 1797
    x, y = train.tensors
    assert (
        x.shape[1:] == (1, 8, 8)
        and 0 <= x.min()
        and x.max() <= 1
        and set(y.tolist()) == set(range(10))
    )
    joined = torch.cat([train.tensors[0], test.tensors[0]]).flatten(1)
    assert len(torch.unique(joined, dim=0)) > 1700  # no sample repeated across the split


def test_cifar10_reader_on_tiny_batches(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name, n in [*[(f"data_batch_{i}", 3) for i in range(1, 6)], ("test_batch", 2)]:
        batch = {
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"labels": list(range(n)),
        }
        (folder / name).write_bytes(pickle.dumps(batch))
    train = data.load("cifar10", tmp_path)
    assert len(train) == 15 and train.tensors[0].shape == (15, 3, 32, 32)
    first = pickle.loads((folder / "data_batch_1").read_bytes())[b"data"][0]
    torch.testing.assert_close(
        train.tensors[0][0], torch.tensor(first.reshape(3, 32, 32), dtype=torch.float32) / 255
    )
    assert len(data.cifar10(folder, train=False)) == 2
    (folder / "test_batch").unlink()
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        data.cifar10(folder, train=False)


def idx(path, array, gz=False):
    header = struct.pack(">HBB", 0, 8, array.ndim) + struct.pack(
        ">" + "I" * array.ndim, *array.shape
    )
    raw = header + array.astype(np.uint8).tobytes()
    (gzip.open if gz else open)(path, "wb").write(raw)


def test_mnist_reader_on_tiny_idx_files(tmp_path):
    images = np.arange(4 * 28 * 28).reshape(4, 28, 28) % 256
    idx(tmp_path / "train-images-idx3-ubyte.gz", images, gz=True)
    idx(tmp_path / "train-labels-idx1-ubyte", np.array([3, 1, 4, 1]))
    ds = data.load("mnist", tmp_path)
    assert ds.tensors[0].shape == (4, 1, 28, 28) and ds.tensors[1].tolist() == [3, 1, 4, 1]
    assert ds.tensors[0][1, 0, 0, 0].item() == pytest.approx(((28 * 28) % 256) / 255)
    with pytest.raises(FileNotFoundError, match="t10k-images"):
        data.load("mnist", tmp_path, train=False)


def test_bad_dataset_names_and_missing_roots_are_explained():
    with pytest.raises(ValueError, match="unknown dataset 'imagenet'"):
        data.load("imagenet")
    with pytest.raises(ValueError, match="needs data_root"):
        data.load("cifar10")


@pytest.mark.parametrize(
    "name, shape", [("mlp", (1, 8, 8)), ("cnn", (1, 28, 28)), ("resnet18", (3, 32, 32))]
)
def test_models_take_their_inputs(name, shape):
    model = models.build(name, in_shape=shape)
    assert model(torch.zeros(2, *shape)).shape == (2, 10)
    assert models.n_params(models.mlp((1, 8, 8), hidden=10, depth=1)) == 64 * 10 + 10 + 10 * 10 + 10


def test_torchvision_model_on_one_channel_is_refused():
    with pytest.raises(ValueError, match="3-channel"):
        models.build("resnet18", in_shape=(1, 8, 8))


@pytest.mark.parametrize("n", [2, 3, 5])
def test_ring_simulation_ends_with_every_chunk_summed_everywhere(n):
    states = ring.steps(n)
    assert len(states) == 1 + 2 * (n - 1)
    after_rs = states[n - 1]["held"]
    for r in range(n):  # after reduce-scatter rank r owns the full sum of chunk r+1
        assert after_rs[r][(r + 1) % n] == list(range(n))
    assert all(chunk == list(range(n)) for row in states[-1]["held"] for chunk in row)
    sends = sum(len(s["sends"]) for s in states) / n  # chunks sent per rank
    assert (
        sends * (4096 / n)
        == ring.bytes_sent_per_rank(4096, n)
        == helpers.bandwidth.ring_allreduce_wire_bytes(4096, n)
    )


def test_model_state_bytes():
    assert helpers.memory.model_state_bytes(1e9) == 16e9
    assert helpers.memory.model_state_bytes(10, "fp32-sgd") == 80


def test_a_sample_image_is_real_offline_and_encoded_as_coordinates():
    from sklearn.datasets import load_sample_image

    photo = torch.tensor(load_sample_image("china.jpg"), dtype=torch.float32) / 255.0
    inputs, pixels, (h, w) = data.image("china.jpg", size=photo.shape[:2], frequencies=2)
    assert (
        (h, w) == (427, 640) and pixels.shape == (h * w, 3) and inputs.shape == (h * w, 2 + 4 * 2)
    )
    assert torch.equal(pixels, photo.reshape(-1, 3))  # at its own size: the photograph itself
    inputs, pixels, (h, w) = data.image("flower.jpg", size=(24, 36))
    assert pixels.shape == (864, 3) and 0 <= pixels.min() and pixels.max() <= 1
    # pixel k is row k // w, column k % w: x runs along a row, y down the columns, both in [-1, 1]
    assert inputs[0, :2].tolist() == [-1.0, -1.0] and inputs[w - 1, :2].tolist() == [1.0, -1.0]
    assert inputs[-1, :2].tolist() == [1.0, 1.0]
    torch.testing.assert_close(inputs[:, 2], torch.sin(torch.pi * inputs[:, 0]))
    assert torch.equal(data.image("flower.jpg", size=(24, 36))[1], pixels)  # deterministic
    with pytest.raises(ValueError, match="scikit-learn ships"):
        data.image("lena.png")
    with pytest.raises(ValueError, match="positive"):
        data.image(size=(0, 5))


def test_the_coordinate_network_is_depth_layers_of_width():
    net = models.coordinate_mlp(26, depth=3, width=16)
    linear = [m for m in net if isinstance(m, torch.nn.Linear)]
    assert [tuple(m.weight.shape) for m in linear] == [(16, 26), (16, 16), (16, 16), (3, 16)]
    assert models.n_params(net) == 26 * 16 + 16 + 2 * (16 * 16 + 16) + 16 * 3 + 3
    assert net(torch.zeros(5, 26)).shape == (5, 3)
