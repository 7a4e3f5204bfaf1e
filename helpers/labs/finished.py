"""Which of the course's finished functions a student's answer called.

A question that asks a student to *write* something the course has finished (lab 04's
schedules and engine, lab 07's merge and ring...) is not answered by calling the course's
version. ``finished_calls`` runs the answer under a call hook (``sys.setprofile``) that notes
every call of those functions, matched by code object, so an alias (``gpipe_order = pp.gpipe``)
or an early ``from helpers.measure.comm import gradient_bytes`` is seen as well as a direct call. The
check then asserts that the list is empty.

The hook runs in the student's kernel (or rank), so an answer can try to switch it off. For the
duration of the call ``sys.setprofile``, ``sys.settrace`` and ``threading.setprofile`` are
replaced by functions that only note the attempt, and the hook itself notes a call of the real
ones (a reference saved before the call): either counts as a finished call. Threads started
with ``threading`` during the call get the hook too. What still passes is a copy of the
course's code under a new code object: a person reads the answers (docs/threat-model.md).
"""

from __future__ import annotations

import sys
import threading

REMOVED = "(something removed the call hook)"


def _switched(name: str) -> str:
    return f"({name} called: the call hook that watches for the course's functions must stay on)"


def finished_calls(fn, finished, *args, **kwargs):
    """fn(*args, **kwargs), and the sorted names of the course's ``finished`` functions it
    called (a call hook, sys.setprofile, watches): a question asks you to write them, not to
    call them. Switching the hook off (sys.setprofile, sys.settrace) counts as such a call."""
    functions = [getattr(f, "__func__", f) for f in finished]  # a classmethod's function
    codes = {f.__code__: f"{f.__module__}.{f.__qualname__}" for f in functions}
    real = {"sys.setprofile": sys.setprofile, "sys.settrace": sys.settrace}
    called, closing = set(), [False]

    def hook(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            called.add(codes[frame.f_code])
        elif event == "c_call" and not closing[0]:  # the real one, through a saved reference
            for name, function in real.items():
                if arg is function:
                    called.add(_switched(name))

    def noting(name, allowed, original):
        def replacement(func, *rest):
            if func is allowed:  # a thread threading starts installs our hook: not tampering
                return original(func, *rest)
            called.add(_switched(name))
            return None

        return replacement

    outer, outer_threads = sys.getprofile(), threading.getprofile()
    replaced = [
        (sys, "setprofile", noting("sys.setprofile", hook, sys.setprofile)),
        (sys, "settrace", noting("sys.settrace", threading.gettrace() or hook, sys.settrace)),
        (threading, "setprofile", noting("threading.setprofile", hook, threading.setprofile)),
    ]
    threading.setprofile(hook)  # threads started during the call are watched too
    originals = [getattr(module, name) for module, name, _ in replaced]
    for module, name, replacement in replaced:
        setattr(module, name, replacement)
    real["sys.setprofile"](hook)
    try:
        result = fn(*args, **kwargs)
    finally:
        closing[0] = True
        intact = sys.getprofile() is hook
        for (module, name, _), original in zip(replaced, originals, strict=True):
            setattr(module, name, original)
        sys.setprofile(outer)
        threading.setprofile(outer_threads)
    return result, sorted(called) + ([] if intact else [REMOVED])


def watched(fn, finished, called: list):
    """``fn`` wrapped: each call runs under ``finished_calls`` and adds the names of the
    course's ``finished`` functions it called to ``called`` (once each), for a probe that calls
    a student's function many times and checks ``called == []`` once."""

    def call(*args, **kwargs):
        result, names = finished_calls(fn, finished, *args, **kwargs)
        called.extend(name for name in names if name not in called)
        return result

    return call
