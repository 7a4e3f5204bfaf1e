"""Watch the torch.distributed calls a rank makes, so a hang can say where each rank is stuck.

Every collective and point-to-point function of ``torch.distributed`` is wrapped once per
process. The wrapper records the call it is in (op, tensor shapes, group, peer, sequence number
on its group); listeners (the collective tracer) get a record when each call ends. The cost is a
few microseconds per call, small beside any collective.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# The calls that communicate. Point-to-point calls are not counted in a group's sequence.
COLLECTIVES = (
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
)
# isend/irecv stay unwrapped: they return at once (the wait blocks), and P2POp checks
# `op is dist.isend`, which a wrapper would break.
POINT_TO_POINT = ("send", "recv", "batch_isend_irecv")
TENSOR_ARGS = (
    "tensor",
    "output",
    "input",
    "output_tensor",
    "input_tensor",
    "tensor_list",
    "output_tensor_list",
    "input_tensor_list",
    "gather_list",
    "scatter_list",
    "object_list",
)


@dataclass
class Call:
    """One torch.distributed call on this rank."""

    op: str
    tensors: str  # e.g. "float32[4]" or "4×float32[2]"
    group: str  # "world" or "ranks [0, 2]"
    seq: int | None  # n-th collective on that group (0-based); None for point-to-point
    peer: int | None  # src/dst for send, recv, broadcast, reduce, gather, scatter
    nbytes: int  # bytes of the tensors passed in (the op's own payload is op-specific)
    start: float = field(default_factory=time.time)
    end: float | None = None
    waiting: bool = False  # in Work.wait() of this call, issued earlier with async_op=True

    def describe(self) -> str:
        """A one-line description, e.g. 'all_reduce(float32[1]) #3 on world'."""
        peer = ""
        if self.peer is not None:
            peer = f", {'dst' if self.op in ('send', 'reduce', 'gather') else 'src'}={self.peer}"
        where = f" #{self.seq} on {self.group}" if self.seq is not None else f" on {self.group}"
        waiting = " (its wait(), issued with async_op=True)" if self.waiting else ""
        return f"{self.op}({self.tensors}{peer}){where}{waiting}"


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.current: Call | None = None  # the call the main thread is in, if any
        self.last: Call | None = None  # the last call that returned
        self.seq: dict[str, int] = {}  # group -> collectives entered so far
        self.listeners: list = []


STATE = _State()
_installed = False
# The asynchronous calls not yet waited on, by id of their Work (a Work takes no attributes and
# no weak references); bounded, for Works that are never waited on (their futures are used).
_PENDING: OrderedDict[int, Call] = OrderedDict()
MAX_PENDING = 4096


def _shape(t) -> str:
    if isinstance(t, torch.Tensor):
        dims = ",".join(str(d) for d in t.shape)
        return f"{str(t.dtype).replace('torch.', '')}[{dims}]"
    if isinstance(t, (list, tuple)):
        inner = {_shape(x) for x in t}
        return (
            f"{len(t)}×{inner.pop()}" if len(inner) == 1 else "[" + ", ".join(map(_shape, t)) + "]"
        )
    return type(t).__name__


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _group_name(group) -> str:
    if group is None or group is dist.GroupMember.WORLD:
        return "world"
    try:
        return f"ranks {dist.get_process_group_ranks(group)}"
    except Exception:  # a group this rank is not part of
        return "a group without this rank"


def _record(op: str, sig: inspect.Signature, args, kwargs) -> Call:
    bound = sig.bind_partial(*args, **kwargs).arguments
    tensors = [bound[name] for name in TENSOR_ARGS if name in bound]
    if op == "batch_isend_irecv":
        ops = bound.get("p2p_op_list") or []
        tensors = [p.tensor for p in ops]
        desc = ", ".join(f"{p.op.__name__}({_shape(p.tensor)}, peer={p.peer})" for p in ops)
    else:
        desc = ", ".join(_shape(t) for t in tensors)
    group = _group_name(bound.get("group"))
    seq = None
    if op in COLLECTIVES:
        with STATE.lock:
            seq = STATE.seq.get(group, 0)
            STATE.seq[group] = seq + 1
    peer = next((bound[k] for k in ("dst", "src", "group_dst", "group_src") if k in bound), None)
    peer = peer if isinstance(peer, int) else None
    return Call(op, desc, group, seq, peer, sum(_nbytes(t) for t in tensors))


def _wrap(op: str, fn):
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def watched(*args, **kwargs):
        call = _record(op, sig, args, kwargs)
        outer = STATE.current
        STATE.current = call
        try:
            result = fn(*args, **kwargs)
        finally:
            call.end = time.time()
            STATE.current, STATE.last = outer, call
            for listener in STATE.listeners:
                listener(call)
        if result is not None and hasattr(result, "wait"):  # async_op=True: a Work to wait on
            with STATE.lock:
                _PENDING[id(result)] = call
                while len(_PENDING) > MAX_PENDING:
                    _PENDING.popitem(last=False)
        return result

    watched.__watched__ = fn
    return watched


def _watch_wait(wait):
    """Work.wait, recording that the rank is blocked in the collective the Work came from: a
    rank stuck in an asynchronous all-reduce's wait() is as stuck as one in a blocking call,
    and the diagnosis compares it with the other ranks the same way."""

    @functools.wraps(wait)
    def watched_wait(work, *args, **kwargs):
        with STATE.lock:
            issued = _PENDING.pop(id(work), None)
        if issued is None:
            return wait(work, *args, **kwargs)
        outer = STATE.current
        STATE.current = dataclasses.replace(issued, start=time.time(), end=None, waiting=True)
        try:
            return wait(work, *args, **kwargs)
        finally:
            STATE.current = outer

    watched_wait.__watched__ = wait
    return watched_wait


def install() -> None:
    """Wrap torch.distributed's communication functions (idempotent)."""
    global _installed
    if _installed:
        return
    for op in COLLECTIVES + POINT_TO_POINT:
        fn = getattr(dist, op, None)
        if fn is not None and not hasattr(fn, "__watched__"):
            setattr(dist, op, _wrap(op, fn))
    work = getattr(dist, "Work", None)
    if work is not None and not hasattr(work.wait, "__watched__"):
        work.wait = _watch_wait(work.wait)
    _installed = True


def reset() -> None:
    """Forget the calls of a previous launch (sequence numbers restart at 0)."""
    with STATE.lock:
        STATE.current = STATE.last = None
        STATE.seq.clear()
        _PENDING.clear()
