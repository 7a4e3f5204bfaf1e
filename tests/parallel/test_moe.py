"""helpers.parallel.moe: capacity, drops and the aux loss by hand; expert parallelism on 2 and 4
gloo ranks against the one-process layer on each rank's shard, forward and backward; the bytes
one all-to-all sends against the routing and against the uniform formula."""

from __future__ import annotations

import math

import pytest
import torch

import helpers
from helpers.parallel import moe as moe_lib

D, HIDDEN, E = 6, 8, 4
# (top_k, capacity_factor, tokens on rank 0): every case drops some assignments (asserted)
CASES = [(1, 1.0, 12), (2, 1.0, 10), (2, 0.75, 9)]


def _set_router(moe, weight):
    with torch.no_grad():
        moe.router.weight.copy_(torch.as_tensor(weight, dtype=moe.router.weight.dtype))
        moe.router.bias.zero_()


def _by_definition(moe, x):
    """y[t] = Σ_j gate_tj · expert_{e_tj}(x_t), token by token: the layer with no capacity."""
    probs = moe.router(x).softmax(-1)
    gate, expert = probs.topk(moe.top_k, dim=-1)
    gate = gate / gate.sum(-1, keepdim=True) if moe.top_k > 1 else gate
    rows = []
    for t in range(len(x)):
        picks = zip(gate[t], expert[t], strict=True)
        rows.append(sum(g * moe.experts[int(e)](x[t : t + 1])[0] for g, e in picks))
    return torch.stack(rows)


def test_capacity_is_the_rounded_up_formula():
    assert moe_lib.capacity(8, 4, 1, 1.25) == 3  # 2.5 → 3
    assert moe_lib.capacity(8, 4, 2, 1.0) == 4
    assert moe_lib.capacity(10, 1, 1, 1.1) == 11  # not 12: 1.1 · 10 is 11.000000000000002
    assert moe_lib.capacity(8, 4, 2, math.inf) == 8


def test_top1_drops_late_tokens_of_a_full_expert():
    # 6 tokens, 2 experts, factor 1: C = 3. Tokens 0, 1, 3, 4, 5 want expert 0: 4 and 5 are late.
    moe = moe_lib.MoE(2, 4, 2, top_k=1, capacity_factor=1.0).double()
    _set_router(moe, torch.eye(2))
    x = torch.tensor([[2.0, 0], [1, 0], [0, 1], [3, 0], [1, 0], [2, 0]], dtype=torch.float64)
    y = moe(x)
    assert moe.last["capacity"] == 3 and moe.last["dropped"] == 2
    assert moe.last["load"].tolist() == [5, 1]
    torch.testing.assert_close(y[4:], torch.zeros(2, 2, dtype=torch.float64))
    p = moe.router(x).softmax(-1)
    torch.testing.assert_close(y[3], p[3, 0] * moe.experts[0](x[3]))
    torch.testing.assert_close(y[2], p[2, 1] * moe.experts[1](x[2]))


def test_top2_queues_by_token_then_choice_and_renormalises_gates():
    # 4 tokens, 3 experts, top-2, factor 0.75: C = ceil(0.75·4·2/3) = 2. Choices
    # t0 (0,1), t1 (0,1), t2 (0,2), t3 (1,2): t2's expert 0 and t3's expert 1 (its
    # first choice) come third, so t3 gets its second expert alone.
    moe = moe_lib.MoE(3, 4, 3, top_k=2, capacity_factor=0.75).double()
    _set_router(moe, torch.eye(3))
    x = torch.tensor([[2.0, 1, 0], [2, 1, 0], [2, 0, 1], [0, 2, 1]], dtype=torch.float64)
    r = moe_lib.route(moe.router(x), 2, moe_lib.capacity(4, 3, 2, 0.75))
    assert r.expert.tolist() == [[0, 1], [0, 1], [0, 2], [1, 2]]
    assert r.keep.tolist() == [[True, True], [True, True], [False, True], [False, True]]
    y = moe(x)
    assert moe.last["dropped"] == 2 and moe.last["load"].tolist() == [3, 3, 2]
    p = moe.router(x).softmax(-1)
    torch.testing.assert_close(y[2], p[2, 2] / (p[2, 0] + p[2, 2]) * moe.experts[2](x[2]))
    torch.testing.assert_close(y[3], p[3, 2] / (p[3, 1] + p[3, 2]) * moe.experts[2](x[3]))
    torch.testing.assert_close(r.gate.sum(-1), torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("factor", [float(E), math.inf])
def test_with_room_for_every_token_nothing_is_dropped(top_k, factor):
    moe = moe_lib.MoE(D, HIDDEN, E, top_k=top_k, capacity_factor=factor, seed=3).double()
    x = torch.randn(16, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y = moe(x)
    assert moe.last["dropped"] == 0
    torch.testing.assert_close(y, _by_definition(moe, x))


def test_the_aux_loss_is_one_when_uniform_and_the_formula_otherwise():
    moe = moe_lib.MoE(E, HIDDEN, E, top_k=1).double()
    _set_router(moe, torch.eye(E))
    # token t leans to expert t mod E: each expert gets 1/E of the tokens and, by symmetry, 1/E
    # of the probability
    uniform = 3.0 * torch.eye(E, dtype=torch.float64).repeat(2, 1)  # (8, E)
    moe(uniform)
    assert moe.last["load"].tolist() == [2, 2, 2, 2]
    assert moe.last["aux_loss"].item() == pytest.approx(1.0)
    moe(torch.zeros(8, E, dtype=torch.float64).index_fill(1, torch.tensor([0]), 50.0))
    assert moe.last["aux_loss"].item() == pytest.approx(E)  # all to expert 0, with certainty
    x = torch.randn(10, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    moe(x)
    probs = moe.router(x).softmax(-1)
    f = torch.bincount(probs.argmax(-1), minlength=E) / 10
    torch.testing.assert_close(moe.last["aux_loss"], E * (f * probs.mean(0)).sum())


def test_one_rank_of_expert_parallelism_is_the_dense_layer():
    moe = moe_lib.MoE(D, HIDDEN, E, top_k=2, capacity_factor=1.0).double()
    ep = moe_lib.ExpertParallelMoE.from_dense(moe, rank=0, world_size=1)
    x = torch.randn(10, D, dtype=torch.float64)
    torch.testing.assert_close(ep(x), moe(x))
    assert ep.last["bytes_sent"]["dispatch"] == 0


def _shard(rank, tokens, seed):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(tokens + rank, D, dtype=torch.float64, generator=g)  # uneven shards
    return x, torch.randn(tokens + rank, D, dtype=torch.float64, generator=g)  # x, dL/dy


def _loss_backward(layer, x, dy):
    """Backward of a loss with dL/dy = dy plus 0.1 · aux_loss; returns y."""
    y = layer(x)
    ((y * dy).sum() + 0.1 * layer.last["aux_loss"]).backward()
    return y


def _expert_parallel_step():
    """Runs on each rank: one forward and backward of every case, results for the test."""
    out = []
    for seed, (top_k, factor, tokens) in enumerate(CASES):
        moe = moe_lib.MoE(D, HIDDEN, E, top_k, factor, seed=seed).double()
        ep = moe_lib.ExpertParallelMoE.from_dense(moe)
        x, dy = _shard(ep.rank, tokens, seed)
        x.requires_grad_()
        y = _loss_backward(ep, x, dy)
        ep.sync_router_grads()
        out.append(
            {
                "y": y.detach(),
                "x_grad": x.grad,
                "dropped": ep.last["dropped"],
                "router": [p.grad for p in ep.router.parameters()],
                "experts": {
                    ep.first_expert + i: [p.grad for p in e.parameters()]
                    for i, e in enumerate(ep.experts)
                },
            }
        )
    return out


@pytest.fixture(scope="module")
def launched():
    """Every launch of this file, made once. The launcher restarts its rank server when the
    environment changes, and pytest changes it for each test (PYTEST_CURRENT_TEST): launching
    from one fixture starts the server once and each world once."""
    one = {"balanced": (2, math.inf, 8, True), "random": (1, 1.0, 12, False)}
    return {
        n: {
            "step": helpers.launch(_expert_parallel_step, world_size=n, output="none"),
            **{
                name: helpers.launch(_bytes_sent, *args, world_size=n, output="none")
                for name, args in one.items()
            },
        }
        for n in (2, 4)
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_equals_the_dense_layer_on_each_shard(launched, world_size):
    runs = launched[world_size]["step"]
    for seed, (top_k, factor, tokens) in enumerate(CASES):
        moe = moe_lib.MoE(D, HIDDEN, E, top_k, factor, seed=seed).double()
        dropped = 0
        for rank in range(world_size):  # grads accumulate: the loss is the sum over shards
            x, dy = _shard(rank, tokens, seed)
            x.requires_grad_()
            y = _loss_backward(moe, x, dy)
            got = runs[rank][seed]
            torch.testing.assert_close(got["y"], y.detach())
            torch.testing.assert_close(got["x_grad"], x.grad)
            assert got["dropped"] == moe.last["dropped"]
            dropped += got["dropped"]
        assert dropped > 0, "the case should exercise capacity"
        router = [p.grad for p in moe.router.parameters()]  # summed over shards, as synced
        for run in runs:
            torch.testing.assert_close(run[seed]["router"], router)
        experts = {i: g for run in runs for i, g in run[seed]["experts"].items()}
        assert sorted(experts) == list(range(E))
        for i, expert in enumerate(moe.experts):
            torch.testing.assert_close(experts[i], [p.grad for p in expert.parameters()])


def _bytes_sent(top_k, factor, tokens, balanced):
    import torch.distributed as dist

    moe = moe_lib.MoE(D, HIDDEN, E, top_k, factor, seed=7).double()
    x = _shard(dist.get_rank(), tokens, 7)[0][:tokens]  # the same count on every rank
    if balanced:  # token t picks expert t mod E first, (t+1) mod E second: exactly uniform
        _set_router(moe, torch.eye(E, D))
        t = torch.arange(tokens)
        x = torch.zeros(tokens, D, dtype=torch.float64)
        x[t, t % E], x[t, (t + 1) % E] = 10.0, 5.0
    ep = moe_lib.ExpertParallelMoE.from_dense(moe)
    ep(x)
    return x, ep.last["bytes_sent"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_sent_are_the_routing_and_the_uniform_formula(launched, world_size):
    # balanced: every rank sends (n−1)/n of its T·k rows, 8 bytes per float64
    top_k, tokens = 2, 8
    runs = launched[world_size]["balanced"]
    uniform = moe_lib.all_to_all_bytes(tokens, D, world_size, top_k, itemsize=8)
    for _, sent in runs:
        assert sent["dispatch"] == sent["combine"] == uniform
        assert sent["counts"] == (world_size - 1) * (E // world_size) * 8

    # random routing, with drops: the kept rows of each expert are min(load, C), by hand
    top_k, factor, tokens = 1, 1.0, 12
    runs = launched[world_size]["random"]
    moe = moe_lib.MoE(D, HIDDEN, E, top_k, factor, seed=7).double()
    per, row, cap = E // world_size, D * 8, moe_lib.capacity(tokens, E, top_k, factor)
    with torch.no_grad():
        choices = [moe.router(x).argmax(-1) for x, _ in runs]  # top-1
    kept = torch.stack([torch.bincount(c, minlength=E).clamp(max=cap) for c in choices])  # (n, E)
    block = kept.view(world_size, world_size, per).sum(-1)  # (source, destination)
    for rank, (_, sent) in enumerate(runs):
        assert sent["dispatch"] == (block[rank].sum() - block[rank, rank]) * row
        assert sent["combine"] == (block[:, rank].sum() - block[rank, rank]) * row
    assert kept.sum() < world_size * tokens, "the case should drop some tokens"
