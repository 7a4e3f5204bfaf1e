"""helpers/labs/lab03.py: what lab 03's checks compute apart from the student's kernel.

The device (``step_peak``) is held to the lab's own locked ``step_peak``, run here from the
solution notebook's cells; the ZeRO-1 reference (``zero_reference``) to torch DDP with the whole
optimizer on 2 to 4 gloo ranks, on the pixels every rank draws with ``zero_batch``. The hidden
cases each test draws sweep what they promise, and differ from one seed to the next.
"""

from __future__ import annotations

import contextlib
import io
import math
from fractions import Fraction

import nbformat
import pytest
import torch

import helpers
from course.grading import cells
from course.syllabus import REPO
from helpers.labs import lab03

LAB = REPO / "solutions" / "lab03_memory.ipynb"
SEEDS = range(20)


def test_the_device_peaks_exactly_where_the_labs_own_device_does():
    nb = nbformat.read(LAB, as_version=4)
    by_id = {cells.grade_id(c): c.source for c in nb.cells}
    lab: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(next(c.source for c in nb.cells if "parameters" in c.metadata.get("tags", [])), lab)
        exec(by_id["lab03_setup"], lab)
        exec(by_id["step_peak"].split("\npeaks = ")[0], lab)  # the function, not its measurements
    shape = (lab["depth"], lab["width"], lab["inputs"].shape[1])
    assert shape[2] == lab03.FEATURES
    for batch in (1, 7, 64, 256, 471, 472, 1000):
        assert lab03.step_peak(batch, *shape) == lab["step_peak"](batch), batch
    budget = lab["budget"]
    for batch in (471, 472, 473):
        with contextlib.redirect_stdout(io.StringIO()):
            theirs = lab["step_peak"](batch, budget)
        assert lab03.step_peak(batch, *shape, budget) == theirs, batch


def _ddp_whole_optimizer(cases):
    """On every rank: each ZeroOne case trained by torch DDP with the whole optimizer."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    out = []
    for optimizer, dtype, depth, width, seed in cases:
        torch.manual_seed(0)
        model = DDP(helpers.models.coordinate_mlp(26, depth, width).to(getattr(torch, dtype)))
        name, kwargs = lab03.OPTIMIZERS[optimizer]
        opt = getattr(torch.optim, name)(model.parameters(), **kwargs)
        after = []
        for step in range(3):
            x, y = lab03.zero_batch(step, rank, dtype, seed)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            after.append([p.detach().clone() for p in model.parameters()])
        out.append(after)
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_zero_reference_ends_where_torch_ddp_does(world_size):
    cases = [
        ("adam", "float64", 1, 5, 3),
        ("momentum", "float64", 2, 9, 11),
        ("adam", "float32", 3, 4, 0),
    ]
    per_rank = helpers.launch(
        _ddp_whole_optimizer,
        cases,
        world_size=world_size,
        backend="gloo",
        output="none",
        timeout=120,
    )
    assert len(per_rank) == world_size
    for i, (optimizer, dtype, depth, width, seed) in enumerate(cases):
        want, P = lab03.zero_reference(optimizer, world_size, dtype, depth, width, seed)
        assert P == lab03.coordinate_params(depth, width)
        tolerance = 1e-5 if dtype == "float32" else 1e-10
        for rank, results in enumerate(per_rank):
            for got, ref in zip(results[i], want, strict=True):
                worst = max((g - w).abs().max().item() for g, w in zip(got, ref, strict=True))
                assert worst < tolerance, (cases[i], rank, worst)


def test_the_parameter_count_is_the_models():
    for depth in (1, 2, 3):
        for width in (3, 16, 31, 32):
            model = helpers.models.coordinate_mlp(lab03.FEATURES, depth, width)
            assert lab03.coordinate_params(depth, width) == helpers.models.n_params(model)


def test_the_zero_runs_pad_every_way_on_2_to_4_ranks():
    paddings = set()
    for seed in SEEDS:
        cases = lab03.zero_cases(seed)
        assert len(cases) == 4  # as many launches as the fixed cases took
        pads = {(n, -lab03.coordinate_params(d, w) % n) for _, n, _, d, w, _ in cases}
        assert {(4, 3), (3, 0)} <= pads, seed  # padded by 3, and not padded at all
        assert {o for o, *_ in cases} == {"adam", "momentum"} and "float32" in {c[2] for c in cases}
        paddings |= pads
    assert paddings >= {(4, 3), (4, 1), (3, 0), (3, 1), (3, 2)}
    assert lab03.zero_cases(0) != lab03.zero_cases(1)


def _exact(points, budget):
    (b0, p0), (b1, p1) = min(points), max(points)
    per_sample = Fraction(p1 - p0, b1 - b0)
    return max(0, math.floor((budget - (p0 - per_sample * b0)) / per_sample))


def test_the_checks_exact_largest_batch_is_the_exact_lines():
    for seed in range(5):
        for case in lab03.largest_cases(seed, 6_000_000)[0]:
            assert lab03.exact_largest(*case) == _exact(*case), case
    assert lab03.exact_largest(((10, 1300), (50, 2500)), 1000 + 30 * 77 + 29) == 77


def _zero_redundancy_state(seeds):
    """On every rank: the bytes of Adam state torch's ZeroRedundancyOptimizer keeps after one
    step of each seed's live-world model (what the lab's %%ranks cell measures)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from helpers.measure.memory import nbytes, optimizer_tensors

    out = []
    for seed in seeds:
        torch.manual_seed(0)
        model = DDP(helpers.models.coordinate_mlp(26, *lab03.world_case(seed)))
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
        ((model(torch.randn(8, 26)) - torch.rand(8, 3)) ** 2).mean().backward()
        opt.step()
        out.append(nbytes(optimizer_tensors(opt.optim)))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_live_worlds_reference_is_torchs_zero_redundancy_partition(world_size):
    seeds = [0, 7, 2, 6, 4]  # the plain run's, the verdict kernel's, the most and least even
    per_rank = helpers.launch(
        _zero_redundancy_state, seeds, world_size=world_size, backend="gloo", output="none"
    )
    for i, seed in enumerate(seeds):
        held = [r[i] for r in per_rank]
        assert held == lab03.world_state_bytes(seed, world_size), (seed, held)
        P = lab03.coordinate_params(*lab03.world_case(seed))
        assert sum(held) == 8 * P  # each moment kept once, somewhere


def test_the_live_worlds_models_differ_by_seed_and_leave_the_ranks_unequal():
    drawn = {lab03.world_case(seed) for seed in SEEDS}
    assert len(drawn) > len(SEEDS) // 2
    assert lab03.world_state_bytes(0) != lab03.world_state_bytes(7)  # a plain run's table fails
    assert sum(len(set(lab03.world_state_bytes(seed))) == 2 for seed in SEEDS) == len(SEEDS)


def test_the_lines_sit_on_both_sides_of_every_boundary_at_every_scale():
    for seed in SEEDS:
        lines, budget = lab03.largest_cases(seed, 6_000_000)
        assert 3_000_000 <= budget <= 12_000_000
        answers = [_exact(*case) for case in lines]
        # each budget beside one byte less: the answer one less, or 0 at the fixed part
        assert answers[1::2] == [max(0, a - 1) for a in answers[0::2]], seed
        assert 1 in answers and 0 in answers, seed
        assert max(p for points, _ in lines for _, p in points) > 10**9  # a GPU's bytes
        assert {len(points) for points, _ in lines} <= {2, 3}
        for points, _ in lines:  # exact: every point on one line
            (b0, p0), (b1, p1) = min(points), max(points)
            assert all((p - p0) * (b1 - b0) == (p1 - p0) * (b - b0) for b, p in points)
    assert lab03.largest_cases(0, 6_000_000) != lab03.largest_cases(1, 6_000_000)


def test_the_bytes_cases_hold_every_remainder_one_rank_and_many():
    for seed in SEEDS:
        cases = lab03.bytes_cases(seed)
        assert {(P % n, n) for P, n in cases} >= {(r, n) for n in (2, 3, 4) for r in range(n)}
        assert any(n == 1 for _, n in cases) and any(P < n for P, n in cases)
    assert lab03.bytes_cases(0) != lab03.bytes_cases(1)
