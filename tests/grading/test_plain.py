"""What may leave a graded kernel (course.grading.plain) and how a check decides on it
(course.grading.verdict).

No kernel here: the encoder is called as the kernel would call it, and the decoder and the
checks are fed data as a hostile kernel could send it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from course.grading import plain
from course.grading.verdict import Checker, run_check


def sent(**values) -> str:
    """What publish() sends for ``values``."""
    encoded = {k: plain.encode(v, k) for k, v in values.items()}
    return json.dumps({"values": encoded, "missing": [], "refused": {}})


def forged(**values) -> str:
    """What a tampered kernel could send instead: any JSON at all."""
    return json.dumps({"values": values, "missing": [], "refused": {}})


def test_plain_values_cross_exactly():
    values = {
        "n": 3,
        "x": -0.25,
        "odd": [float("nan"), float("inf")],
        "flag": True,
        "s": "ok",
        "nested": {(1, "a"): [None, {2, 3}], "k": (1.5,)},
        "t": torch.arange(6.0).reshape(2, 3),
        "half": torch.ones(2, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False]),
        "empty": torch.empty(0, 4),
        "param": torch.nn.Parameter(torch.ones(2)),
        "a": np.arange(4, dtype=np.int32),
        "scalar": np.float64(2.5),
        "shape": torch.Size([2, 3]),
    }
    back = plain.decode_probe(sent(**values))
    assert back.keys() == values.keys()
    assert back["nested"] == values["nested"] and back["shape"] == (2, 3)
    assert type(back["scalar"]) is float and type(back["param"]) is torch.Tensor
    for k in ("t", "half", "mask", "empty", "param"):
        torch.testing.assert_close(back[k], values[k].detach())
    np.testing.assert_array_equal(back["a"], values["a"])
    assert back["a"].dtype == np.int32
    assert str(back["odd"]) == "[nan, inf]"


class AlwaysEqual:
    def __eq__(self, other):
        return True


class LyingFloat(float):
    def __eq__(self, other):
        return True


class LyingList(list):
    def __eq__(self, other):
        return True


class LyingTensor(torch.Tensor):
    pass


@pytest.mark.parametrize(
    "value",
    [
        AlwaysEqual(),
        LyingFloat(1.0),
        LyingList([1]),
        torch.zeros(2).as_subclass(LyingTensor),
        np.zeros(2).view(type("Agree", (np.ndarray,), {})),
        [1, AlwaysEqual()],
        {"k": LyingFloat(2.0)},
        len,
        np.array(["text"]),
        np.array([1], dtype=object),
    ],
    ids=lambda v: type(v).__name__,
)
def test_liars_and_objects_are_refused_in_the_kernel(value):
    with pytest.raises(plain.NotPlain, match="not plain data|not one of"):
        plain.encode(value, "got")


@pytest.mark.parametrize(
    "text, why",
    [
        (forged(x={"$": "pickle", "v": "gASVAgAAAAAAAABLCS4="}), "unknown tag 'pickle'"),
        (forged(x={"a": 1}), "dict data that encode"),
        (forged(x={"$": "dict", "v": [[[1], 2]]}), "unhashable"),
        (forged(x={"$": "tensor", "dtype": "float32", "shape": [3], "data": "AAAA"}), "bytes"),
        (forged(x={"$": "tensor", "dtype": "object", "shape": [1], "data": ""}), "not allowed"),
        ('{"values": {"x": NaN}, "missing": [], "refused": {}}', "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
        ('{"values": {}, "missing": ["got"], "refused": {}}', "did not assign got"),
        ('{"values": {}, "missing": [], "refused": {"got": "got is a Liar"}}', "got is a Liar"),
        (None, "missing or too large"),
    ],
)
def test_the_decoder_refuses_what_encode_never_makes(text, why):
    with pytest.raises(plain.NotPlain, match=why):
        plain.decode_probe(text)


def test_a_check_passes_fails_and_gives_partial_credit():
    pieces = [("assert got == 9, got\nprint('visible')", False), ("assert more == [16]", True)]
    ok = run_check(pieces, sent(got=9, more=[16]))
    assert ok["passed"] and ok["error"] is None
    assert [o.get("text") for o in ok["outputs"]] == ["visible\n", "[hidden tests passed]\n"]
    hidden = run_check(pieces, sent(got=9, more=[-16]))
    assert not hidden["passed"] and hidden["error"] == "AssertionError: a hidden test failed"
    assert "-16" not in json.dumps(hidden)  # nothing of the hidden check's message
    visible = run_check(pieces, sent(got=8, more=[16]))
    assert visible["error"] == "AssertionError: 8" and "assert got == 9" in str(visible["outputs"])
    partial = run_check(
        [("right = sum(g == w for g, w in zip(got, [1, 2]))\n3 * right / 2", False)],
        sent(got=[1, 5]),
    )
    assert partial["passed"] and partial["value"] == 1.5
    refused = run_check(pieces, forged(got={"$": "pickle"}, more=[16]))
    assert not refused["passed"] and refused["error"].startswith("NotPlain")


def test_checks_run_with_real_builtins_whatever_the_kernel_did():
    # Nothing of the kernel arrives but data: the check's isinstance, abs, len are Python's.
    code = "assert isinstance(got, list) and len(got) == 2 and abs(got[0] - 1) < 1e-9"
    assert run_check([(code, False)], sent(got=[1.0, 2.0]))["passed"]
    assert not run_check([(code, False)], sent(got=[5.0, 2.0]))["passed"]


def test_the_checker_process_answers_and_a_hanging_check_fails(tmp_path):
    checker = Checker(str(tmp_path), timeout=20)
    try:
        assert checker.check([("assert got == 2", False)], sent(got=2), "t")["passed"]
        slow = Checker(str(tmp_path), timeout=1)
        hung = slow.check([("while True: pass", False)], sent(got=2), "t")
        assert not hung["passed"] and "took over 1 s" in hung["error"]
        assert slow.proc is None  # killed; the next check starts a fresh one
        slow.close()
        assert checker.check([("assert got == 3", False)], sent(got=2), "t")["error"]
    finally:
        checker.close()


def test_data_built_to_blow_up_a_check_meets_the_checkers_memory_limit(tmp_path):
    # The probe's values are the submission's to choose: two tensors that broadcast to N², or a
    # count that a check multiplies out. The checker has the submission's memory limit (here
    # 1 GiB): the check fails with the reason, the checker survives, the next check runs.
    checker = Checker(str(tmp_path), timeout=60, limits={"memory": 2**30})
    try:
        broadcast = checker.check(
            [("assert float((a - b).abs().max()) < 1e-6", False)],
            sent(a=torch.zeros(30_000, 1), b=torch.zeros(1, 30_000)),  # 3.6 GB of differences
            "t",
        )
        listed = checker.check([("assert len([0] * n) == n", True)], sent(n=10**9), "t")
        for verdict in (broadcast, listed):
            assert not verdict["passed"]
            assert "ran out of the checker's memory limit" in verdict["error"], verdict["error"]
        pid = checker.proc.pid
        assert checker.check([("assert n == 3", False)], sent(n=3), "t")["passed"]
        assert checker.proc.pid == pid  # the same checker: a MemoryError did not end it
    finally:
        checker.close()
    # the same data without the limit is what the limit stops (the broadcast alone is 3.6 GB)
    assert 30_000**2 * 4 > 3 * 2**30


def test_the_checks_share_what_is_left_of_the_submissions_budget(tmp_path):
    # A check that spins (data that makes it loop long) may use the CPU time left before the
    # deadline, not its own cell timeout again and again: once the deadline is past, every
    # remaining check fails at once with the reason.
    import time

    start = time.monotonic()
    checker = Checker(str(tmp_path), timeout=60, deadline=start + 3)
    try:
        spun = checker.check([("while True: pass", False)], sent(n=1), "t")
        after = checker.check([("assert n == 1", False)], sent(n=1), "t")
    finally:
        checker.close()
    assert time.monotonic() - start < 20  # not the 60 s cell timeout
    assert not spun["passed"] and (
        "CPU time left in the budget" in spun["error"] or "time budget" in spun["error"]
    ), spun["error"]
    assert not after["passed"] and "ran past the submission's time budget" in after["error"]
