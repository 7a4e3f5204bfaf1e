"""Where a rank's memory goes — parameters, gradients, optimizer state, activations — and a
device memory budget, so "does not fit on one device, fits when sharded" works on a laptop.

    with helpers.memory_limit("1.5GB", model, optimizer) as budget:
        loss = model(x).sum(); loss.backward(); optimizer.step()
    budget.peak            # the largest total seen, by part

On CPU the budget raises ``torch.OutOfMemoryError`` worded as CUDA words it when the tracked
tensors exceed it: checked whenever autograd saves an activation, and at ``check()``. On a GPU
it sets the caching allocator's real limit (``set_per_process_memory_fraction``). Sizes are
bytes; "1.5GB" means 1.5e9 bytes, "1.5GiB" 1.5 × 2**30.
"""

from __future__ import annotations

import re
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

UNITS = {
    "": 1,
    "B": 1,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_bytes(size) -> int:
    """'1.5GB' -> 1_500_000_000; an int passes through."""
    if isinstance(size, (int, float)) and not isinstance(size, bool):
        return int(size)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(size))
    if not m or m.group(2).upper() not in UNITS:
        raise ValueError(
            f"cannot read {size!r} as a size: write e.g. 1500000000, '1.5GB' or '1.5GiB'"
        )
    return int(float(m.group(1)) * UNITS[m.group(2).upper()])


def fmt_bytes(n: float) -> str:
    """Bytes as CUDA's allocator prints them: '1024 bytes', '62.50 KiB', '1.50 GiB'."""
    n = int(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n > size:  # CUDA's format_size: up to and including 1024 it is still bytes
            return f"{n / size:.2f} {unit}"
    return f"{n} bytes"


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        st = _storage(t)  # a DTensor (FSDP's parameters): the shard this rank holds
        key = (st.data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def nbytes(tensors) -> int:
    """Bytes of the storages behind ``tensors``, each storage once (views share theirs)."""
    return _bytes(tensors)


def optimizer_tensors(optimizer):
    if optimizer is None:
        return []
    return [
        v
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]


def breakdown(model, optimizer=None, activations: int = 0) -> dict:
    """Bytes of parameters, gradients, optimizer state (and activations you measured), with total."""
    params = list(model.parameters())
    out = {
        "parameters": _bytes(params),
        "gradients": _bytes(p.grad for p in params),
        "optimizer_state": _bytes(optimizer_tensors(optimizer)),
        "activations": int(activations),
    }
    out["total"] = sum(out.values())
    return out


class memory_limit:  # noqa: N801 - a context manager used like a function
    """A device memory budget for ``model`` (+ ``optimizer``) and the activations it saves."""

    def __init__(self, limit, model, optimizer=None, device=None):
        self.limit = parse_bytes(limit)
        self.model, self.optimizer = model, optimizer
        p = next(model.parameters(), None)
        self.device = (
            torch.device(device)
            if device is not None
            else (p.device if p is not None else torch.device("cpu"))
        )
        self.live: dict = {}  # storage key -> weakref to a saved activation's storage
        self.peak: dict = {"total": 0}
        self.peak_activations = 0  # the most saved-activation bytes alive at once (CPU)
        self._fit: dict | None = None  # the tracked tensors at the last check that fit
        self._hooks = None

    @property
    def activations(self) -> int:
        # read live: FSDP frees a gathered weight it saved for backward with resize_(0)
        return sum(st.nbytes() for st in (r() for r in list(self.live.values())) if st is not None)

    def __enter__(self) -> memory_limit:
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.limit / total), self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        self._param_keys = {_storage(t).data_ptr() for t in self.model.parameters()}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        try:
            self.check()
        except BaseException:  # __exit__ will not run: without this the hooks stay installed
            self.__exit__()  # and every later saved tensor is checked against this budget
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak = {"total": torch.cuda.max_memory_allocated(self.device)}
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        elif self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None

    def _pack(self, t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in self._param_keys and key not in self.live:
            # freed after backward: no longer counted
            self.live[key] = weakref.ref(st, lambda _, k=key: self.live.pop(k, None))
            self.check(incoming=st.nbytes())
        return t

    def check(self, incoming: int = 0) -> dict:
        """Raise torch.OutOfMemoryError if the tracked tensors exceed the budget; return them.

        ``incoming``: bytes of the allocation being made now (already in the tracked total).
        Called without it, the request is whatever appeared since the last check that fit.
        """
        now = breakdown(self.model, self.optimizer, self.activations)
        if now["total"] > self.peak["total"]:
            self.peak = now
        # Apart from the total's peak: under 1F1B the most activations and the most gradients
        # are alive at different moments.
        self.peak_activations = max(self.peak_activations, now["activations"])
        if now["total"] <= self.limit:
            self._fit = now
            return now
        if incoming:  # the request is this activation: everything else was in use before it
            before = {**now, "activations": now["activations"] - incoming}
        else:  # the request is what appeared since the last check that fit
            before = dict(self._fit or dict.fromkeys(now, 0))
            incoming = now["total"] - before["total"]
        before["total"] = sum(v for k, v in before.items() if k != "total")
        raise torch.OutOfMemoryError(oom_message(incoming, self.limit, before))


def oom_message(request: int, capacity: int, in_use: dict) -> str:
    """CUDA's out-of-memory message for a simulated device (helpers.memory_limit).

    ``in_use`` ({'parameters', 'gradients', 'optimizer_state', 'activations', 'total'}) is what
    was allocated *before* the failing request, as CUDA counts it: free = capacity − in use,
    and the request did not fit in it. No cache on a simulated device: nothing is reserved.
    """
    free = max(0, capacity - in_use["total"])
    parts = ", ".join(
        f"{name.replace('_', ' ')} {fmt_bytes(in_use[name])}"
        for name in ("parameters", "gradients", "optimizer_state", "activations")
    )
    return (
        f"CUDA out of memory. Tried to allocate {fmt_bytes(request)}. GPU 0 has a total capacity "
        f"of {fmt_bytes(capacity)} of which {fmt_bytes(free)} is free. Of the allocated memory "
        f"{fmt_bytes(in_use['total'])} is allocated by PyTorch, and 0 bytes is reserved by "
        f"PyTorch but unallocated. In use: {parts} (simulated by helpers.memory_limit on a CPU "
        "device). Use a smaller batch, shard the optimizer state, gradients or parameters over "
        "ranks (ZeRO / FSDP), or raise the budget."
    )


BYTES_PER_PARAM = {
    # weights + gradients + optimizer state, per parameter (kept for lecture 01)
    "fp32-sgd": 4 + 4,
    "fp32-adam": 4 + 4 + 8,  # Adam keeps two fp32 moments
    "mixed-adam": 2 + 2 + 4 + 8,  # fp16 weights and grads, fp32 master weights and moments
}


def model_state_bytes(n_params: float, recipe: str = "mixed-adam") -> float:
    """Bytes of weights, gradients and optimizer state for training ``n_params`` parameters."""
    if recipe not in BYTES_PER_PARAM:
        raise ValueError(f"recipe must be one of {', '.join(BYTES_PER_PARAM)}")
    return n_params * BYTES_PER_PARAM[recipe]


OPTIMIZER_STATE = {"sgd": 0, "momentum": 1, "adam": 2}  # fp32 numbers kept per parameter
PRECISIONS = ("fp32", "mixed")


def bytes_per_param(optimizer: str = "adam", precision: str = "fp32") -> dict:
    """Bytes per parameter of weights, gradients, optimizer state (the ZeRO paper's 2+2+K).

    fp32: 4 + 4 + 4·(moments). mixed (fp16/bf16 weights and gradients for forward and
    backward): 2 + 2 + K, K = a 4-byte fp32 master copy + 4 per moment; Adam: K = 12, 16 in all.
    Lecture 03.
    """
    if optimizer not in OPTIMIZER_STATE or precision not in PRECISIONS:
        raise ValueError(
            f"optimizer must be one of {', '.join(OPTIMIZER_STATE)} and precision one of "
            f"{', '.join(PRECISIONS)}, not {optimizer!r}, {precision!r}"
        )
    moments = 4 * OPTIMIZER_STATE[optimizer]
    if precision == "fp32":
        return {"parameters": 4, "gradients": 4, "optimizer_state": moments}
    return {"parameters": 2, "gradients": 2, "optimizer_state": 4 + moments}


def state_bytes(n_params: int, optimizer: str = "adam", precision: str = "fp32") -> dict:
    """Bytes of parameters, gradients and optimizer state of one full replica, with total."""
    out = {k: n_params * v for k, v in bytes_per_param(optimizer, precision).items()}
    out["total"] = sum(out.values())
    return out


# -- measuring: every tensor this process holds, live ----------------------------------------

PARTS = ("parameters", "gradients", "optimizer_state", "activations", "inputs", "temporaries")


def _storage(t):
    """The storage holding ``t``'s numbers (a DTensor's: its local shard's)."""
    local = getattr(t, "_local_tensor", None)  # DTensor: the shard this rank holds
    return (local if local is not None else t).untyped_storage()


class track:  # noqa: N801 - a context manager used like a function
    """Measure memory live: every tensor storage alive in this process, after every operation.

        with helpers.memory.track(model, opt, x) as mem:
            loss_fn(model(x), y).backward(); opt.step()
        mem.now(), mem.peak      # bytes by part: parameters, gradients, optimizer_state,
                                 # activations (saved for backward), inputs (the tensors passed
                                 # in: the batch), temporaries (everything else)

    Tensors made inside the block are seen as they are created (a dispatch mode sees every
    operation's outputs); those made before must be passed in (a model, an optimizer, tensors).
    Sizes are read from the storages at every sample, so a storage FSDP frees with
    ``resize_(0)`` counts 0 bytes from then on. On a GPU this is what
    ``torch.cuda.memory_allocated`` counts, less the allocator's rounding. Lecture 03.
    """

    def __init__(self, model=None, optimizer=None, *tensors):
        self.model, self.optimizer, self.tensors = model, optimizer, tensors
        self.live: dict = {}  # id(storage) -> weakref to it
        self.saved: dict = {}  # id(storage) -> weakref: saved for backward by autograd
        self.peak: dict = dict.fromkeys((*PARTS, "total"), 0)
        self.phase_peak = 0  # the largest total since the last mark()
        self.timeline: list = []  # {"phase", **bytes by part at its end, "peak"} per mark()

    def _add(self, t, into=None) -> None:
        if not isinstance(t, torch.Tensor):
            return
        st = _storage(t)
        into = self.live if into is None else into
        key = id(st)
        if key not in into:
            into[key] = weakref.ref(st, lambda _, k=key, d=into: d.pop(k, None))

    def _known(self):
        """Storages of the model, its gradients and the optimizer's state, as of now."""
        params = list(self.model.parameters()) if self.model is not None else []
        if self.optimizer is not None:
            params += [p for g in self.optimizer.param_groups for p in g["params"]]
        state = (
            [v for s in self.optimizer.state.values() for v in s.values()]
            if self.optimizer is not None
            else []
        )
        return params, [p.grad for p in params if p.grad is not None], state

    def now(self) -> dict:
        """Bytes alive now, by part (each storage counted once, in the first part it is in)."""
        params, grads, state = self._known()
        for t in (*params, *grads, *state):  # made outside the block, e.g. by an optimizer hook
            self._add(t)
        out, seen = dict.fromkeys((*PARTS, "total"), 0), set()
        groups = (
            ("parameters", params),
            ("gradients", grads),
            ("optimizer_state", [v for v in state if isinstance(v, torch.Tensor)]),
            ("inputs", self.tensors),
        )
        for part, tensors in groups:
            for t in tensors:
                st = _storage(t)
                if id(st) not in seen:
                    seen.add(id(st))
                    out[part] += st.nbytes()
        for key, ref in list(self.live.items()):
            st = ref()
            if st is None or key in seen:
                continue
            part = "activations" if key in self.saved else "temporaries"
            out[part] += st.nbytes()
        out["total"] = sum(out[p] for p in PARTS)
        return out

    def _total(self) -> int:
        return sum(st.nbytes() for st in (r() for r in list(self.live.values())) if st is not None)

    def _sample(self) -> None:
        total = self._total()
        self.phase_peak = max(self.phase_peak, total)
        if total > self.peak["total"]:
            self.peak = self.now()

    def mark(self, phase: str) -> dict:
        """Record the bytes alive now, as the end of ``phase`` (e.g. 'forward'), and its peak."""
        snap = {"phase": phase, **self.now()}
        snap["peak"] = max(self.phase_peak, snap["total"])
        self.phase_peak = snap["total"]
        self.timeline.append(snap)
        return snap

    def __enter__(self) -> track:
        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if any(getattr(t, "__name__", "") == "DTensor" for t in types):
                    return NotImplemented  # let DTensor run its local ops; we see those
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    tracker._add(t)
                tracker._sample()
                return out

        for t in (*[x for group in self._known() for x in group], *self.tensors):
            self._add(t)
        if self.model is not None:
            for b in self.model.buffers():
                self._add(b)

        def pack(t):  # autograd keeps ``t`` for backward: it is an activation
            self._add(t, self.saved)
            return t

        self._mode = Mode()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        self._mode.__enter__()
        self._sample()
        self.phase_peak = self.peak["total"]
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._hooks.__exit__(*exc)
