"""Grading slots sized to the lab's world: a core per rank where the machine has them, fewer
slots rather than oversubscribed ones (course.grade.lab_world, isolation.plan_slots)."""

from __future__ import annotations

import os

import nbformat
import pytest
from grading_fixtures import source

from course.grade import lab_world
from course.grading import isolation
from course.syllabus import REPO


@pytest.mark.parametrize(
    "lab, overrides, world",
    [
        ("lab01_ddp_scaling", {}, 4),  # world_sizes = [1, 2, 4]
        ("lab01_ddp_scaling", {"world_sizes": [1, 2]}, 2),  # a profile's override wins
        ("lab02_build_ddp", {}, 2),
        ("lab02_build_ddp", {"world_size": 3}, 3),
        ("lab04_pipeline_tensor", {}, 2),
        ("lab04_pipeline_tensor", {"stages": 4}, 4),  # a pipeline's stages are ranks too
    ],
)
def test_the_labs_world_is_read_from_its_parameters(lab, overrides, world):
    nb = nbformat.read(REPO / "solutions" / f"{lab}.ipynb", as_version=4)
    assert lab_world(nb, overrides) == world


def test_a_notebook_without_ranks_wants_one_core():
    assert lab_world(source(), {}) == 1


@pytest.mark.parametrize(
    "cores, jobs, world, plan",
    [
        (2, 2, 1, (2, 1)),  # plain notebooks: a core each, as before
        (2, 2, 2, (1, 2)),  # a 2-rank lab on 2 cores: one slot, not two oversubscribed
        (16, 8, 2, (8, 2)),
        (16, 8, 4, (4, 4)),
        (2, 4, 4, (1, 2)),  # more ranks than cores: every core, one slot
    ],
)
def test_slots_give_each_rank_a_core(monkeypatch, cores, jobs, world, plan):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert isolation.plan_slots(jobs, world) == plan
    slots, per_slot = plan
    shares = [isolation.slot_cores(k, slots) or list(range(cores)) for k in range(slots)]
    assert all(len(share) >= per_slot for share in shares), shares
    assert len({c for share in shares for c in share}) == sum(len(s) for s in shares)  # disjoint
