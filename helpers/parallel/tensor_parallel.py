"""Tensor parallelism: Megatron's MLP from column- and row-parallel linear layers. Lecture 04.

An MLP ``Linear(d, h) → act → Linear(h, d)`` on n ranks. The first layer is cut by *columns of
its output* (each rank holds h/n rows of the weight and computes h/n of the hidden features);
the activation works on those features locally; the second layer is cut by *rows of its input*
(each rank multiplies its h/n features by its slice of the weight), giving a partial sum of the
full output: one all-reduce adds them. Backward mirrors it: the input's gradient is a sum over
ranks, one all-reduce. Megatron-LM names the two operators

    f = copy_to_parallel      forward: identity          backward: all-reduce
    g = reduce_from_parallel  forward: all-reduce        backward: identity

so an MLP costs one all-reduce of a (batch, d) activation forward and one backward, whatever h:
compare data parallelism, which all-reduces every weight's gradient once per step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class _CopyToParallel(torch.autograd.Function):
    """f: the input goes to every rank of ``group`` unchanged; the gradients coming back are
    summed over the group (None: the world)."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    """g: partial outputs are summed over ``group`` (None: the world); the gradient goes back
    to each rank unchanged."""

    @staticmethod
    def forward(ctx, x, group=None):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_parallel(x, group=None):
    """Megatron's f over ``group`` (a mesh's "tp" group; None: every rank)."""
    return _CopyToParallel.apply(x, group)


def reduce_from_parallel(x, group=None):
    """Megatron's g over ``group`` (a mesh's "tp" group; None: every rank)."""
    return _ReduceFromParallel.apply(x, group)


class ColumnParallelLinear(nn.Module):
    """This rank's rows of ``Linear(d_in, d_out)``: out features [r·d_out/n, (r+1)·d_out/n)."""

    def __init__(self, weight_rows: torch.Tensor, bias_part: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight_rows.clone())
        self.bias = nn.Parameter(bias_part.clone())

    def forward(self, x):
        return F.linear(copy_to_parallel(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's columns of ``Linear(d_in, d_out)``; the bias is added once, after the sum."""

    def __init__(self, weight_cols: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight_cols.clone())
        self.bias = nn.Parameter(bias.clone())

    def forward(self, x_part):
        return reduce_from_parallel(F.linear(x_part, self.weight)) + self.bias


class ParallelMLP(nn.Module):
    """Column-parallel, activation, row-parallel: one all-reduce forward, one backward."""

    def __init__(self, column: ColumnParallelLinear, row: RowParallelLinear, act=None):
        super().__init__()
        self.column, self.row, self.act = column, row, act or nn.ReLU()

    def forward(self, x):
        return self.row(self.act(self.column(x)))


def shard(dense: nn.Sequential, rank: int, world_size: int) -> ParallelMLP:
    """This rank's part of ``Sequential(Linear(d, h), act, Linear(h, d))``; h divisible by n."""
    first, act, second = dense
    h = first.out_features
    if h % world_size:
        raise ValueError(f"hidden width {h} must be divisible by the {world_size} ranks")
    part = slice(rank * h // world_size, (rank + 1) * h // world_size)
    with torch.no_grad():
        column = ColumnParallelLinear(first.weight[part], first.bias[part])
        row = RowParallelLinear(second.weight[:, part], second.bias)
    return ParallelMLP(column, row, act)


def mlp(d: int, h: int, seed: int = 0) -> nn.Sequential:
    """The dense reference: ``Linear(d, h), ReLU, Linear(h, d)`` with seeded weights."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, d))


def allreduce_bytes_per_mlp(batch: int, d: int, itemsize: int = 4) -> dict:
    """Theory: the tensor each all-reduce carries, forward and backward (a (batch, d) tensor)."""
    one = batch * d * itemsize
    return {"forward": one, "backward": one, "step": 2 * one}
