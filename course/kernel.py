"""The project's Jupyter kernel: every notebook names it, papermill and nbval run with it."""

from __future__ import annotations

import sys

KERNEL_NAME = "multigpu-course"
DISPLAY_NAME = "Python 3 (multi-GPU course)"
KERNELSPEC = {"name": KERNEL_NAME, "display_name": DISPLAY_NAME, "language": "python"}


def install_kernel(user: bool = False, quiet: bool = False) -> str:
    """Register this interpreter as the kernel ``multigpu-course`` and return the spec's folder.

    By default the spec goes inside the active environment (``--sys-prefix``), so Jupyter
    started from that environment finds it and several checkouts never overwrite each other;
    ``user=True`` registers it for every Jupyter of this user instead.
    """
    from ipykernel.kernelspec import install

    path = install(
        kernel_name=KERNEL_NAME,
        display_name=DISPLAY_NAME,
        user=user,
        prefix=None if user else sys.prefix,
    )
    if not quiet:
        print(f"registered kernel {KERNEL_NAME!r} ({sys.executable}) in {path}")
    return path


def guard_missed_wakeups(slice_s: float = 1.0) -> None:
    """Make kernel clients in this process wait for a message in slices of ``slice_s`` seconds.

    jupyter_client's async channels wait on pyzmq's poll, which sleeps on the socket's
    edge-triggered file descriptor. When that edge is consumed elsewhere (ipykernel#1529 fixed
    the kernel-side twin of this), the waiter is not woken although a message is queued, and
    it sleeps until its timeout, where a last poll finds the message. Seen in the suite: a cell
    of lecture 04 that ran for 0.5 s (kernel timestamps) was recorded as 360 s, its whole cell
    timeout, on a loaded machine. Polling again after each slice sees a queued message within a
    second; a wait with no message still ends at its own timeout, with the same Empty.
    """
    import time
    from queue import Empty

    from jupyter_client.channels import AsyncZMQSocketChannel

    original = AsyncZMQSocketChannel.get_msg
    if getattr(original, "sliced", False):
        return

    async def get_msg(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            step = slice_s if left is None else min(slice_s, left)
            try:
                return await original(self, timeout=step)
            except Empty:
                if left is not None and left <= step:
                    raise

    get_msg.sliced = True
    get_msg.original = original
    get_msg.__doc__ = original.__doc__
    AsyncZMQSocketChannel.get_msg = get_msg
