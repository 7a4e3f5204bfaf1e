"""helpers.pipeline and helpers.tensor_parallel: schedules against theory, live runs against a
one-process reference, the measured bubble against (p−1)/(m+p−1) on stages of known cost."""

from __future__ import annotations

import pytest
import torch

import helpers
from helpers.parallel import pipeline as pp
from helpers.parallel import tensor_parallel as tp


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (2, 4), (3, 5), (4, 8), (4, 2)])
def test_the_simulated_bubble_is_the_formula(kind, p, m):
    for (
        fwd,
        bwd,
    ) in [(1.0, 1.0), (1.0, 2.0)]:
        events = pp.simulate(pp.orders(kind, p, m), fwd, bwd)
        assert pp.bubble(events) == pytest.approx(pp.bubble_fraction(p, m), abs=1e-12)
        assert max(e["end"] for e in events) == pytest.approx((m + p - 1) * (fwd + bwd))


def test_1f1b_holds_fewer_micro_batches_than_gpipe():
    p, m = 4, 8
    assert [pp.in_flight(o) for o in pp.orders("gpipe", p, m)] == [8, 8, 8, 8]
    assert [pp.in_flight(o) for o in pp.orders("1f1b", p, m)] == [4, 3, 2, 1]
    assert pp.one_f_one_b(2, 3, 0) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert pp.one_f_one_b(2, 3, 1) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]


def test_bad_schedules_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="before its forward"):
        pp.simulate([[("B", 0), ("F", 0)]])
    with pytest.raises(ValueError, match="exactly one forward and one backward"):
        pp.simulate([[("F", 0), ("F", 1), ("B", 0)]])
    # stage 0 wants B0 (after stage 1's B0) before F1; stage 1 wants F1 (after stage 0's) first
    with pytest.raises(ValueError, match="deadlocks"):
        pp.simulate(
            [[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 0), ("F", 1), ("B", 0), ("B", 1)]]
        )
    with pytest.raises(ValueError, match="p ≥ 1"):
        pp.gpipe(0, 4, 0)
    with pytest.raises(ValueError, match="schedule must be one of"):
        pp.orders("zigzag", 2, 2)


def _timed_run(kind, m, fwd, bwd):
    import torch.distributed as dist

    p, rank = dist.get_world_size(), dist.get_rank()
    stage = pp.timed_stage(fwd, bwd, width=4)
    xs = [torch.ones(1, 4) for _ in range(m)] if rank == 0 else None
    ys = [torch.zeros(1, 4) for _ in range(m)] if rank == p - 1 else None
    loss = torch.nn.functional.mse_loss
    order = pp.SCHEDULES[kind](p, m, rank)
    pp.run(
        stage, order, xs, ys, loss, shape=(1, 4)
    )  # warm-up: gloo connects pairs, autograd starts
    dist.barrier()
    return pp.run(stage, order, xs, ys, loss, shape=(1, 4))


@pytest.mark.parametrize("p", [2, 4])
def test_the_measured_bubble_matches_theory_on_stages_of_known_cost(p):
    # Sleeping stages cost no core, so p=4 on 2 cores measures the schedule, not contention.
    # 60 ms forward, 120 ms backward: compute dominates the ~1 ms a send/recv hop costs, and
    # the goal (within 15 % of theory) holds with 0.01 more for that latency.
    # A descheduled rank only adds idle time, never removes it: on a loaded machine (the suite's
    # other workers, a hub's students beside them) runs overshoot by that alone, all of them
    # while the load lasts (CI-like load: 0.262 against 0.2 at 1F1B, p = 2, m = 4; 0.153 three
    # times against 0.111 at GPipe, p = 2, m = 8). So the least disturbed of up to five runs is
    # held to the goal: a schedule whose bubble is wrong (naive: (p-1)/p) misses it every time.
    def measure(kind, m):
        runs = helpers.launch(_timed_run, kind, m, 0.06, 0.12, world_size=p, output="none")
        return pp.bubble(pp.gather_events(runs))

    for kind in ("gpipe", "1f1b"):
        for m in (1, 4, 8):
            theory = pp.bubble_fraction(p, m)
            measured = [measure(kind, m)]
            while abs(min(measured) - theory) > 0.15 * theory + 0.01 and len(measured) < 5:
                measured.append(measure(kind, m))
            least = min(measured)
            assert abs(least - theory) <= 0.15 * theory + 0.01, (kind, p, m, measured, theory)


def _train_step(kind, p, m, seed=0):
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        *[layer for _ in range(4) for layer in (torch.nn.Linear(6, 6), torch.nn.Tanh())]
    )
    stage = pp.split(model, p)[rank]
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    xs, ys = list(x.chunk(m)), list(y.chunk(m))
    out = pp.run(
        stage,
        pp.SCHEDULES[kind](p, m, rank),
        xs,
        ys,
        torch.nn.functional.mse_loss,
        shape=xs[0].shape,
    )
    return {
        "loss": out["loss"],
        "grads": [q.grad.clone() for q in stage.parameters()],
        "sent": out["sent_bytes"],
    }


def _reference(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        *[layer for _ in range(4) for layer in (torch.nn.Linear(6, 6), torch.nn.Tanh())]
    )
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.item(), [q.grad for q in model.parameters()]


@pytest.mark.parametrize(
    "kind,p,m", [("gpipe", 2, 4), ("1f1b", 2, 4), ("1f1b", 4, 2), ("gpipe", 4, 8)]
)
def test_a_pipelined_step_equals_the_one_process_step(kind, p, m):
    loss, grads = _reference()
    runs = helpers.launch(_train_step, kind, p, m, world_size=p, output="none")
    assert runs[-1]["loss"] == pytest.approx(loss, rel=1e-5)
    got = [g for r in runs for g in r["grads"]]
    assert len(got) == len(grads)
    for a, b in zip(got, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Bytes: each inner boundary carries m activations forward and m gradients back.
    per_micro = (8 // m) * 6 * 4
    assert [r["sent"] for r in runs] == [per_micro * m * ((s < p - 1) + (s > 0)) for s in range(p)]


def _tp_step(d, h, batch):
    import torch.distributed as dist

    from helpers.launcher import watch

    rank, n = dist.get_rank(), dist.get_world_size()
    dense = tp.mlp(d, h)
    part = tp.shard(dense, rank, n)
    torch.manual_seed(1)
    x = torch.randn(batch, d, requires_grad=True)
    counted = []
    watch.install()
    listener = lambda call: counted.append((call.op, call.nbytes))  # noqa: E731
    watch.STATE.listeners.append(listener)
    try:
        out = part(x)
        forward = list(counted)
        out.pow(2).sum().backward()
    finally:
        watch.STATE.listeners.remove(listener)
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "w1_grad": part.column.weight.grad,
        "w2_grad": part.row.weight.grad,
        "b2_grad": part.row.bias.grad,
        "forward": forward,
        "all": counted,
    }


def test_the_tensor_parallel_mlp_equals_the_dense_one_with_one_all_reduce_each_way():
    d, h, batch, n = 6, 8, 5, 2
    dense = tp.mlp(d, h)
    torch.manual_seed(1)
    x = torch.randn(batch, d, requires_grad=True)
    out = dense(x)
    out.pow(2).sum().backward()
    runs = helpers.launch(_tp_step, d, h, batch, world_size=n, output="none")
    theory = tp.allreduce_bytes_per_mlp(batch, d)
    for rank, r in enumerate(runs):
        part = slice(rank * h // n, (rank + 1) * h // n)
        torch.testing.assert_close(r["out"], out.detach())
        torch.testing.assert_close(r["x_grad"], x.grad)
        torch.testing.assert_close(r["w1_grad"], dense[0].weight.grad[part])
        torch.testing.assert_close(r["w2_grad"], dense[2].weight.grad[:, part])
        torch.testing.assert_close(r["b2_grad"], dense[2].bias.grad)
        assert r["forward"] == [("all_reduce", theory["forward"])]
        assert r["all"] == [("all_reduce", theory["forward"]), ("all_reduce", theory["backward"])]


def _f_and_g_in_halves():
    """f and g over this rank's half of 4 ranks ({0, 1} or {2, 3}): g's forward and f's
    backward sum over the half only; g's backward and f's forward pass through unchanged."""
    import torch.distributed as dist

    rank = dist.get_rank()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = halves[rank // 2]
    x = torch.full((3,), float(rank + 1), requires_grad=True)
    y = tp.reduce_from_parallel(tp.copy_to_parallel(x, group) * (rank + 1), group)
    y.backward(torch.ones(3))
    return {"forward": y.detach(), "grad": x.grad}


def test_f_and_g_take_a_process_group_and_stay_inside_it():
    runs = helpers.launch(_f_and_g_in_halves, world_size=4, output="none")
    for rank, r in enumerate(runs):
        pair = [rank - rank % 2, rank - rank % 2 + 1]  # the ranks of this half
        want_forward = sum((q + 1) ** 2 for q in pair)  # g: each rank's (q + 1)·(q + 1), summed
        want_grad = sum(q + 1 for q in pair)  # f's backward: each rank's factor q + 1, summed
        torch.testing.assert_close(r["forward"], torch.full((3,), float(want_forward)))
        torch.testing.assert_close(r["grad"], torch.full((3,), float(want_grad)))


def test_shard_refuses_a_width_the_ranks_do_not_divide():
    with pytest.raises(ValueError, match="divisible"):
        tp.shard(tp.mlp(4, 6), 0, 4)


# -- lecture 08: interleaved 1F1B and ZB-H1 (simulated only) --------------------------------


def _makespan(events):
    return max(e["end"] for e in events)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 4), (4, 8)])
@pytest.mark.parametrize("v", [1, 2, 4])
def test_the_simulated_interleaved_bubble_is_the_formula(p, m, v):
    for fwd, bwd in [(1.0, 1.0), (1.0, 2.0)]:
        events = pp.simulate(pp.orders("interleaved", p, m, v=v), fwd, bwd)
        assert pp.bubble(events) == pytest.approx(
            pp.bubble_fraction_interleaved(p, m, v), abs=1e-12
        )
        # the fill and drain take (p−1)(F+B)/v: chunks are 1/v of a device's stage
        assert _makespan(events) == pytest.approx(m * (fwd + bwd) + (p - 1) * (fwd + bwd) / v)
        assert {e["chunk"] for e in events} == set(range(v))


@pytest.mark.parametrize("p,m", [(1, 3), (2, 4), (4, 8)])
def test_interleaved_with_one_chunk_is_1f1b(p, m):
    chunked = pp.orders("interleaved", p, m, v=1)
    assert [[op[:2] for op in order] for order in chunked] == pp.orders("1f1b", p, m)
    assert {op[2] for order in chunked for op in order} == {0}
    plain = pp.simulate(pp.orders("1f1b", p, m), 1.0, 2.0, comm=0.1)
    one = pp.simulate(chunked, 1.0, 2.0, comm=0.1)
    assert [{k: e[k] for k in plain[0]} for e in one] == plain
    assert pp.bubble_fraction_interleaved(p, m, 1) == pp.bubble_fraction(p, m)


def test_interleaved_refuses_a_micro_batch_count_p_does_not_divide():
    with pytest.raises(ValueError, match="multiple of p=4"):
        pp.orders("interleaved", 4, 6, v=2)
    with pytest.raises(ValueError, match="multiple of p=4"):
        pp.bubble_fraction_interleaved(4, 6, 2)
    with pytest.raises(ValueError, match="v ≥ 1"):
        pp.interleaved(2, 4, 0, 0)
    with pytest.raises(ValueError, match="interleaved schedule only"):
        pp.orders("interleaved", 2, 4)  # no v
    with pytest.raises(ValueError, match="interleaved schedule only"):
        pp.orders("1f1b", 2, 4, v=2)


@pytest.mark.parametrize("p,m", [(2, 4), (3, 4), (4, 4), (4, 8), (4, 9)])
@pytest.mark.parametrize(
    "f,b,w", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 1.0, 0.5), (1.0, 1.5, 0.25)]
)
def test_the_simulated_zb_h1_bubble_is_the_formula(p, m, f, b, w):
    events = pp.simulate(pp.orders("zb-h1", p, m), f, b, weight=w)
    assert pp.bubble(events) == pytest.approx(pp.bubble_fraction_zb_h1(p, m, f, b, w), abs=1e-12)
    assert _makespan(events) == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 16)])
def test_zb_h1_idles_a_third_of_1f1b_when_f_b_w_are_equal(p, m):
    def idle(events):  # the ranks' idle time, summed
        return p * _makespan(events) - sum(e["end"] - e["start"] for e in events)

    one_f_one_b = pp.simulate(pp.orders("1f1b", p, m), 1.0, 2.0)  # backward = B + W
    zb = pp.simulate(pp.orders("zb-h1", p, m), 1.0, 1.0, weight=1.0)
    assert idle(zb) == pytest.approx(idle(one_f_one_b) / 3)


def test_zb_h1_holds_as_many_micro_batches_as_1f1b():
    p, m = 4, 8
    zb, plain = pp.orders("zb-h1", p, m), pp.orders("1f1b", p, m)
    # until B (the activations B frees): the same on every stage, for the same F/B order
    assert [pp.in_flight(o) for o in zb] == [pp.in_flight(o) for o in plain] == [4, 3, 2, 1]
    assert [[op for op in o if op[0] != "W"] for o in zb] == plain
    # until W (which still reads the layer inputs): each stage holds back W by its index, so
    # every stage reaches p, 1F1B's peak (stage 0), and none goes past it
    assert [pp.in_flight(o, until="W") for o in zb] == [4, 4, 4, 4]
    assert max(pp.in_flight(o, until="W") for o in plain) == 4
    assert pp.zb_h1(2, 3, 1) == [
        ("F", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 0), ("F", 2), ("B", 2), ("W", 1), ("W", 2)
    ]  # fmt: skip


def test_the_makespans_order_gpipe_1f1b_interleaved_and_zb_h1():
    p, m = 4, 8
    span = {k: _makespan(pp.simulate(pp.orders(k, p, m), 1.0, 2.0)) for k in ("gpipe", "1f1b")}
    for v in (2, 4):
        span[v] = _makespan(pp.simulate(pp.orders("interleaved", p, m, v=v), 1.0, 2.0))
    zb = _makespan(pp.simulate(pp.orders("zb-h1", p, m), 1.0, 1.0, weight=1.0))
    assert span["gpipe"] >= span["1f1b"] > span[2] > span[4]
    assert span["1f1b"] > zb  # the same work: 1F1B's backward of 2 is ZB-H1's B + W


def test_bad_split_backwards_and_the_live_engine_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="W of micro-batch 0 comes before its B"):
        pp.simulate([[("F", 0), ("W", 0), ("B", 0)]], weight=1.0)
    with pytest.raises(ValueError, match="exactly one W per micro-batch"):
        pp.simulate([[("F", 0), ("F", 1), ("B", 0), ("B", 1), ("W", 0)]], weight=1.0)
    with pytest.raises(ValueError, match="weight="):
        pp.simulate(pp.orders("zb-h1", 2, 2))
    with pytest.raises(ValueError, match="all 2 chunks"):
        pp.simulate([[("F", 0, 1), ("B", 0, 1)]])
    with pytest.raises(ValueError, match="m ≥ p and W ≤ min"):
        pp.bubble_fraction_zb_h1(4, 2)
    with pytest.raises(ValueError, match="m ≥ p and W ≤ min"):
        pp.bubble_fraction_zb_h1(2, 4, 1.0, 1.0, 2.0)
    for kind, extra in [("interleaved", {"v": 2}), ("zb-h1", {})]:
        with pytest.raises(ValueError, match="for simulate"):
            pp.run(None, pp.orders(kind, 2, 2, **extra)[0])
