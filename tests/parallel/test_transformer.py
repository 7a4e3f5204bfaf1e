"""helpers.parallel.transformer: selective recomputation changes nothing but memory; the saved
bytes measured equal the activation formula; the tensor- and sequence-parallel block equals the
dense one, with the collectives and bytes of the theory and 1/t of the activations."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

import helpers
from helpers.parallel import transformer as tf

SIZES = [(8, 2, 16, 2), (16, 2, 32, 4), (12, 3, 24, 3)]  # (s, b, h, heads)


def _input(s, b, h, dtype=torch.float32):
    torch.manual_seed(1)
    return torch.randn(s, b, h, dtype=dtype, requires_grad=True)


def _measured(s, b, h, heads, **kw):
    return tf.saved_activation_bytes(tf.Block(h, heads, **kw), _input(s, b, h))


def _cpu_formula(s, b, h, heads, **kw):
    return sum(tf.activation_bytes_cpu_by_part(s, b, h, heads, **kw).values())


# -- one process ------------------------------------------------------------------------------


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_selective_recompute_gives_the_same_outputs_and_gradients(dropout):
    s, b, h, heads = 8, 2, 16, 4
    runs = []
    for recompute in ("none", "selective"):
        block = tf.Block(h, heads, dropout=dropout, recompute=recompute).double()
        x = _input(s, b, h, torch.float64)
        torch.manual_seed(2)  # the same dropout masks; checkpoint replays them in backward
        out = block(x)
        out.pow(2).sum().backward()
        runs.append((out, x.grad, {n: p.grad for n, p in block.named_parameters()}))
    (out0, dx0, g0), (out1, dx1, g1) = runs
    torch.testing.assert_close(out1, out0)
    torch.testing.assert_close(dx1, dx0)
    assert g1.keys() == g0.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name])


def test_the_formula_is_the_papers_closed_form():
    s, b, h, a, t = 2048, 1, 12288, 96, 8  # GPT-3 175B's layer, the paper's running example
    sbh = s * b * h
    assert tf.activation_bytes(s, b, h, a) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert tf.activation_bytes(s, b, h, a, tp=t) == pytest.approx(
        sbh * (10 + 24 / t + 5 * a * s / (h * t))
    )
    assert tf.activation_bytes(s, b, h, a, tp=t, sp=True) == pytest.approx(
        sbh / t * (34 + 5 * a * s / h)
    )
    assert tf.activation_bytes(s, b, h, a, recompute="selective", tp=t, sp=True) == pytest.approx(
        sbh / t * 34
    )
    with pytest.raises(ValueError, match="recompute"):
        tf.activation_bytes(s, b, h, a, recompute="full")


@pytest.mark.parametrize("s,b,h,heads", SIZES)
@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_measured_saved_bytes_equal_the_cpu_formula(s, b, h, heads, recompute, dropout):
    kw = {"recompute": recompute, "dropout": dropout}
    assert _measured(s, b, h, heads, **kw) == _cpu_formula(s, b, h, heads, **kw)


def test_each_module_saves_the_terms_the_formula_gives_it():
    s, b, h, heads = 16, 2, 32, 4
    got = tf.saved_activation_bytes(tf.Block(h, heads), _input(s, b, h), by_module=True)
    part = tf.activation_bytes_cpu_by_part(s, b, h, heads)
    assert (
        got["ln1"] + got["ln2"] == part["norms: LayerNorm inputs"] + part["norms: mean and 1/std"]
    )
    assert got["qkv"] == part["attention: QKV input"]
    assert got["core"] == (
        part["attention: Q, K (QK^T inputs)"]
        + part["attention: V"]
        + part["attention: softmax output"]
    )
    assert got["proj"] == part["attention: output projection input"]
    assert got["fc1"] == part["MLP: first linear input"]
    assert got["act"] == part["MLP: GELU input"]
    assert got["fc2"] == part["MLP: second linear input"]
    assert "(block)" not in got  # residuals, head reshapes and p = 0 dropout keep nothing


def test_the_scores_term_grows_with_s_squared_and_selective_recompute_removes_it():
    s, b, h, heads = 8, 2, 16, 2
    softmax = tf.activation_bytes_cpu_by_part(s, b, h, heads)["attention: softmax output"]
    # bytes(s) = A·s + B·s²: doubling s doubles the linear part and quadruples the s² part
    excess = _measured(2 * s, b, h, heads) - 2 * _measured(s, b, h, heads)
    assert excess == 2 * softmax == 2 * heads * s * s * b * 4
    saved = _measured(s, b, h, heads) - _measured(s, b, h, heads, recompute="selective")
    assert saved == softmax
    # and with selective recomputation the bytes are linear in s again
    assert _measured(2 * s, b, h, heads, recompute="selective") == 2 * _measured(
        s, b, h, heads, recompute="selective"
    )


def test_bad_arguments_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="recompute"):
        tf.Block(16, 2, recompute="full")
    with pytest.raises(ValueError, match="divisible by the 3 heads"):
        tf.Block(16, 3)
    with pytest.raises(ValueError, match="divisible by 4 ranks"):
        tf.TensorParallelBlock.from_dense(tf.Block(18, 6), 0, 4)
    with pytest.raises(ValueError, match="divisible by 3 ranks"):
        tf.sequence_shard(torch.zeros(8, 1, 1), 0, 3)


def test_sequence_parallelism_sends_what_the_all_reduces_did():
    s, b, h = 16, 2, 32
    for t in (2, 4, 8):
        plain = tf.comm_bytes_per_block(s, b, h, t, False)
        sp = tf.comm_bytes_per_block(s, b, h, t, True)
        assert sp["fg_total"] == plain["fg_total"] == 4 * 2 * (t - 1) / t * s * b * h * 4
        assert sp["backward"]["regather"]["bytes"] == 2 * (t - 1) / t * s * b * h * 4


# -- the tensor-parallel block on 2 and 4 ranks -----------------------------------------------

S, B, H, HEADS = 8, 2, 16, 4


def _tp_step(sequence_parallel):
    import torch.distributed as dist

    from helpers.launcher import watch

    rank, n = dist.get_rank(), dist.get_world_size()
    block = tf.TensorParallelBlock.from_dense(
        tf.Block(H, HEADS).double(), rank, n, sequence_parallel
    )
    x = _input(S, B, H, torch.float64).detach()
    x = (tf.sequence_shard(x, rank, n) if sequence_parallel else x).requires_grad_()
    # (not "selective" here: torch.utils.checkpoint's first call imports torch._dynamo, seconds
    # in every rank; the dense tests show what it removes)
    saved = tf.saved_activation_bytes(block, x)  # a forward of its own: its collectives
    block.comm.clear()  # ... are not this step's

    calls, phase = {"forward": [], "backward": [], "grads": []}, ["forward"]
    listener = lambda call: calls[phase[0]].append(call.op)  # noqa: E731
    watch.install()
    watch.STATE.listeners.append(listener)
    try:
        out = block(x)
        phase[0] = "backward"
        out.pow(2).sum().backward()  # under SP: this rank's tokens' share of the dense loss
        phase[0] = "grads"
        block.sync_sequence_parallel_grads()
    finally:
        watch.STATE.listeners.remove(listener)
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "grads": {name: p.grad for name, p in block.named_parameters()},
        "comm": block.comm,
        "calls": {k: Counter(v) for k, v in calls.items()},
        "saved": saved,
    }


def _tp_rank():
    return {sp: _tp_step(sp) for sp in (False, True)}


@functools.cache
def _launched(n):  # one world per size, both modes in it: starting ranks is the slow part
    return helpers.launch(_tp_rank, world_size=n, output="none")


def _tp_run(n, sequence_parallel):
    return [r[sequence_parallel] for r in _launched(n)]


@functools.cache
def _dense():
    block = tf.Block(H, HEADS).double()
    x = _input(S, B, H, torch.float64)
    out = block(x)
    out.pow(2).sum().backward()
    return out.detach(), x.grad, {name: p.grad for name, p in block.named_parameters()}


def _gathered(runs, name):
    """The dense-shaped gradient of ``name`` from the ranks' pieces."""
    pieces = [r["grads"][name] for r in runs]
    if name.startswith("qkv"):  # each rank: its heads' [q | k | v]; put the q's together, ...
        return torch.cat([torch.cat([p.chunk(3)[i] for p in pieces]) for i in range(3)])
    if name.startswith("fc1"):
        return torch.cat(pieces)
    if name in ("proj.weight", "fc2.weight"):
        return torch.cat(pieces, dim=1)
    for p in pieces[1:]:  # replicated: every rank must hold the same full gradient
        torch.testing.assert_close(p, pieces[0])
    return pieces[0]


PARAMETRIZE = pytest.mark.parametrize(
    "n,sp", [(2, False), (2, True), (4, False), (4, True)], ids=lambda v: str(v)
)


@PARAMETRIZE
def test_the_tensor_parallel_block_equals_the_dense_block(n, sp):
    runs = _tp_run(n, sp)
    out, x_grad, grads = _dense()
    if sp:  # each rank holds its s/n rows
        torch.testing.assert_close(torch.cat([r["out"] for r in runs]), out)
        torch.testing.assert_close(torch.cat([r["x_grad"] for r in runs]), x_grad)
    else:
        for r in runs:
            torch.testing.assert_close(r["out"], out)
            torch.testing.assert_close(r["x_grad"], x_grad)
    assert runs[0]["grads"].keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(_gathered(runs, name), grad, msg=name)


@PARAMETRIZE
def test_the_collectives_are_those_of_the_theory(n, sp):
    theory = tf.comm_bytes_per_block(S, B, H, n, sp, itemsize=8)
    expected = {
        phase: theory[phase] for phase in ("forward", "backward", "grads") if phase in theory
    }
    if sp:  # what torch.distributed was asked to do, seen by helpers.launcher.watch
        calls = {
            "forward": Counter(all_gather_into_tensor=2, reduce_scatter_tensor=2),
            "backward": Counter(all_gather_into_tensor=4, reduce_scatter_tensor=2),  # 2 regathers
            "grads": Counter(all_reduce=1),
        }
    else:
        calls = {"forward": Counter(all_reduce=2), "backward": Counter(all_reduce=2), "grads": {}}
    for r in _tp_run(n, sp):
        assert r["comm"] == expected
        assert r["calls"] == calls


@PARAMETRIZE
def test_each_rank_saves_the_activations_the_formula_predicts(n, sp):
    predicted = _cpu_formula(S, B, H, HEADS, itemsize=8, tp=n, sp=sp)
    assert [r["saved"] for r in _tp_run(n, sp)] == [predicted] * n


@pytest.mark.parametrize("n", [2, 4])
def test_sequence_parallelism_saves_activation_memory(n):
    with_sp, without = _tp_run(n, True)[0]["saved"], _tp_run(n, False)[0]["saved"]
    dense = _cpu_formula(S, B, H, HEADS, itemsize=8)
    assert with_sp < without < dense
    assert with_sp == dense / n  # everything is split, the norms' statistics too
