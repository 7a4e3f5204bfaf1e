"""helpers.labs.lab05_runs: the runs of lab 05 use the student's functions as the lab says, on
real ranks, at small sizes: part 1's first steps agree across one process and ranks, the timed
epochs come back per micro-batch and repeat, and a sweep trains every (method, batch, seed) with
the student's plan and schedules."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import TensorDataset

from helpers.labs import lab05_runs
from helpers.launcher.launch import launch
from helpers.measure.comm import gradient_bytes
from helpers.workloads import data


def small_lab(**changes) -> lab05_runs.Lab:
    """The lab's setting on 192 training and 64 test digits: every run takes a moment."""
    train, test = data.load("digits"), data.load("digits", train=False)
    settings = dict(train_set=TensorDataset(*(t[:192] for t in train.tensors)),
                    test_set=TensorDataset(*(t[:64] for t in test.tensors)), hidden=16, depth=1,
                    epochs=2, max_micro=16, seeds=(0, 1), world_size=2, backend="gloo", base_lr=0.05,
                    base_batch=16, warmup_epochs=1, lars_lr=0.5, trust=0.02)  # fmt: skip
    return lab05_runs.Lab(**{**settings, **changes})


class Calls:
    """A student's function that records how it was called, and answers with ``answer``."""

    def __init__(self, answer):
        self.answer, self.calls = answer, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.answer(*args, **kwargs) if callable(self.answer) else self.answer


def test_the_lab_loads_its_data_builds_its_mlp_and_says_so():
    lab = lab05_runs.Lab.load("digits", None, hidden=16, depth=1, epochs=1, max_micro=8, seeds=[0],
                              world_size=1, backend="gloo", base_lr=0.1, base_batch=8,
                              warmup_epochs=0, lars_lr=0.5, trust=0.02)  # fmt: skip
    assert lab.seeds == (0,) and lab.n_train == len(data.load("digits"))
    assert lab.build()(lab.train_set.tensors[0][:3]).shape == (3, 10)
    opt = lab.sgd(lab.build().parameters())
    assert opt.defaults["lr"] == 0.1 and opt.defaults["momentum"] == 0.9
    text = lab.describe("digits", [8, 64])
    assert f"{lab.n_train:,} training" in text and f"64 -> {lab.n_train // 64}" in text


def test_each_method_uses_the_students_functions_as_the_lab_says():
    lab = small_lab()
    scaled, warm = Calls(lambda lr, base, b: lr * b / base), Calls(0.0123)
    lars = Calls(lambda params, **kw: torch.optim.SGD(params, lr=kw["lr"]))
    lr, opt = lab05_runs.schedule(lab, "fixed lr", 64)
    assert lr(0) == lr(99) == lab.base_lr and opt == lab.sgd and not scaled.calls
    lr, _ = lab05_runs.schedule(lab, "scaled lr", 64, scaled, warm, lars)
    assert lr(0) == lr(7) == pytest.approx(0.2) and scaled.calls[-1][0] == (0.05, 16, 64)
    lr, _ = lab05_runs.schedule(lab, "scaled + warmup", 64, scaled, warm, lars)
    assert lr(5) == 0.0123 and warm.calls[-1][0] == (5, 0.05, pytest.approx(0.2), 192 // 64)
    lr, make = lab05_runs.schedule(lab, "LARS + warmup", 64, scaled, warm, lars)
    assert lr(2) == 0.0123 and warm.calls[-1][0] == (2, 0.05, 0.5, 192 // 64)
    make([torch.nn.Parameter(torch.ones(2))])
    assert lars.calls[-1][1] == {"lr": 0.5, "momentum": 0.9, "trust": 0.02}
    with pytest.raises(ValueError, match="unknown method"):
        lab05_runs.schedule(lab, "Adam", 64, scaled, warm, lars)


def test_the_first_steps_agree_on_one_process_and_on_ranks_with_one_all_reduce_a_step():
    lab = small_lab()
    one = lab05_runs.first_steps(lab, 32, 32, 1)
    assert one["bytes/step"] == 0
    for micro, k in [(16, 1), (4, 4)]:
        r = launch(lab05_runs.first_steps, lab, 32, micro, k, world_size=2, backend="gloo",
                   output="none")[0]  # fmt: skip
        assert r["bytes/step"] == gradient_bytes(lab.build())
        for name, p in one["state"].items():
            torch.testing.assert_close(r["state"][name], p, rtol=0, atol=1e-5)


def test_an_epoch_is_timed_per_micro_batch_and_repeat():
    times = lab05_runs.micro_timings(small_lab(), 64, [32, 8], 2)
    assert list(times) == [32, 8]
    assert all(len(t) == 2 and all(0 < s < 60 for s in t) for t in times.values())


def test_a_sweep_trains_every_method_batch_and_seed_through_the_students_code():
    lab = small_lab()

    def plan(batch, world_size, max_micro):  # not the fewest micro-batches: the sweep must use it
        return batch // world_size // 2, 2

    def warm(step, base, peak, steps):  # a warmup no rule would give: the sweep must use it
        return 0.0123 if step < steps else peak

    rows = lab05_runs.sweep(lab, ["fixed lr", "scaled + warmup"], [16, 64], plan,
                            lambda lr, base, b: lr * b / base, warm)  # fmt: skip
    assert [(r["method"], r["global batch"], r["seed"]) for r in rows] == [
        (m, b, s) for s in (0, 1) for m in ("fixed lr", "scaled + warmup") for b in (16, 64)
    ]
    for r in rows:
        assert r["micro x k"] == f"{r['global batch'] // 4} x 2"
        assert r["steps"] == lab.epochs * (192 // r["global batch"]) == len(r["losses"])
        assert [e["epoch"] for e in r["curve"]] == [1, 2]
        assert 0 <= r["test accuracy"] <= 1 and r["failed"] == (not r["train loss"] < math.log(10))
    warmed = [r for r in rows if r["method"] == "scaled + warmup" and r["global batch"] == 64]
    # epoch 1 is the warmup (3 steps of 0.0123); epoch 2 at the peak, the rule's 0.05 * 64 / 16
    assert [[e["lr"] for e in r["curve"]] for r in warmed] == [[0.0123, pytest.approx(0.2)]] * 2
    fixed = [r for r in rows if r["method"] == "fixed lr"]
    assert all(e["lr"] == lab.base_lr for r in fixed for e in r["curve"])
    assert lab05_runs.same_at_base(rows, 16, ("scaled lr",)) == [
        dict(r, method="scaled lr") for r in rows if r["global batch"] == 16
    ]
