"""helpers/labs/lab01.py: what lab 01's checks compute apart from the student's kernel.

The device (``fits``) is held to the lab's own ``fits_one_device`` (lab01_harness), run here with
the solution notebook's setting, at the largest batch that fits and the next; the one-process
reference of ``average_gradients`` to the lab's gradient averaging on 2 to 4 gloo ranks. The
hidden cases each test draws sweep what they promise, and differ from one seed to the next.
"""

from __future__ import annotations

import contextlib
import io

import nbformat
import pytest
import torch

import helpers
from course.grading import cells
from course.syllabus import REPO
from helpers.labs import lab01, lab01_harness

LAB = REPO / "solutions" / "lab01_ddp_scaling.ipynb"
SEEDS = range(20)


def lab_cells(*grade_ids: str) -> dict:
    """A namespace where the lab's parameters cell and the cells ``grade_ids`` ran."""
    nb = nbformat.read(LAB, as_version=4)
    by_id = {cells.grade_id(c): c.source for c in nb.cells}
    ns: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(next(c.source for c in nb.cells if "parameters" in c.metadata.get("tags", [])), ns)
        for gid in grade_ids:
            exec(by_id[gid], ns)
    return ns


def test_the_device_fits_exactly_what_the_labs_own_device_fits():
    lab = lab_cells("lab01_setup", "one_device")
    device = {
        "budget": lab["memory_budget"],
        "data": len(lab["train"]),
        "name": lab["model_name"],
        "in_shape": lab["in_shape"],
        "hidden": lab["hidden"],
        "depth": lab["depth"],
    }

    def theirs(batch):  # the device the lab's locked fits() launches (lab01_harness)
        with contextlib.redirect_stdout(io.StringIO()):  # it prints each out-of-memory
            return lab01_harness.fits_one_device(lab["setting"], lab["train"].tensors, batch)

    low, high = 32, 32  # the largest that fits, found by the lab's own device
    while theirs(high):
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if theirs(mid) else (low, mid)
    for batch in (1, 32, low - 1, low, high, 2 * high):
        assert lab01.fits(batch, **device) is theirs(batch), batch
    assert lab01.fits(low, **device) and not lab01.fits(low + 1, **device)


def test_the_labs_model_is_the_one_the_check_counts():
    lab = lab_cells("lab01_setup")
    mine = lab01.make_model(lab["model_name"], lab["in_shape"], lab["hidden"], lab["depth"])
    theirs = lab["make_model"]()
    assert [p.shape for p in mine.parameters()] == [p.shape for p in theirs.parameters()]


def _average_by_hand(cases):
    """On every rank: each case trained with the lab's solution of average_gradients."""
    import torch.distributed as dist
    from torch import nn

    rank, size = dist.get_rank(), dist.get_world_size()
    out = []
    for steps, batch, seed, mixed in cases:
        model = lab01.small_model(mixed)
        opt = torch.optim.SGD(
            [p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9
        )
        x, y = lab01.small_batches(steps, batch * size, seed)
        for step in range(steps):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[step, rank::size]), y[step, rank::size]).backward()
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= size
            opt.step()
        out.append([p.detach().double() for p in model.parameters()])
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_one_process_reference_ends_where_averaged_ranks_do(world_size):
    cases = [(3, 1 + world_size, 5 + world_size, mixed) for mixed in (False, True)]
    per_rank = helpers.launch(
        _average_by_hand, cases, world_size=world_size, backend="gloo", output="none", timeout=120
    )
    assert len(per_rank) == world_size
    for i, case in enumerate(cases):
        want = lab01.one_process(world_size, *case)
        for rank, results in enumerate(per_rank):
            torch.testing.assert_close(results[i], want, rtol=0, atol=1e-6, msg=f"{case}, {rank}")
    # and it depends on its data: another seed ends elsewhere
    seeded = [lab01.one_process(world_size, 3, 2, seed) for seed in (1, 2)]
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(*seeded, strict=True))


def test_the_searches_sit_on_every_boundary():
    for seed in SEEDS:
        cases = lab01.search_cases(seed)
        assert len(cases) == len(set(cases)) >= 9
        doubles = lambda s, x: x >= s and (x // s) * s == x and (x // s) & (x // s - 1) == 0  # noqa: E731
        thresholds = [(t, s) for t, s, limit in cases if limit is None]
        assert any(doubles(s, t) for t, s in thresholds), seed  # fits exactly at a doubling
        assert any(doubles(s, t + 1) for t, s in thresholds), seed  # and one below it
        assert any(t >= s * 2**16 for t, s in thresholds), seed  # 16 doublings and more
        limits = [(lim, s) for _, s, lim in cases if lim is not None]
        for edge in (-1, 0, 1):
            assert any(doubles(s, lim - edge) for lim, s in limits), (seed, edge)
        assert any(lim < s for lim, s in limits), seed  # nothing to ask
    assert lab01.search_cases(0) != lab01.search_cases(1)


def test_the_shards_cover_every_remainder_and_one_rank():
    for seed in SEEDS:
        cases = lab01.shard_cases(seed)
        seen = {(n % ws, ws) for n, ws, *_ in cases}
        assert {(r, ws) for ws in (1, 2, 3, 4) for r in range(ws)} <= seen, seed
        assert any(ws == 1 and shuffle for _, ws, _, shuffle, _ in cases), seed
        assert any(not shuffle for *_, shuffle, _ in cases), seed
        assert any(2 * n < ws for n, ws, *_ in cases), seed  # padded by repeating more than once
    assert lab01.shard_cases(0) != lab01.shard_cases(1)


def test_the_drawn_models_hold_what_a_careless_count_misses():
    for seed in SEEDS:
        model = lab01.drawn_model(seed)
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        assert any(p.dim() == 4 and p.shape[2] > 1 for _, p in trained), seed  # a conv kernel
        assert any(n.endswith(("in_proj_weight", "gain")) for n, _ in trained), seed
        assert any(not p.requires_grad for p in model.parameters()), seed
    sizes = lambda m: [tuple(p.shape) for p in m.parameters()]  # noqa: E731
    assert sizes(lab01.drawn_model(0)) != sizes(lab01.drawn_model(1))
    assert lab01.ring_case(0) != lab01.ring_case(1)


def test_the_drawn_trainings_and_tables_sweep_worlds_and_repeats():
    worlds = {(c[0], c[4]) for seed in SEEDS for c in lab01.training_cases(seed)}
    assert worlds == {(3, False), (4, False), (2, True), (3, True), (4, True)}
    repeats = {len(t) for seed in SEEDS for t in lab01.drawn_times(seed).values()}
    assert repeats == {1, 2, 3, 4, 5, 6}
    assert lab01.training_cases(0) != lab01.training_cases(1)
