"""Lecture 03's measurements against theory: helpers.memory.track and helpers.sharding.

Every figure the lecture shows is checked here too: parameter, gradient and optimizer bytes
equal the formula exactly; activations equal 4B(L·h + 10) + 4; sharded per-rank bytes equal
the ZeRO formula up to FSDP's padding, ZeRO-1's whole-tensor partition and Adam's step
counters; sharded training ends with the parameters one process computes alone.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import helpers
from helpers.measure.memory import bytes_per_param, state_bytes
from helpers.parallel.sharding import bytes_per_rank, fsdp_shard_numel


def mlp(hidden=64, depth=3):
    torch.manual_seed(0)
    return helpers.models.mlp(hidden=hidden, depth=depth)


def test_bytes_per_parameter_as_in_the_zero_paper():
    assert sum(bytes_per_param("adam", "mixed").values()) == 16  # 2 + 2 + K, K = 12
    assert sum(bytes_per_param("adam", "fp32").values()) == 16
    assert bytes_per_param("momentum", "fp32") == {
        "parameters": 4,
        "gradients": 4,
        "optimizer_state": 4,
    }
    assert bytes_per_param("sgd", "mixed")["optimizer_state"] == 4  # the fp32 master copy
    assert state_bytes(10, "sgd")["total"] == 80
    with pytest.raises(ValueError, match="optimizer must be one of"):
        bytes_per_param("lion")


@pytest.mark.parametrize("stage, gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_per_rank_bytes_reproduce_the_papers_figure_1(stage, gb):
    got = bytes_per_rank(7.5e9, 64, stage, "adam", "mixed")["total"] / 1e9
    assert got == pytest.approx(gb, abs=0.05)


def test_one_rank_holds_everything_at_every_stage():
    for stage in range(4):
        assert bytes_per_rank(1000, 1, stage) == {**state_bytes(1000), "total": 16000}
    with pytest.raises(ValueError, match="stage must be"):
        bytes_per_rank(1000, 2, 4)


def test_fsdp_pads_dim_0_to_a_multiple_of_the_world_size():
    assert fsdp_shard_numel((10, 256), 4) == 3 * 256
    assert fsdp_shard_numel((256, 64), 4) == 64 * 64
    assert fsdp_shard_numel((10,), 2) == 5


def test_one_step_measured_equals_the_formula_exactly():
    model, B, h, L = mlp(), 32, 64, 3
    P, tensors = helpers.models.n_params(model), len(list(model.parameters()))
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(B, 1, 8, 8), torch.randint(10, (B,))
    with helpers.memory.track(model, opt, x, y) as mem:
        loss = nn.functional.cross_entropy(model(x), y)
        fwd = mem.mark("forward")
        loss.backward()
        bwd = mem.mark("backward")
        opt.step()
        step = mem.mark("step")
    assert fwd["parameters"] == 4 * P and fwd["gradients"] == 0
    assert fwd["activations"] == 4 * B * (L * h + 10) + 4  # ReLU outputs, log-softmax, a scalar
    assert fwd["inputs"] == 4 * 64 * B + 8 * B
    assert bwd["activations"] == 0 and bwd["gradients"] == 4 * P
    assert step["optimizer_state"] == 8 * P + 4 * tensors  # two moments + a step counter each
    assert mem.peak["total"] >= step["total"] and step["peak"] >= step["total"]
    assert [row["phase"] for row in mem.timeline] == ["forward", "backward", "step"]


@pytest.mark.parametrize("name, per_param", [("sgd", 0), ("momentum", 4)])
def test_sgd_state_measured(name, per_param):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if name == "momentum" else 0)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(10, (8,))
    with helpers.memory.track(model, opt, x, y) as mem:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    P = helpers.models.n_params(model)
    assert mem.now()["optimizer_state"] == per_param * P == state_bytes(P, name)["optimizer_state"]


def test_a_storage_resized_to_zero_counts_nothing():
    """FSDP frees gathered parameters with storage.resize_(0): the tracker must see it."""
    with helpers.memory.track() as mem:
        t = torch.zeros(1000)
        assert mem.now()["temporaries"] == 4000
        t.untyped_storage().resize_(0)
        assert mem.now()["temporaries"] == 0
        del t


def test_checkpointing_keeps_less_for_backward():
    from torch.utils.checkpoint import checkpoint_sequential

    kept = {}
    for segments in (0, 2):
        model, x = mlp(depth=8), torch.randn(256, 1, 8, 8)
        with helpers.memory.track(model, None, x) as mem:
            out = (
                checkpoint_sequential(model, segments, x, use_reentrant=False)
                if segments
                else model(x)
            )
            kept[segments] = mem.now()["total"]
            out.sum().backward()
    assert kept[2] < 0.75 * kept[0]


def test_sharded_runs_hold_the_formula_per_rank_and_train_like_one_process():
    hidden, depth, batch, steps = 64, 2, 32, 2
    ref = helpers.sharding.reference(hidden, depth, batch, steps, "float64")
    shapes = [tuple(p.shape) for p in ref]
    P, tensors = sum(p.numel() for p in ref), len(ref)

    def run(stage, dtype):
        args = (stage, hidden, depth, batch, steps, dtype)
        return helpers.launch(helpers.sharding.measure, *args, world_size=2, output="none")

    runs = {stage: run(stage, "float32") for stage in (1, 3)}
    for stage in (0, 1, 3):  # in float64 no rounding can flip a ReLU: the comparison is tight
        for r in run(stage, "float64"):
            for p, q in zip(ref, r["params"], strict=True):
                torch.testing.assert_close(p, q)
    # ZeRO-1 (ZeroRedundancyOptimizer): the ranks' Adam states add up to one, split by tensors
    state = [r["steady"]["optimizer_state"] for r in runs[1]]
    assert sum(state) == 8 * P + 4 * tensors and all(s < 8 * P for s in state)
    assert all(r["steady"]["parameters"] == r["steady"]["gradients"] == 4 * P for r in runs[1])
    # FSDP (fully_shard): dim 0 padded to a multiple of 2; here 10 rows -> 5 + 5, no padding
    numel = sum(fsdp_shard_numel(s, 2) for s in shapes)
    assert numel * 2 == P
    f = bytes_per_rank(P, 2, 3, "adam", "fp32")
    for r in runs[3]:
        s = r["steady"]
        assert s["parameters"] == s["gradients"] == f["parameters"] == 4 * numel
        assert s["optimizer_state"] == f["optimizer_state"] + 4 * tensors
        assert r["peak"]["total"] > s["total"]  # gathered layers, activations, temporaries
    # which collective moves what (traced): FSDP gathers the parameters twice, scatters grads once
    for r in runs[3]:
        assert sorted(r["comm"].values()) == [4 * P, 2 * 4 * P]
        assert {op.split("_")[0] for op in r["comm"]} == {"all", "reduce"}
    for r in runs[1]:  # DDP's all-reduce, then each rank's updated tensors broadcast: 4Ψ each
        assert r["comm"] == {"all_reduce": 4 * P, "broadcast": 4 * P}


def _fsdp_budget_run(limit):
    """One FSDP step of an MLP under a device budget on this rank: what it counted, or the OOM."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = helpers.models.coordinate_mlp(4, depth=2, width=30)  # dims 30, 30, 3: rows padded
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(40, 4).chunk(dist.get_world_size())[dist.get_rank()]
    try:
        with helpers.memory_limit(limit, model, opt) as mem:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            mem.check()
    except torch.OutOfMemoryError as oom:
        return {"oom": str(oom)}
    return {"after": helpers.memory.breakdown(model, opt), "peak": mem.peak}


def test_a_budget_counts_only_the_shard_an_fsdp_rank_holds():
    shapes = [(30, 4), (30,), (30, 30), (30,), (3, 30), (3,)]
    shard = sum(fsdp_shard_numel(s, 2) for s in shapes)  # FSDP pads each dim 0 to a multiple of 2
    runs = helpers.launch(_fsdp_budget_run, 10**12, world_size=2, output="none")
    for r in runs:
        assert r["after"]["parameters"] == r["after"]["gradients"] == 4 * shard
        # Adam's two moments of the shard (its step counters are scalars: not counted)
        assert r["after"]["optimizer_state"] <= 8 * shard
        # the full weights FSDP gathers for a layer are saved for backward: counted as activations
        assert r["peak"]["activations"] >= 4 * 30 * 30
    # the moments are made for the rows a rank owns, without FSDP's padding: together, Adam's 8P
    P = sum(math.prod(s) for s in shapes)
    assert sum(r["after"]["optimizer_state"] for r in runs) == 8 * P
    small = helpers.launch(_fsdp_budget_run, 4 * shard + 100, world_size=2, output="none")
    assert all("CUDA out of memory" in r["oom"] for r in small)


def _gather_both_ways():
    import torch.distributed as dist

    n, mine = dist.get_world_size(), torch.ones(5, dtype=torch.float64)
    with helpers.trace() as calls:
        dist.all_gather([torch.empty(5, dtype=torch.float64) for _ in range(n)], mine)
        dist.all_gather_into_tensor(torch.empty(5 * n, dtype=torch.float64), mine)
        dist.broadcast(mine, src=0)
    return helpers.sharding.payload(calls.records, n)


def test_a_gathers_payload_is_the_full_tensor_whichever_form_is_called():
    for r in helpers.launch(_gather_both_ways, world_size=2, output="none"):
        assert r == {"all_gather": 80, "all_gather_into_tensor": 80, "broadcast": 40}
