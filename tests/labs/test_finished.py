"""helpers.labs.finished: the call hook that notes an answer calling the course's finished code,
however it reaches it, and however it tries to switch the hook off."""

import sys
import threading

from helpers.labs.finished import finished_calls, watched
from helpers.measure import comm
from helpers.parallel import pipeline as pp

GPIPE = "helpers.parallel.pipeline.gpipe"


def own_gpipe(p, m, stage):
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def test_an_answer_of_its_own_calls_nothing_finished_and_gets_its_result():
    assert finished_calls(own_gpipe, [pp.gpipe], 2, 3, 0) == (pp.gpipe(2, 3, 0), [])


def test_a_call_an_alias_or_a_function_that_calls_one_is_noted_by_name():
    alias = pp.gpipe  # gpipe_order = pp.gpipe
    assert finished_calls(alias, [pp.gpipe, pp.one_f_one_b], 2, 3, 0)[1] == [GPIPE]
    order = finished_calls(lambda: pp.SCHEDULES["1f1b"](2, 3, 0), [pp._warm_then_alternate])
    assert order == (pp.one_f_one_b(2, 3, 0), ["helpers.parallel.pipeline._warm_then_alternate"])


def unseen(fn, *args):
    """The red team's dodge: the profiler saved, switched off, the call made, the profiler back."""
    saved = sys.getprofile()
    sys.setprofile(None)
    try:
        return fn(*args)
    finally:
        sys.setprofile(saved)


REAL_SETPROFILE = sys.setprofile


def unseen_by_saved_reference(fn, *args):
    """The same with the real sys.setprofile saved before the hook replaced it."""
    saved = sys.getprofile()
    REAL_SETPROFILE(None)
    try:
        return fn(*args)
    finally:
        REAL_SETPROFILE(saved)


def test_switching_the_hook_off_counts_as_a_finished_call():
    for dodge in (unseen, unseen_by_saved_reference):
        result, called = finished_calls(dodge, [pp.gpipe], pp.gpipe, 2, 3, 0)
        assert result == pp.gpipe(2, 3, 0)
        assert called and called[0].startswith("(sys.setprofile called"), called
    _, called = finished_calls(lambda: sys.settrace(None), [pp.gpipe])
    assert called and called[0].startswith("(sys.settrace called"), called


def test_a_thread_started_in_the_answer_is_watched_too():
    def in_a_thread():
        out = []
        thread = threading.Thread(target=lambda: out.append(pp.gpipe(2, 3, 0)))
        thread.start()
        thread.join()
        return out[0]

    assert finished_calls(in_a_thread, [pp.gpipe]) == (pp.gpipe(2, 3, 0), [GPIPE])


def test_every_hook_is_given_back_after_the_call_even_when_it_raises():
    def raises():
        raise KeyError("the answer's own error")

    before = (sys.setprofile, sys.settrace, threading.setprofile, sys.getprofile())
    try:
        finished_calls(raises, [pp.gpipe])
    except KeyError:
        pass
    finished_calls(unseen, [pp.gpipe], pp.gpipe, 2, 3, 0)
    after = (sys.setprofile, sys.settrace, threading.setprofile, sys.getprofile())
    assert after == before and threading.getprofile() is None


def test_watched_gathers_the_names_of_every_call_once():
    called = []
    counted = watched(comm.gradient_bytes, [comm.gradient_bytes], called)
    import torch

    assert counted(torch.nn.Linear(2, 3)) == 36 and counted(torch.nn.Linear(1, 1)) == 8
    assert called == ["helpers.measure.comm.gradient_bytes"]
