"""helpers/labs/lab02.py: the references lab 02's checks compute apart from the student's kernel.

The one-process emulation of torch DDP (``ddp_reference``) is held to torch DDP itself: every
test model trained by DistributedDataParallel on 2 and 3 gloo ranks, each rank from a start of
its own, ends where the emulation says. The hidden cases each test draws sweep what they
promise, and differ from one seed to the next.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import helpers
from helpers.labs import lab02
from helpers.parallel.dataparallel import dp_bytes

SEEDS = range(20)


def _torch_ddp(cases, digits):
    """On every rank: each case (kind, steps, batch per rank, cap in MiB, rank 0's seed) trained
    by torch DDP from this rank's own start; its parameters, None grads and buffers."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for kind, steps, batch, cap_mb, start in cases:
        module = lab02.ddp_model(kind, start + rank)  # only DDP's broadcast makes them agree
        model = DDP(module, bucket_cap_mb=cap_mb, find_unused_parameters=kind == "awkward")
        buffers = [b.clone() for b in module.buffers()]
        params = list(module.parameters())
        opt = lab02.sgd(params)
        for step in range(steps):
            x, y = lab02.rank_share(
                lab02.global_batch(step, batch * n, digits), rank, n, params[0].dtype
            )
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        out.append(
            {
                "parameters": [p.detach().clone() for p in params],
                "grad is None": [p.grad is None for p in params],
                "buffers": buffers,
            }
        )
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_one_process_emulation_ends_where_torch_ddp_does(world_size):
    # every test model, in one bucket and in many (DDP's buckets must not change the result)
    cases = [
        (kind, 3, 3 + world_size, cap, 7 * world_size)
        for kind in lab02.DDP_MODELS
        for cap in (0.001, 1.0)
    ]
    per_rank = helpers.launch(
        _torch_ddp,
        cases,
        helpers.data.load("digits").tensors,
        world_size=world_size,
        backend="gloo",
        output="none",
        timeout=120,
    )
    assert len(per_rank) == world_size
    for i, (kind, steps, batch, _, start) in enumerate(cases):
        want = lab02.ddp_reference(kind, world_size, steps, batch, start)
        for rank, results in enumerate(per_rank):
            got = results[i]
            where = f"{kind}, case {i}, rank {rank}"
            torch.testing.assert_close(
                got["parameters"],
                want["parameters"],
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, where=where: f"{where}: {m}",
            )
            assert got["grad is None"] == want["grad is None"], where
            torch.testing.assert_close(got["buffers"], want["buffers"], rtol=0, atol=0)
    awkward = lab02.ddp_reference("awkward", world_size, 2, 4, 0)
    names = [n for n, _ in lab02.ddp_model("awkward", 0).named_parameters()]
    none = {n for n, is_none in zip(names, awkward["grad is None"], strict=True) if is_none}
    assert none == {"frozen.weight", "frozen.bias", "unused.weight", "unused.bias"}


def test_the_emulation_differs_from_a_start_that_was_not_broadcast():
    # the check can tell a run whose ranks kept their own starts: the reference depends on it
    a = lab02.ddp_reference("mlp", 2, 2, 4, start=5)["parameters"]
    b = lab02.ddp_reference("mlp", 2, 2, 4, start=6)["parameters"]
    assert max((p - q).abs().max().item() for p, q in zip(a, b, strict=True)) > 1e-3


def test_dp_reference_moves_what_lecture_02s_formula_says():
    for n, size in [(2, 64), (4, 12), (3, 30)]:  # chunks of equal size: dp_bytes applies
        want = lab02.dp_reference(n, size, 0, ("mlp", 0, 16, 2))
        params = sum(p.numel() * 4 for p in lab02.build(("mlp", 0, 16, 2)).parameters())
        theory = dp_bytes(params, size * 64 * 4, size * 10 * 4, n)
        assert want["bytes"] == {k: int(v) for k, v in theory.items()}, (n, size)
    # 10 rows on 3 devices: x.chunk(3) cuts 4, 4 and 2; devices 1 and 2 receive 6 rows
    uneven = lab02.dp_reference(3, 10, 5, ("mlp", 1, 32, 2))["bytes"]
    assert uneven["scatter"] == 6 * 64 * 4 and uneven["gather"] == 6 * 10 * 4
    assert lab02.dp_reference(1, 16, 1, ("cnn", 0, 4))["bytes"] == {}  # one device moves nothing


def test_dp_cases_cover_every_remainder_of_1_to_4_devices_and_a_cnn():
    for seed in SEEDS:
        cases = lab02.dp_cases(seed)
        assert sorted({(n, size % n) for n, size, _, _ in cases}) == [
            (n, r) for n in range(1, 5) for r in range(n)
        ]
        for n, size, _, _ in cases:
            assert len(torch.zeros(size).chunk(n)) == n, (n, size)  # every device gets rows
        assert [spec[0] for _, _, _, spec in cases].count("cnn") == 1
        assert all(n > 1 for n, _, _, spec in cases if spec[0] == "cnn")
    assert lab02.dp_cases(1) != lab02.dp_cases(2)


def _buckets(kind, cap_bytes, closes=float.__ge__):
    return lab02.bucket_sizes(lab02._reversed_sizes(lab02.ddp_model(kind, 0)), cap_bytes, closes)


def test_ddp_cases_cross_every_boundary_of_the_bucket_rule():
    for seed in SEEDS:
        cases = lab02.ddp_cases(seed)
        # the plain MLP is the visible case's, and drawn among the others
        assert {kind for kind, *_ in cases} >= set(lab02.DDP_MODELS) - {"mlp"}
        assert {world for _, world, *_ in cases} == {2, 3}
        assert all(
            steps in (2, 3) and batch >= 2 for _, _, steps, batch, _, _ in cases
        )  # BatchNorm
        crossed = {}
        for kind, _, _, _, cap, _ in cases:
            n_params = len(lab02._reversed_sizes(lab02.ddp_model(kind, 0)))
            mib = _buckets(kind, cap * lab02.MIB)
            crossed.setdefault("one bucket", []).append(len(mib) == 1)
            crossed.setdefault("one per parameter", []).append(len(mib) == n_params)
            crossed.setdefault("10^6 vs MiB", []).append(
                sorted(_buckets(kind, cap * 1e6)) != sorted(mib)
            )
            # float64 counted at 4 bytes a number: every bucket closed at twice the cap
            crossed.setdefault("bytes of the dtype", []).append(
                kind == "mlp float64" and sorted(_buckets(kind, 2 * cap * lab02.MIB)) != sorted(mib)
            )
            crossed.setdefault("exactly the cap", []).append(
                sorted(_buckets(kind, cap * lab02.MIB, float.__gt__)) != sorted(mib)
            )
            # the reordered model with its input layer's bucket holding the output layer's bias:
            # the bucket's last-listed parameter is not the last to get its gradient
            crossed.setdefault("spanning", []).append(
                kind == "reordered"
                and cap * lab02.MIB > _buckets("reordered", 0)[0] + _buckets("reordered", 0)[1]
            )
        assert all(any(v) for v in crossed.values()), (seed, crossed)
    assert lab02.ddp_cases(1) != lab02.ddp_cases(2)


def test_epoch_cases_put_batch_sizes_on_both_sides_of_the_dataset():
    for seed in SEEDS:
        cases = lab02.epoch_cases(seed)
        for n in {case[0] for case in cases}:
            batches = [b for m, _, b, _ in cases if m == n]
            assert any(b < n and n % b == 0 for b in batches)
            assert any(b < n and n % b for b in batches)
            assert n in batches and any(b > n for b in batches)
    assert lab02.epoch_cases(1) != lab02.epoch_cases(2)


def test_accumulation_cases_include_k_1_and_both_world_sizes():
    for seed in SEEDS:
        cases = lab02.accumulation_cases(seed)
        ks = [k for k, *_ in cases]
        assert ks[0] == 1 and len(set(ks)) == 3 and set(ks) <= set(range(1, 6))
        assert {world for _, _, world, _ in cases} == {2, 3}
    assert lab02.accumulation_cases(1) != lab02.accumulation_cases(2)


def test_a_model_spec_that_is_not_known_says_what_is():
    with pytest.raises(ValueError, match="'mlp', seed, hidden, depth"):
        lab02.build(("resnet", 0))
    with pytest.raises(ValueError, match="one of mlp, awkward"):
        lab02.ddp_model("transformer", 0)
