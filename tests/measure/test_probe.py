"""helpers.probe: the backend × op table lecture 01 asks this torch for, beside the slides'."""

import pytest

import helpers
from helpers.measure import probe


@pytest.fixture(scope="module")
def table():
    return probe.support_table()


def test_gloo_runs_every_op_on_cpu_in_this_torch(table):
    gloo = {(r["op"], r["reduce_op"]): r["gloo CPU"] for r in table}
    assert set(gloo) == {(op, "SUM") for op in probe.OPS} | {
        ("all_reduce", red) for red in probe.REDUCE_OPS[1:]
    }
    assert set(gloo.values()) == {"✓"}, gloo  # reduce_scatter, all_to_all and AVG included


def test_live_table_differs_from_the_slides_where_gloo_grew(table):
    diffs = probe.differences(table)
    assert {(d["op"], d["column"]) for d in diffs} >= {
        ("reduce_scatter", "gloo CPU"),
        ("all_to_all", "gloo CPU"),
    }
    assert all(
        d["slides"] == "✗" and d["this torch"] == "✓" for d in diffs if d["column"] == "gloo CPU"
    )
    rows = {r["op"]: r for r in probe.side_by_side(table)}
    assert rows["reduce_scatter"]["gloo CPU"] == "✓ / ✗ ≠" and rows["send"]["gloo CPU"] == "✓ / ✓"
    assert rows["all_reduce AVG"]["gloo CPU"] == "✓ / n.a."


def test_columns_this_machine_cannot_try_say_why(table):
    why = probe.untried(table)
    for column, reason in why.items():
        assert reason, column
        assert all(r[column] == "–" for r in table)
    assert "gloo CPU" not in why


@pytest.mark.parametrize(
    "backend, device, gpus, reason",
    [
        ("gloo", "CPU", 0, ""),
        ("gloo", "GPU", 0, "no GPU here"),
        ("gloo", "GPU", 1, ""),
        ("nccl", "GPU", 1, "needs 2 GPUs (1 here)"),
        ("nccl", "CPU", 0, "needs 2 GPUs (0 here)"),
    ],
)
def test_why_not(backend, device, gpus, reason):
    import torch.distributed as dist

    if backend == "nccl" and not dist.is_nccl_available():
        reason = "nccl not in this torch build"
    assert probe.why_not(backend, device, gpus) == reason


def test_the_slides_table_is_copied_as_printed():
    assert probe.SLIDES["reduce_scatter"] == dict(zip(probe.COLUMNS, "✗✗✗✗✗✓", strict=True))
    assert (
        probe.SLIDES["scatter"]["nccl GPU"] == "✗" and probe.SLIDES["all_to_all"]["mpi CPU"] == "✓"
    )
    assert set(probe.SLIDES) == set(probe.OPS)


def test_expected_results_for_an_odd_world():
    # what the probe checks every rank against, for 3 ranks (rank k starts with 10k + i)
    assert probe._expect("all_reduce", 1, 3) == [30.0, 33.0, 36.0]
    assert probe._expect("all_reduce", 2, 3, "AVG") == [10.0, 11.0, 12.0]
    assert probe._expect("reduce", 1, 3) is None
    assert probe._expect("recv", 0, 3) == [20.0, 21.0, 22.0]
    assert probe._expect("all_to_all", 2, 3) == [2.0, 12.0, 22.0]
    assert probe._expect("reduce_scatter", 2, 3, "MAX") == [22.0]


def test_probe_marks_a_wrong_result_false_on_every_rank():
    def lying_probe():
        # gloo's all_reduce works; make rank 1 report a wrong result through the probe's check
        import torch.distributed as dist

        from helpers.measure import probe as p

        real = p._run

        def wrong_on_rank_1(op, *a, **k):
            held = real(op, *a, **k)  # every rank still takes part, or the others would wait
            return [0.0] if dist.get_rank() == 1 else held

        p._run = wrong_on_rank_1
        try:
            return p.probe_rank("gloo", "CPU", ops=("all_reduce",), reduce_ops=("SUM",))
        finally:
            p._run = real

    rows = helpers.launch(lying_probe, world_size=2, backend="gloo", output="none")
    assert [r[0]["ok"] for r in rows] == [False, False]
    assert "wrong result on rank 1" in rows[1][0]["reason"]


def test_an_op_that_breaks_its_ranks_marks_that_op_not_the_column(monkeypatch):
    # On a one-GPU node gloo's send of a CUDA tensor aborted the rank (or broke the group for the
    # next collective). The probe then tries the ops one launch each: send and recv are ✗ with
    # how they failed, every other op keeps its own answer. Played here by a rank function that
    # breaks exactly there (tests/rankfns.py), in real processes.
    import rankfns

    from helpers.launcher import launch as launch_module

    real = launch_module.launch

    def launch(fn, *args, **kwargs):
        return real(rankfns.probe_breaking_send if fn is probe.probe_rank else fn, *args, **kwargs)

    monkeypatch.setattr(launch_module, "launch", launch)
    table = {(r["op"], r["reduce_op"]): r for r in probe.support_table(gpus=1)}
    send, recv = table["send", "SUM"], table["recv", "SUM"]
    assert send["gloo GPU"] == "✗" and "crashed the rank: signal SIGABRT" in send["gloo GPU why"]
    assert recv["gloo GPU"] == "✗" and "broke the group" in recv["gloo GPU why"], recv
    assert "Bad address" in recv["gloo GPU why"]
    others = {k: r["gloo GPU"] for k, r in table.items() if k[0] not in ("send", "recv")}
    assert set(others.values()) == {"✓"}, others
    assert all(r["gloo CPU"] == "✓" for r in table.values())  # the CPU column ran whole
