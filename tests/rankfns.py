"""Functions that tests run on several ranks, importable by module name (for torchrun)."""

import os

import torch
import torch.distributed as dist

import helpers


def ring_sum(scale=1.0, tag="x"):
    """Every rank contributes (rank + 1) * scale; returns what it saw."""
    t = torch.tensor([(dist.get_rank() + 1) * scale])
    dist.all_reduce(t)
    return {"rank": helpers.rank(), "world": helpers.world_size(), "sum": t.item(), "tag": tag}


def dies_at_exit_on(rank=1):
    """Returns normally, but ``rank``'s process then fails as it exits (after every collective):
    the other ranks succeed, and their agents wait in torchrun's exit barrier for this one."""
    if dist.get_rank() == rank:
        import atexit

        atexit.register(os._exit, 1)
    return dist.get_rank()


class _AbortsWhenCollected:
    def __del__(self, abort=os.abort):  # bound now: imports fail once the interpreter shuts down
        abort()  # what a gloo thread does to a process in the C++ runtime's teardown


def aborts_in_teardown():
    """Returns normally, then its process aborts while the interpreter tears down (after atexit)."""
    global _teardown_bomb
    _teardown_bomb = _AbortsWhenCollected()
    return dist.get_rank()


def probe_breaking_send(backend, device_type, ops=None, reduce_ops=None):
    """helpers.measure.probe.probe_rank on the CPU, except that a probe of send on "GPU" aborts
    its rank (rank 0) or breaks the group (rank 1 raises before answering): what gloo does
    with a CUDA tensor's send on a GPU node, played on a machine without one."""
    from helpers.measure import probe

    ops = ops or probe.OPS
    reduce_ops = reduce_ops or probe.REDUCE_OPS
    if device_type == "GPU" and "send" in ops:
        os.abort()
    if device_type == "GPU" and "recv" in ops and dist.get_rank() == 1:
        raise RuntimeError("writev [127.0.0.1]:1: Bad address")
    return probe.probe_rank(backend, "CPU", ops, reduce_ops)
