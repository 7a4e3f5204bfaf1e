"""Lab 07's harness: the student's merge, ring, dispatch/combine and sequence-parallel region run
on seeded inputs, on real gloo ranks, with what each one moved, kept and called noted beside its
results.

Every function takes the student's code as its first argument(s) and returns plain data (tensors,
lists, numbers): the probe of a test cell hands that data to the check, which judges it against
the references the check computes itself (``helpers.labs.lab07_checks``). Nothing here decides a
verdict: this code runs where the student's does (their kernel, their ranks), so it can be
redefined there, and its results are the student's to choose (docs/threat-model.md). The lab's
locked cells wrap these in one-line functions (``ring_runs``...) that launch the ranks.

The ``*_run`` functions run inside a rank started by ``helpers.launch``; the student's functions
travel there by value (cloudpickle), the harness by reference.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.labs.finished import finished_calls
from helpers.measure.tracing import trace
from helpers.parallel import context, moe, tensor_parallel, transformer

MATMULS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::matmul")
MASKS = ("none", "causal", "anti-causal")


# -- part 1: the merge, in the kernel ----------------------------------------------------------


def sees(s: int, mask: str) -> torch.Tensor:
    """(s, s) bool: query i sees key j, for every mask the merge test draws."""
    i = torch.arange(s)
    return {
        "none": torch.ones(s, s, dtype=torch.bool),
        "causal": i[:, None] >= i[None, :],
        "anti-causal": i[:, None] <= i[None, :],
    }[mask]


def merge_case(merge, b, heads, s, d, split, mask="none", scale=1.0, seed=0, queries=None):
    """``merge`` of the attention over keys [0, split) and over [split, s) of seeded q, k, v.

    ``mask``: "none"; "causal" (rows before ``split`` see nothing of the second block);
    "anti-causal" (rows from ``split`` on see nothing of the first). ``scale`` multiplies the
    queries: at 300 the lse values run into the hundreds and thousands. ``queries``: only the
    last that many query rows (default all s; 1, as when decoding a token).
    Returns {"merged": [out, lse], "finished": the course's merge if ``merge`` called it}."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, heads, s, d, generator=g) for _ in range(3))
    rows = slice(s - (queries or s), s)
    q, seen = q[:, :, rows], sees(s, mask)[rows]  # (b, heads, queries, d), (queries, s)
    first = context.attention_with_lse(q * scale, k[:, :, :split], v[:, :, :split], seen[:, :split])
    second = context.attention_with_lse(
        q * scale, k[:, :, split:], v[:, :, split:], seen[:, split:]
    )
    merged, called = finished_calls(merge, [context.merge], *first, *second)
    return {"merged": list(merged), "finished": called}


# -- part 2: the ring, in a rank ---------------------------------------------------------------


class RingWatch(TorchDispatchMode):
    """While on: the messages sent and received ([peer, bytes] each), the receives in flight
    (posted, not yet waited for) during which a matrix product ran, and the largest operand or
    result of any matrix product. ``isend``, ``irecv`` and ``Work.wait`` are replaced in
    ``torch.distributed`` and in ``distributed_c10d`` (P2POp and batch_isend_irecv call those),
    so either form of the ring is counted."""

    def __init__(self):
        super().__init__()
        self.sends, self.recvs, self.biggest = [], [], 0
        self.flying, self.kept, self.overlapped = {}, [], set()
        self.real = dist.isend, dist.irecv, dist.Work.wait

    def isend(self, tensor, dst=None, *args, **kwargs):
        self.sends.append([kwargs.get("group_dst", dst), tensor.numel() * tensor.element_size()])
        return self.real[0](tensor, dst, *args, **kwargs)

    def irecv(self, tensor, src=None, *args, **kwargs):
        self.recvs.append([kwargs.get("group_src", src), tensor.numel() * tensor.element_size()])
        work = self.real[1](tensor, src, *args, **kwargs)
        self.flying[id(work)] = len(self.recvs) - 1
        self.kept.append(work)  # alive to the end: no later request takes its id
        return work

    def __enter__(self):
        watch, wait = self, self.real[2]

        def waited(work, *args, **kwargs):  # any request's wait(), however reached, ends its flight
            watch.flying.pop(id(work), None)
            return wait(work, *args, **kwargs)

        dist.isend = c10d.isend = self.isend
        dist.irecv = c10d.irecv = self.irecv
        dist.Work.wait = waited
        return super().__enter__()

    def __exit__(self, *exc):
        dist.isend = c10d.isend = self.real[0]
        dist.irecv = c10d.irecv = self.real[1]
        dist.Work.wait = self.real[2]
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name in MATMULS or "scaled_dot_product" in name:
            flat = [*args, *(out if isinstance(out, (tuple, list)) else [out])]
            sizes = [t.numel() for t in flat if isinstance(t, torch.Tensor)]
            self.biggest = max([self.biggest, *sizes])
            self.overlapped.update(self.flying.values())  # computed while these were on their way
        return out


def ring_run(ring_attention, s, causal, d=4, seed=0, b=1, heads=2):
    """``ring_attention`` on this rank's chunk of seeded q, k, v (b, heads, s, d): its output,
    the messages it sent and received, any other communication call, the largest matrix
    product and the receives a matrix product ran beside (``RingWatch``)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, heads, s, d, generator=g) for _ in range(3))
    chunks = [context.split(t, rank, n).clone() for t in (q, k, v)]
    del q, k, v  # no whole sequence left in the rank
    finished = [context.ring_attention, context._accumulate, context._plan, context.merge]
    with RingWatch() as watch, trace() as calls:  # send, recv, collectives: none expected
        out, called = finished_calls(ring_attention, finished, *chunks, causal=causal)
    other = [c["op"] for c in calls.records if c["op"] != "batch_isend_irecv"]  # sends counted
    return {
        "out": out,
        "sends": watch.sends,
        "recvs": watch.recvs,
        "other": other,
        "biggest": watch.biggest,
        "finished": called,
        "overlapped": sorted(watch.overlapped),
    }


def work_run(s, heads, d):
    """(query, key) scores this rank computes in the lecture's causal ring, in each layout."""
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, s, d, generator=g) for _ in range(3))
    pairs = {}
    for layout in context.LAYOUTS:
        mine = [context.split(t, rank, n, layout) for t in (q, k, v)]
        _, stats = context.ring_attention(*mine, causal=True, layout=layout, stats=True)
        pairs[layout] = stats["pairs"]
    return pairs


# -- part 3: experts on other ranks, in a rank -------------------------------------------------


def moe_run(dispatch, combine, tokens, top_k, factor, n_experts=4, seed=0, d=6, hidden=8):
    """One forward and backward of the expert-parallel layer made of ``dispatch`` and
    ``combine``, in float64, on tokens + rank seeded tokens: outputs, gradients and the calls
    that moved rows."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dense = moe.MoE(d, hidden, n_experts, top_k, factor, seed=seed).double()  # same on every rank
    per = n_experts // n
    router = copy.deepcopy(dense.router)  # a full copy of the router
    experts = nn.ModuleList(copy.deepcopy(dense.experts[rank * per + i]) for i in range(per))
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(tokens + rank, d, dtype=torch.float64, generator=g).requires_grad_()
    dy = torch.randn(tokens + rank, d, dtype=torch.float64, generator=g)  # dL/dy
    routing = moe.route(router(x), top_k, moe.capacity(len(x), n_experts, top_k, factor))

    def layer():
        h, which, plan = dispatch(x, routing, n)
        y = combine(moe.run_experts(experts, h, which), routing, plan, len(x))
        (y * dy).sum().backward()
        return y

    # the course's finished layer and its pieces: the question is to write them
    layer_fns = vars(moe.ExpertParallelMoE).values()
    finished = [f for f in layer_fns if hasattr(getattr(f, "__func__", f), "__code__")]
    with trace() as calls:
        y, called = finished_calls(layer, [*finished, moe.combine, moe.dispatch_order])
    return {
        "y": y.detach(),
        "x": x.grad,
        "dropped": int((~routing.keep).sum()),
        "finished": called,
        "router": [p.grad for p in router.parameters()],
        "experts": [[p.grad for p in e.parameters()] for e in experts],
        "calls": [[c["op"], c["tensors"], c["bytes"]] for c in calls.records],
    }


def moe_bytes_run(dispatch, tokens, factor, d, n_experts, top_k, hidden=64):
    """Bytes ``dispatch`` sends from this rank to the others in one forward, float32, counted
    from the split sizes it hands to ``all_to_all_single``."""
    rank, n = dist.get_rank(), dist.get_world_size()
    layer = moe.MoE(d, hidden, n_experts, top_k, factor, seed=0)
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(rank))
    routing = moe.route(layer.router(x), top_k, moe.capacity(tokens, n_experts, top_k, factor))
    leaving, real = [], dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        if input.is_floating_point():  # token rows, not the counts
            splits = list(input_split_sizes or [len(input) // n] * n)
            row = math.prod(input.shape[1:]) * input.element_size()
            leaving.append((sum(splits) - splits[rank]) * row)
        return real(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)

    dist.all_to_all_single = counted
    try:
        with torch.no_grad():
            dispatch(x, routing, n)
    finally:
        dist.all_to_all_single = real
    return {"sent": leaving[0], "dropped": int((~routing.keep).sum())}


# -- part 4: the sequence-parallel region, in a rank -------------------------------------------


def dense_region(s, b, h, ffn, seed=0):
    """The seeded dense Linear(h, ffn) → GELU → Linear(ffn, h) and its (s, b, h) input, the same
    in every rank and in the check."""
    torch.manual_seed(seed)
    dense = nn.Sequential(nn.Linear(h, ffn), nn.GELU(), nn.Linear(ffn, h))
    x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(seed + 1))  # (s, b, h)
    return dense, x


def output_weights(s, b, h):
    """(s, b, h): what the backward weights each output element by, so no two rows alike."""
    return torch.arange(s * b * h).view(s, b, h).sin()


class Region(nn.Module):
    """This rank's columns of a dense region, run by the student's ``sp_region``."""

    def __init__(self, sp_region, dense, part):
        super().__init__()
        self.sp_region = sp_region
        self.w1 = nn.Parameter(dense[0].weight[part].detach().clone())
        self.b1 = nn.Parameter(dense[0].bias[part].detach().clone())
        self.w2 = nn.Parameter(dense[2].weight[:, part].detach().clone())
        self.b2 = nn.Parameter(dense[2].bias.detach().clone())

    def forward(self, x_shard):
        return self.sp_region(x_shard, self.w1, self.b1, self.w2, self.b2)


class Kept:
    """The storages a forward keeps for backward, counted once each (parameters excluded):
    those saved through autograd's hooks and any tensor held as an attribute of a ctx."""

    def __init__(self, params):
        self.params, self.seen, self.kept = params, {}, []

    def held(self, tensor):
        st = tensor.untyped_storage()
        if st.data_ptr() not in self.params and st.data_ptr() not in self.seen:
            self.seen[st.data_ptr()] = st.nbytes()
            self.kept.append(st)  # held until counted: a freed address could be reused
        return tensor

    def graph(self, y) -> None:
        """Every tensor a node of y's graph holds: a custom Function's node is its ctx."""
        nodes, todo = set(), [y.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in nodes:
                continue
            nodes.add(node)
            for value in getattr(node, "__dict__", {}).values():
                if isinstance(value, dict):
                    value = list(value.values())
                for tensor in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(tensor, torch.Tensor):
                        self.held(tensor)
            todo.extend(f for f, _ in node.next_functions)

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())


SP_FINISHED = (
    "_all_gather_s",
    "_reduce_scatter_s",
    "_GatherLinear.forward",
    "_GatherLinear.backward",
    "_ReduceScatter.forward",
    "_ReduceScatter.backward",
    "SequenceParallelColumnLinear.forward",
    "SequenceParallelRowLinear.forward",
)


def _finished_sp() -> list:
    def get(path):
        obj = transformer
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj

    return [get(path) for path in SP_FINISHED]


def sp_run(sp_region, s, b, h, ffn, seed=0):
    """``sp_region`` on this rank's rows of a seeded (s, b, h) input and its columns of a seeded
    dense region: output, gradients, the collectives forward and backward, the bytes it keeps
    for backward."""
    rank, t = dist.get_rank(), dist.get_world_size()
    dense, x = dense_region(s, b, h, ffn, seed)
    part, rows = (
        slice(rank * ffn // t, (rank + 1) * ffn // t),
        slice(rank * s // t, (rank + 1) * s // t),
    )
    region = Region(sp_region, dense, part)
    x_shard = x[rows].clone().requires_grad_()  # (s/t, b, h), a storage of its own
    del x, dense
    kept = Kept({p.untyped_storage().data_ptr() for p in region.parameters()})
    with trace() as forward, torch.autograd.graph.saved_tensors_hooks(kept.held, lambda t_: t_):
        y, called = finished_calls(region, _finished_sp(), x_shard)  # one forward, traced
    kept.graph(y)
    with trace() as backward:
        (y * output_weights(s, b, h)[rows]).sum().backward()

    def calls(rec):
        return [[c["op"], c["bytes"]] for c in rec.records]

    grads = {name: getattr(region, name).grad for name in ("w1", "b1", "w2", "b2")}
    return {"y": y.detach(), "x": x_shard.grad, **grads, "forward": calls(forward),
            "backward": calls(backward), "saved": kept.bytes, "finished": called}  # fmt: skip


def activation_run(sp_region, seq_lens, h, ffn):
    """Bytes saved for backward on this rank, one sequence at each of ``seq_lens``: the
    student's SP region, lecture 04's all-reduce (TP) region on the same weights, one process."""
    rank, t = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(h, ffn), nn.GELU(), nn.Linear(ffn, h))
    tp = tensor_parallel.shard(dense, rank, t)  # f, column, GELU, row, g: lecture 04's region

    class SequenceParallel(nn.Module):
        def __init__(self):
            super().__init__()
            self.column, self.row = tp.column, tp.row  # the same shards of the weights

        def forward(self, x_shard):
            c, r = self.column, self.row
            return sp_region(x_shard, c.weight, c.bias, r.weight, r.bias)

    sp = SequenceParallel()
    out = []
    for s in seq_lens:
        x = torch.randn(s, 1, h, generator=torch.Generator().manual_seed(s))  # (s, b, h)
        shard = transformer.sequence_shard(x, rank, t)
        out.append({"SP": transformer.saved_activation_bytes(sp, shard),
                    "TP": transformer.saved_activation_bytes(tp, x),
                    "one process": transformer.saved_activation_bytes(dense, x)})  # fmt: skip
    return out
