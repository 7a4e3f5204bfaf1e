"""The measurement library on real ranks: bytes, timings, traces, benchmarks, memory, plots."""

from __future__ import annotations

import time

import matplotlib
import pytest
import torch
import torch.distributed as dist
from torch import nn

import helpers
from helpers.measure.bandwidth import bus_factor
from helpers.measure.timing import union_length

matplotlib.use("Agg")
pytestmark = pytest.mark.usefixtures("no_leftovers")


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 5), nn.ReLU(), nn.Linear(5, 3))  # 55 + 18 = 73 parameters


def wide_model():
    return nn.Sequential(
        nn.Linear(500, 500), nn.Linear(500, 500), nn.Linear(500, 10)
    )  # ~1 MB per layer


def ddp_steps(compress=None, steps=3, bucket_cap_mb=None, wide=False):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = wide_model() if wide else small_model()
    n_in = 500 if wide else 10
    kwargs = {"bucket_cap_mb": bucket_cap_mb} if bucket_cap_mb else {}
    ddp = DDP(model, **kwargs)
    wrap = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}.get(
        compress
    )
    rec = helpers.CommRecorder(wrap=wrap).register(ddp)
    timer = helpers.StepTimer(comm=rec)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(steps):
        timer.start()
        x = torch.randn(8, n_in)
        timer.mark("data")
        loss = ddp(x).pow(2).mean()
        timer.mark("forward")
        loss.backward()
        timer.mark("backward")
        opt.step()
        opt.zero_grad()
        timer.mark("optimizer")
        timer.stop()
    rec.close()
    return {
        "steps": rec.per_step(),
        "timing": timer.records,
        "grad_bytes": helpers.comm.gradient_bytes(model),
    }


@pytest.mark.parametrize("n", [2, 3])
def test_ddp_bytes_per_step_equal_the_gradient_bytes_exactly(n):
    out = helpers.launch(ddp_steps, world_size=n)
    for rank_out in out:
        assert rank_out["grad_bytes"] == 4 * 73
        for s in rank_out["steps"]:
            assert s["grad_bytes"] == s["sent_bytes"] == 4 * 73
            assert s["calls"] == s["buckets"] >= 1
            assert s["wire_bytes"] == pytest.approx(2 * (n - 1) / n * 4 * 73)


def test_compression_halves_the_bytes_sent_not_the_gradient():
    for name in ("fp16", "bf16"):
        out = helpers.launch(ddp_steps, name, world_size=2)
        for s in out[0]["steps"]:
            assert s["grad_bytes"] == 4 * 73 and s["sent_bytes"] == 2 * 73


def test_many_buckets_add_up_to_the_gradient():
    out = helpers.launch(
        ddp_steps, None, 3, 0.5, True, world_size=2
    )  # 0.5 MB buckets, ~2 MB of gradients
    params = 2 * (500 * 500 + 500) + 500 * 10 + 10
    assert out[0]["grad_bytes"] == 4 * params
    steps = out[0]["steps"]
    # DDP reduces everything in one bucket in step 0, then rebuilds buckets in backward order.
    assert steps[0]["buckets"] == 1 and all(s["buckets"] > 1 for s in steps[1:])
    assert all(s["grad_bytes"] == s["sent_bytes"] == 4 * params for s in steps)


def test_step_timing_phases_and_exposed_never_exceeds_total_communication():
    out = helpers.launch(ddp_steps, world_size=2)
    for rank_out in out:
        for rec in rank_out["timing"]:
            assert rec["comm_bytes"] == 4 * 73
            assert 0 <= rec["exposed_comm_s"] <= rec["comm_s"] + 1e-12
            parts = rec["data"] + rec["forward"] + rec["backward"] + rec["optimizer"]
            assert parts == pytest.approx(rec["total"])
            assert rec["compute"] == pytest.approx(
                rec["total"] - rec["data"] - rec["exposed_comm_s"]
            )
    summary = helpers.timing.summarize([o["timing"] for o in out])
    total = next(s for s in summary if s["field"] == "total")
    assert total["slowest_rank"] in (0, 1) and total["max"] >= total["mean"]


def test_step_timer_measures_known_durations_on_one_process():
    timer = helpers.StepTimer()
    timer.start()
    time.sleep(0.05)
    timer.mark("data")
    time.sleep(0.1)
    timer.mark("forward")
    rec = timer.stop()
    assert 0.05 <= rec["data"] < 0.09 and 0.1 <= rec["forward"] < 0.14
    with pytest.raises(RuntimeError, match="before start"):
        helpers.StepTimer().mark("data")


def test_union_length():
    assert union_length([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert union_length([(0, 1), (0.5, 2), (3, 4)], lo=1.5, hi=3.5) == pytest.approx(1.0)
    assert union_length([]) == 0.0


def traced():
    r = dist.get_rank()
    # Processes start up with seconds of skew on a loaded machine (CI saw rank 1 reach the
    # traced barrier before rank 0): line them up first, untraced, then stagger them.
    dist.barrier()
    with helpers.trace() as tr:
        time.sleep(0.25 * r)  # ranks arrive at the barrier at different times
        dist.barrier()
        dist.all_reduce(torch.ones(256))
        if r == 0:
            dist.send(torch.ones(4), dst=1)
        elif r == 1:
            dist.recv(torch.zeros(4), src=0)
    return tr.records


def test_trace_table_and_timeline_order():
    rows = helpers.trace.collect(helpers.launch(traced, world_size=3))
    barriers = [r for r in rows if r["op"] == "barrier"]
    assert len(barriers) == 3
    latest_start = max(b["start"] for b in barriers)
    assert all(b["end"] >= latest_start for b in barriers)  # nobody leaves before the last arrives
    by_rank = sorted(barriers, key=lambda b: b["rank"])
    assert [b["rank"] for b in sorted(barriers, key=lambda b: b["start"])] == [
        0,
        1,
        2,
    ]  # arrival order
    assert by_rank[0]["seconds"] > by_rank[2]["seconds"]  # the first to arrive waits the longest
    # seq numbers the group's collectives from process start: line-up barrier 0, barrier 1
    reduces = [r for r in rows if r["op"] == "all_reduce"]
    assert [r["bytes"] for r in reduces] == [1024] * 3 and {r["seq"] for r in reduces} == {2}
    p2p = {(r["rank"], r["op"], r["peer"], r["bytes"]) for r in rows if r["seq"] is None}
    assert p2p == {(0, "send", 1, 16), (1, "recv", 0, 16)}
    ax = helpers.plots.timeline(rows)
    assert ax.get_xlabel() == "time since the first call (s)" and len(ax.get_yticks()) == 3


def test_collective_benchmark_records_follow_the_definitions():
    sizes = [2**10, 2**14]
    recs = helpers.benchmark_collectives(sizes=sizes, world_sizes=(2,), target_s=0.002)
    assert {r["op"] for r in recs} == set(helpers.bench.OPS)
    for r in recs:
        assert r["bytes"] in sizes and r["seconds"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * bus_factor(r["op"], 2))
    mem = helpers.memcpy_bandwidth(sizes, target_s=0.002)
    assert [m["bytes"] for m in mem] == sizes and all(m["busbw_GBps"] > 0 for m in mem)
    fits = {}
    ar = [r for r in recs if r["op"] == "all_reduce"]
    fits[("all_reduce", 2)] = helpers.bandwidth.fit_alpha_beta(
        [r["bytes"] for r in ar], [r["seconds"] for r in ar]
    )
    ax = helpers.plots.busbw(recs + mem, fits)
    assert ax.get_ylabel() == "bus bandwidth (GB/s)" and ax.get_xscale() == "log"


def test_memory_breakdown_is_exact():
    model = nn.Linear(100, 10)  # 1010 parameters
    opt = torch.optim.Adam(model.parameters())
    assert helpers.memory.breakdown(model, opt) == {
        "parameters": 4040,
        "gradients": 0,
        "optimizer_state": 0,
        "activations": 0,
        "total": 4040,
    }
    model(torch.randn(4, 100)).sum().backward()
    opt.step()
    b = helpers.memory.breakdown(model, opt, activations=10)
    assert (b["gradients"], b["optimizer_state"], b["total"]) == (4040, 2 * 4040, 4 * 4040 + 10)


def test_memory_budget_triggers_at_the_right_size_and_not_before():
    model = nn.Linear(1000, 1000, bias=False)  # 4,000,000 bytes of parameters
    x = torch.randn(16, 1000, requires_grad=False)  # the saved input: 64,000 bytes
    exact = 4_000_000 + 64_000
    with helpers.memory_limit(exact, model) as budget:
        model(x).sum()
    assert budget.peak["activations"] == 64_000 and budget.peak["total"] == exact
    with pytest.raises(
        torch.OutOfMemoryError,
        match=r"Tried to allocate 62.50 KiB. GPU 0 has a total capacity of 3.88 MiB",
    ):
        with helpers.memory_limit(exact - 1, model):
            model(x).sum()
    with pytest.raises(torch.OutOfMemoryError):  # parameters alone exceed it: fails on entry
        with helpers.memory_limit("3.9MB", model):
            pass
    assert (
        helpers.memory.parse_bytes("1.5GB") == 1_500_000_000
        and helpers.memory.parse_bytes("2KiB") == 2048
    )
    with pytest.raises(ValueError, match="cannot read"):
        helpers.memory.parse_bytes("lots")


def test_plots_are_labelled_with_units():
    rows = [
        {"world_size": n, "batch_size": b, "time": t / n**0.8}
        for n in (1, 2, 4)
        for b, t in ((32, 4.0), (128, 2.0))
    ]
    ax = helpers.plots.speedup(rows)
    assert ax.get_ylabel() == "speedup T(1) / T(n)"
    assert len(ax.containers) == 2 and len(ax.get_legend().get_texts()) == 3  # ideal + 2 batches
    ax = helpers.plots.comm_bars(
        [
            {"world_size": 1, "compute": 1.0},
            {"world_size": 2, "compute": 0.5, "exposed_comm_s": 0.2},
        ]
    )
    assert ax.get_ylabel() == "time per step (s)" and len(ax.patches) == 4
    ax = helpers.plots.heatmap([[1, 2], [3, 4]], [2, 4], [64, 128], value_name="time (s)")
    assert ax.get_xlabel() == "width" and ax.get_ylabel() == "depth"
    ax = helpers.plots.heatmap([[1, float("nan")], [3, 4]], [2, 4], [64, 128])
    assert [t.get_text() for t in ax.texts] == ["1", "OOM", "3", "4"]  # a run that did not fit
    ax = helpers.plots.heatmap([[1, 2], [3, 4]], [2, 4], [64, 128], vmin=0, vmax=10)
    assert ax.images[0].get_clim() == (0, 10)  # one colour scale shared by several heatmaps
    assert helpers.plots.heatmap([[1, 2], [3, 4]], [2, 4], [64, 128]).images[0].get_clim() == (1, 4)
    ax = helpers.plots.predicted_vs_measured(
        [{"world_size": 1, "step": 1.0}], [{"world_size": 1, "step": 1.1}]
    )
    assert ax.get_ylabel() == "time per step (s)" and len(ax.get_lines()) == 2
