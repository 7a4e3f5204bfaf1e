"""helpers.large_batch: a global batch on n ranks × k micro-batches is one process's step on it."""

from __future__ import annotations

import math

import pytest
import torch

import helpers
from helpers.optimisation import large_batch as lb


def _data(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = torch.randint(10, (n,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def _build():
    return helpers.models.mlp(hidden=16, depth=2)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _run(global_batch, micro, k, epochs=2, record=False):
    """train() on this world; with ``record``, the gradient bytes DDP all-reduced in all."""
    recorder = helpers.CommRecorder() if record else None
    data = _data()
    recipe = lb.Recipe(global_batch, micro, k, epochs, lambda s: 0.1 / (1 + s), _sgd, seed=3)
    r = lb.train(_build, data, data, recipe, on_model=recorder.register if recorder else None)
    if recorder:
        recorder.close()
        r["grad_bytes"] = sum(x["grad_bytes"] for x in recorder.records)
    return r


def test_the_epoch_is_a_seeded_permutation_cut_into_whole_batches():
    batches = lb.epoch_batches(10, 3, epoch=0, seed=0)
    assert [len(b) for b in batches] == [3, 3, 3]  # the last, partial batch dropped
    assert len(set(torch.cat(batches).tolist())) == 9
    assert all(
        torch.equal(a, b) for a, b in zip(batches, lb.epoch_batches(10, 3, 0, 0), strict=True)
    )
    assert not all(
        torch.equal(a, b) for a, b in zip(batches, lb.epoch_batches(10, 3, 1, 0), strict=True)
    )
    with pytest.raises(ValueError, match="needs between 1 and 10 samples"):
        lb.epoch_batches(10, 11, 0, 0)


def test_micro_batches_are_the_ranks_contiguous_shares_and_a_bad_plan_is_refused():
    batch = torch.arange(12)
    assert [m.tolist() for m in lb.my_micro_batches(batch, 3, 2, rank=1, world_size=2)] == [
        [6, 7, 8],
        [9, 10, 11],
    ]
    with pytest.raises(ValueError, match="plan them again"):
        lb.my_micro_batches(batch, 4, 2, rank=0, world_size=2)


@pytest.mark.parametrize("world_size,micro,k", [(2, 12, 1), (2, 3, 4), (3, 4, 2)])
def test_ranks_times_accumulation_equal_one_process_on_the_global_batch(world_size, micro, k):
    global_batch = world_size * micro * k
    one = _run(global_batch, global_batch, 1)
    runs = helpers.launch(
        _run,
        global_batch,
        micro,
        k,
        record=True,
        world_size=world_size,
        backend="gloo",
        output="none",
    )
    for r in runs:
        assert r["steps"] == one["steps"] == 2 * (96 // global_batch)
        for name, p in one["state"].items():
            torch.testing.assert_close(r["state"][name], p, rtol=1e-5, atol=1e-6)
        # the loss of each step is the loss of the whole global batch, as in one process
        assert r["losses"] == pytest.approx(one["losses"], rel=1e-5)
        assert [e["test accuracy"] for e in r["epochs"]] == [
            e["test accuracy"] for e in one["epochs"]
        ]
        # one all-reduce of the whole gradient per step, whatever k
        assert r["grad_bytes"] == r["steps"] * helpers.comm.gradient_bytes(_build())


def test_a_diverging_run_stops_and_says_so():
    data = _data()
    r = lb.train(_build, data, data, lb.Recipe(32, 32, 1, 5, lambda s: 1e30, _sgd))
    assert r["diverged"]
    assert len(r["epochs"]) == 1 and r["steps"] == 3  # stopped at the end of the first epoch
    assert not math.isfinite(r["epochs"][-1]["train loss"])


def _diverge():
    data = _data()
    return lb.train(_build, data, data, lb.Recipe(32, 16, 1, 5, lambda s: 1e30, _sgd))["diverged"]


def test_ranks_that_diverge_stop_together_instead_of_hanging():
    assert helpers.launch(_diverge, world_size=2, backend="gloo", output="none", timeout=60) == [
        True,
        True,
    ]


def test_the_timed_epoch_takes_the_slowest_rank():
    data = _data(64)
    seconds = helpers.launch(
        lb.epoch_seconds, _build, data, 32, 8, 2, world_size=2, backend="gloo", output="none"
    )
    assert seconds[0] == seconds[1] > 0
