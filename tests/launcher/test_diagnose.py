"""The hang explanations, from hand-made rank states (no processes needed)."""

from helpers.launcher.diagnose import explain, findings


def blocked(op, tensors, seq=0, group="world", peer=None, stack=()):
    return {
        "snapshot": {
            "state": "running",
            "since": 0.0,
            "now": 10.0,
            "call": f"{op}({tensors})",
            "call_start": 1.0,
            "call_key": (group, seq, op, tensors),
            "call_peer": peer,
            "last": None,
            "last_key": None,
            "stack": list(stack),
        }
    }


def finished(last_key=None):
    snap = {
        "state": "idle",
        "call": None,
        "last": last_key and f"{last_key[2]}({last_key[3]})",
        "last_key": last_key,
    }
    return {"finished": True, "snapshot": snap}


def test_a_rank_that_returned_early_is_named_as_skipping():
    out = findings(
        {
            0: finished(),
            1: blocked("all_reduce", "float32[1]"),
            2: blocked("all_reduce", "float32[1]"),
        }
    )
    assert out == [
        "rank 0 returned while ranks 1, 2 wait in all_reduce: a rank skipped a collective the "
        "others called. Every rank must call every collective, in the same order (look for a "
        "collective inside `if rank == ...`)."
    ]


def test_a_finished_rank_whose_last_call_had_another_shape_is_compared():
    infos = {
        0: finished(("world", 0, "all_reduce", "float32[1]")),
        1: blocked("all_reduce", "float32[2]"),
    }
    text = " ".join(findings(infos))
    assert "rank 0: all_reduce(float32[1])" in text and "rank 1: all_reduce(float32[2])" in text


def test_ranks_at_different_sequence_numbers():
    out = findings({0: blocked("barrier", "", seq=4), 1: blocked("barrier", "", seq=3)})
    assert any("different collectives on world (rank 1 at #3; rank 0 at #4)" in f for f in out)


def test_subgroups_are_compared_separately():
    out = findings(
        {
            0: blocked("all_reduce", "float32[1]", group="ranks [0, 1]"),
            1: blocked("all_reduce", "float32[1]", group="ranks [0, 1]"),
            2: blocked("barrier", "", group="world"),
        }
    )
    assert not any("disagree" in f or "different" in f for f in out)


def test_send_to_a_finished_rank():
    out = findings({0: finished(), 1: blocked("recv", "float32[2]", seq=None, peer=0)})
    assert out == [
        "rank 1 waits in recv with peer rank 0, which has returned: the matching send/recv was never made."
    ]


def test_explain_lists_every_rank_with_its_stack():
    text = explain(
        {
            0: blocked("barrier", "", stack=[("cell.py", 3, "work", "dist.barrier()")]),
            1: {
                "finished": False,
                "snapshot": None,
                "dump": "Thread 0x1 (most recent call first):",
            },
        },
        5,
        2,
    )
    assert text.startswith("launch did not finish within 5 s: ranks 0, 1 of 2 still running.")
    assert 'File "cell.py", line 3, in work\n      dist.barrier()' in text
    assert "rank 1: did not answer" in text and "Thread 0x1" in text
