"""Lecture 07's helpers: profiler spans and overlap, a profiled DDP run, torchrun agents as nodes."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import helpers
from helpers.tools import multinode, profiling


def _event(name, start_us, end_us):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start_us, end=end_us))


def test_spans_make_one_backward_per_step_and_leave_out_the_barrier():
    bw = profiling.BACKWARD
    events = [
        _event("gloo:all_reduce", 0, 5),  # the barrier before profiling, finishing
        _event("DistributedDataParallel.forward", 10, 20),
        _event(bw + "AddmmBackward0", 22, 30),
        _event(bw + "ReluBackward0", 31, 40),
        _event("gloo:all_reduce", 35, 45),
        _event("Optimizer.step#SGD.step", 46, 48),
        _event("aten::mm", 11, 19),  # not drawn
        _event("DistributedDataParallel.forward", 50, 60),
        _event(bw + "AddmmBackward0", 61, 70),
    ]
    rows = profiling.spans(events)
    lanes = [(lane, round(s * 1e6), round(e * 1e6)) for lane, _, s, e in rows]
    assert sorted(lanes) == sorted(
        [
            ("forward", 0, 10),
            ("forward", 40, 50),
            ("backward", 12, 30),  # from the first backward op of the step to its last
            ("backward", 51, 60),
            ("communication", 25, 35),
            ("optimizer", 36, 38),
        ]
    )
    # 5 of the all-reduce's 10 microseconds ran during backward
    assert profiling.overlap(rows) == pytest.approx(0.5)


def test_a_profiled_ddp_run_traces_every_rank(tmp_path):
    runs = helpers.launch(
        profiling.profile_ddp,
        steps=2,
        hidden=64,
        depth=2,
        batch=16,
        bucket_cap_mb=0.01,
        trace_dir=str(tmp_path),
        world_size=2,
        backend="gloo",
        output="none",
    )
    assert [r["rank"] for r in runs] == [0, 1]
    assert runs[0]["allreduces"] == runs[1]["allreduces"] > 0
    assert runs[0]["allreduces"] % 2 == 0  # the same buckets in each of the 2 steps
    for r in runs:
        lanes = {lane for lane, *_ in r["spans"]}
        assert lanes == {"forward", "backward", "communication", "optimizer"}
        assert 0.0 <= r["overlap"] <= 1.0
        trace = json.loads(open(r["trace"]).read())  # a Chrome trace: Perfetto opens it
        assert any(e.get("name") == "c10d::allreduce_" for e in trace["traceEvents"])
        assert r["table"][0]["self CPU ms"] >= r["table"][-1]["self CPU ms"]


def test_two_agents_stand_in_for_two_nodes():
    res = multinode.agents("helpers.tools.multinode:whoami", nnodes=2, nproc_per_node=1)
    ranks = res["results"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert {r["node"] for r in ranks} == {0, 1} and all(r["world"] == 2 for r in ranks)
    assert all(r["sum of ranks"] == 1.0 and r["restarts"] == 0 for r in ranks)
    assert ranks[0]["pid"] != ranks[1]["pid"]
    assert "is_host=true" in res["commands"][0] and "is_host=false" in res["commands"][1]


def test_a_failed_agent_says_what_happened_and_leaves_nothing_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where agents() makes its folder
    with pytest.raises(RuntimeError, match="torchrun agents exited with"):
        multinode.agents("helpers.tools.multinode:no_such_function", nnodes=1, nproc_per_node=1)
    assert list(tmp_path.iterdir()) == []


def test_when_one_node_fails_the_others_are_stopped_not_waited_for():
    # Rank 1 (node 1) fails as it exits, after every collective: rank 0 succeeds, and its agent
    # would wait 5 minutes in torchrun's exit barrier for node 1's (seen in CI): it must not.
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"torchrun agents exited with \[-9, 1\]"):
        multinode.agents(
            "rankfns:dies_at_exit_on",
            1,
            nnodes=2,
            nproc_per_node=1,
            timeout=200,
            env={"PYTHONPATH": str(Path(__file__).resolve().parents[1])},  # tests/
        )
    assert time.monotonic() - start < 90  # the 15 s grace, not the timeout or the barrier
