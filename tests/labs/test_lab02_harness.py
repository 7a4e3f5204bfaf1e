"""helpers/labs/lab02_harness.py: the runners lab 02's locked cells hand the student's code to.

Each runner runs the solution's answer (taken from the solution notebook) on real gloo ranks, and
lab 02's own check judges what it returned: the solution passes, a plausible wrong answer fails.
So a runner that lost a field, a step or a rank, or reported something other than what ran,
fails here, not only in the lab's end-to-end tests.
"""

from __future__ import annotations

import re

import nbformat
import pytest
import torch

from course.grading import cells
from course.syllabus import REPO
from helpers.labs import lab02, lab02_harness
from helpers.measure.comm import gradient_bytes

LAB = REPO / "solutions" / "lab02_build_ddp.ipynb"
MARKS = re.compile(r"^[ \t]*### (BEGIN|END) SOLUTION[ \t]*\n?", re.M)


def answer(gid: str, **replace: str) -> dict:
    """The namespace of the solution's cell ``gid`` (markers removed, ``replace`` applied), run
    with the lab's imports under a module name no rank can import: its classes and functions
    travel to the ranks by value, as a notebook's do."""
    cell = next(c for c in nbformat.read(LAB, as_version=4).cells if cells.grade_id(c) == gid)
    source = MARKS.sub("", cell.source)
    for old, new in replace.items():
        assert old in source, old
        source = source.replace(old, new)
    namespace = {"__name__": "lab02_answer"}
    exec("import contextlib\nimport torch\nimport torch.distributed as dist\nfrom torch import nn\n"
         "loss_fn = nn.CrossEntropyLoss()\n" + source, namespace)  # fmt: skip
    return namespace


CASE = ("mlp", 2, 2, 8, 0.005, 100)  # model, world size, steps, batch per rank, cap (MiB), seed


@pytest.mark.slow
def test_the_solutions_scratch_ddp_passes_the_check_and_one_without_broadcast_fails():
    right = answer("scratch_ddp")["ScratchDDP"]
    per_rank = lab02_harness.scratch_ddp_runs(right, *CASE)
    lab02.assert_like_torch_ddp(per_rank, *CASE)
    assert [c[0] for c in per_rank[0]["steps"][-1]["calls"]] == [5544, 12544]  # last layers first
    unbroadcast = answer("scratch_ddp", **{"dist.broadcast(t.data, src=0)": "pass"})["ScratchDDP"]
    with pytest.raises(AssertionError, match="parameters differ|buffers not broadcast"):
        lab02.assert_like_torch_ddp(lab02_harness.scratch_ddp_runs(unbroadcast, *CASE), *CASE)


@pytest.mark.slow
def test_the_accumulation_runner_reports_one_all_reduce_and_each_forward_before_its_backward():
    step = answer("accumulation_step")["accumulation_step"]
    k, micro, world_size, steps = 3, 4, 2, 2
    per_rank = lab02_harness.accumulation_runs(step, k, micro, world_size, steps)
    want = lab02.accumulation_reference(k, micro, world_size, steps)
    once = gradient_bytes(lab02.accumulation_model())
    assert len(per_rank) == world_size
    for r in per_rank:
        torch.testing.assert_close(r["parameters"], want, rtol=1e-4, atol=1e-5)
        assert r["all-reduced per step"] == [once] * steps
        assert r["order"] == [[("forward", micro), ("backward", micro)] * k] * steps
    # without no_sync every micro-batch's backward all-reduces: the runner counts each one
    synced = answer("accumulation_step", **{"model.no_sync() if j < k - 1 else ": ""})
    per_rank = lab02_harness.accumulation_runs(synced["accumulation_step"], k, micro, 2, 1)
    assert per_rank[0]["all-reduced per step"] == [k * once]


@pytest.mark.slow
def test_the_counted_epoch_counts_every_sample_once_and_a_gradient_per_step():
    per_rank = lab02_harness._launch(lab02_harness.counted_epoch, 100, world_size=2)
    n_samples = len(lab02._digits()[1])
    assert sum(r["samples"] for r in per_rank) == n_samples + n_samples % 2  # padded to even
    for r in per_rank:
        steps = -(-r["samples"] // 100)
        assert r["steps"] == steps
        assert r["counted"] == {
            "forward": r["samples"] * 64 * 4,
            "backward": 4 * steps,
            "all-reduce": 4 * r["n_params"] * steps,
        }
