"""helpers.labs.lab04: the one-process step and the dense MLP its checks compare a student's
ranks against are what real ranks compute (the lecture's engine and tensor-parallel MLP), and
the hidden cases it draws cover the boundaries its docstrings name, anew for every seed."""

from __future__ import annotations

import pytest
import torch

import helpers
from helpers.labs import lab04
from helpers.parallel import pipeline as pp
from helpers.parallel import tensor_parallel as tp

SEEDS = range(50)


def _pipelined(kind, p, m, n, width, depth, seed):
    """One step of ``helpers.pipeline.run`` on this rank, on the case's model and data."""
    import torch.distributed as dist

    rank = dist.get_rank()
    stage = pp.split(lab04.engine_model(depth, width, seed), p)[rank]
    x, y = lab04.engine_batch(n, width, seed)
    xs, ys = list(x.chunk(m)), list(y.chunk(m))
    order = pp.SCHEDULES[kind](p, m, rank)
    out = pp.run(stage, order, xs, ys, torch.nn.functional.mse_loss, shape=xs[0].shape)
    return {"loss": out["loss"], "grads": [q.grad.clone() for q in stage.parameters()]}


@pytest.mark.parametrize("case", [("1f1b", 3, 2, 4, 5, 4, 11), ("gpipe", 1, 3, 6, 3, 2, 12)])
def test_the_one_process_step_is_what_a_pipeline_of_real_ranks_computes(case):
    kind, p, m, n, width, depth, seed = case
    want_loss, want = lab04.one_process_step(n, width, depth, seed)
    runs = helpers.launch(_pipelined, *case, world_size=p, backend="gloo", output="none")
    assert runs[-1]["loss"] == pytest.approx(want_loss, rel=1e-5)
    got = [g for r in runs for g in r["grads"]]
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _sharded(d, h, n_samples, seed):
    """The lecture's tensor-parallel MLP on this rank's shard of the case's dense MLP."""
    import torch.distributed as dist

    dense, x = lab04.tp_case(d, h, n_samples, seed)
    part = tp.shard(dense, dist.get_rank(), dist.get_world_size())
    out = part(x)
    lab04.tp_loss(out).backward()
    return {"out": out.detach(), "x": x.grad, "w1": part.column.weight.grad}


def test_the_dense_step_is_what_a_tensor_parallel_mlp_on_real_ranks_computes():
    n, d, h, n_samples, seed = 3, 2, 6, 1, 5
    dense, x, out = lab04.dense_step(d, h, n_samples, seed)
    runs = helpers.launch(_sharded, d, h, n_samples, seed, world_size=n, output="none")
    for rank, r in enumerate(runs):
        part = slice(rank * h // n, (rank + 1) * h // n)
        torch.testing.assert_close(r["out"], out)
        torch.testing.assert_close(r["x"], x.grad)
        torch.testing.assert_close(r["w1"], dense[0].weight.grad[part])


def test_the_tp_loss_weights_every_output_element_differently():
    out = torch.ones(3, 4, requires_grad=True)
    lab04.tp_loss(out).backward()
    assert len(set(out.grad.flatten().tolist())) == 12


def test_the_engine_cases_cover_one_stage_fewer_micro_batches_than_stages_and_more():
    every = [c for s in SEEDS for c in lab04.engine_cases(s)]
    for kind, p, m, n, width, depth, seed in every:
        assert kind in lab04.KINDS and 1 <= p <= 4 and 1 <= width <= 8 and n % m == 0
        assert depth >= p, "every stage holds a Linear: its first parameter is hooked"
        assert all(
            list(stage.parameters())
            for stage in pp.split(lab04.engine_model(depth, width, seed), p)
        )
    for s in SEEDS:
        single, fewer, more = lab04.engine_cases(s)
        assert single[1] == 1 and fewer[0] == "1f1b" and fewer[2] < fewer[1] and more[2] >= more[1]
    assert {c[1] for c in every} == {1, 2, 3, 4}
    assert {c[2] for c in every if c[0] == "1f1b" and c[1] > 1} >= {1, 2, 3}  # m = 1 with p > 1
    assert {c[3] // c[2] for c in every} == {1, 2, 3}  # micro-batches of 1 to 3 samples
    assert {c[5] - c[1] for c in every} == {0, 1, 2, 3}  # stages of equal and unequal length


def test_the_tp_cases_run_on_3_and_4_ranks_with_every_size_from_one():
    every = [c for s in SEEDS for c in lab04.tp_cases(s)]
    assert {c[0] for c in every} == {3, 4}
    assert all(h % n == 0 for n, _, h, _, _ in every)
    assert {d for _, d, _, _, _ in every} == set(range(1, 9))
    assert {ns for _, _, _, ns, _ in every} == set(range(1, 9))
    assert {h // n for n, _, h, _, _ in every} == {1, 2, 3}


def test_the_schedule_and_bubble_shapes_sweep_both_sides_of_m_equals_p():
    shapes = [c for s in SEEDS for c in lab04.schedule_shapes(s)]
    assert any(m < p for p, m in shapes) and any(m == p for p, m in shapes)
    assert any(m > 2 * p for p, m in shapes) and {p for p, _ in shapes} == set(range(1, 7))
    assert {p for s in SEEDS for p, _ in lab04.bubble_shapes(s)} == set(range(1, 9))


@pytest.mark.parametrize(
    "draw",
    [
        lab04.engine_cases,
        lab04.tp_cases,
        lab04.schedule_shapes,
        lab04.bubble_shapes,
        lab04.bubble_steps,
    ],
)
def test_the_cases_are_the_seeds_own(draw):
    """The same seed draws the same cases (the probe and the check agree); another seed draws
    others (a table of one run's answers fails the next)."""
    assert draw(3) == draw(3)
    assert draw(3) != draw(4)
