"""course.kernel.guard_missed_wakeups: a message queued without a wake-up is seen within a slice.

The race itself (pyzmq's edge-triggered descriptor consumed elsewhere) cannot be forced on
demand; a socket that behaves as it does then stands in for it: its poll sleeps through the
whole timeout without noticing the queued message, and only a new poll finds it.
"""

from __future__ import annotations

import asyncio
import time
from queue import Empty

from jupyter_client.channels import AsyncZMQSocketChannel

from course.kernel import guard_missed_wakeups


class MissedWakeup:
    """A socket whose first poll misses the queued message and sleeps its whole timeout."""

    def __init__(self, queued: bool = True):
        self.polls, self.queued = 0, queued

    async def poll(self, timeout_ms):
        self.polls += 1
        if self.polls == 1 or not self.queued:
            await asyncio.sleep((timeout_ms if timeout_ms is not None else 60_000) / 1000)
            return 0
        return 1


def _channel(socket):
    ch = AsyncZMQSocketChannel.__new__(AsyncZMQSocketChannel)
    ch.socket = socket

    async def recv():
        return {"msg_type": "execute_reply"}

    ch._recv = recv
    return ch


def _get(channel, timeout):
    start = time.monotonic()
    try:
        return asyncio.run(channel.get_msg(timeout=timeout)), time.monotonic() - start
    except Empty:
        return None, time.monotonic() - start


def test_unguarded_a_missed_wakeup_costs_the_whole_timeout(monkeypatch):
    # jupyter_client's own get_msg, even if this process already guards its channels
    unguarded = getattr(AsyncZMQSocketChannel.get_msg, "original", AsyncZMQSocketChannel.get_msg)
    monkeypatch.setattr(AsyncZMQSocketChannel, "get_msg", unguarded)
    msg, took = _get(_channel(MissedWakeup()), 3.0)
    assert msg is None and took >= 3.0  # what nbclient saw: nothing until its cell timeout


def test_guarded_a_queued_message_is_seen_within_a_slice(monkeypatch):
    unguarded = getattr(AsyncZMQSocketChannel.get_msg, "original", AsyncZMQSocketChannel.get_msg)
    monkeypatch.setattr(AsyncZMQSocketChannel, "get_msg", unguarded)
    guard_missed_wakeups(slice_s=0.5)
    guard_missed_wakeups(slice_s=0.5)  # twice is once
    assert getattr(AsyncZMQSocketChannel.get_msg, "sliced", False)
    msg, took = _get(_channel(MissedWakeup()), 30.0)
    assert msg == {"msg_type": "execute_reply"} and took < 2.0
    # no timeout (iopub waits so): still seen after one slice
    msg, took = _get(_channel(MissedWakeup()), None)
    assert msg is not None and took < 2.0
    # nothing queued: Empty at the caller's own timeout, not a slice
    msg, took = _get(_channel(MissedWakeup(queued=False)), 1.6)
    assert msg is None and 1.5 <= took < 3.0
