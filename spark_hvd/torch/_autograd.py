"""Gradients of the collectives, as Horovod's torch autograd Functions define them.

With ranks r = 0..n-1 of the process set each holding x_r, these are Horovod's
formulas (horovod/torch/mpi_ops.py, HorovodAllreduce ... HorovodGroupedReducescatter),
kept exactly even where they are not the true gradient of a global loss sum_r L_r:

* allreduce (any op, with scale factors): the same allreduce of the output
  gradients.
* allgather (and each tensor of a grouped allgather): rank r's rows of the
  *Average* allreduce of the output gradients, i.e. 1/n of the true gradient.
* broadcast: the Average allreduce of the output gradients on the root (a global
  rank, compared with ``rank()``), zero on every other rank.
* alltoall: the output gradient sent back with an alltoall over the received
  splits.
* reducescatter (and each tensor of a grouped one): the allgather of the block
  gradients times prescale * postscale, and times n as well for Sum; so Sum gives
  n times the true gradient and Average the true one times n * (1/n) = 1.

Backward ops are named ``<forward name>.grad`` when the forward was named, so
repeated steps hit the core's response cache; otherwise they get generated
names, identical across ranks because every rank runs the same backward.
"""

from __future__ import annotations

import torch

from spark_hvd import _ops
from spark_hvd._basics import rank
from spark_hvd._types import ReduceOp
from spark_hvd.torch._gather_ops import (allgather_async, alltoall_async, grouped_allgather_async,
                                         grouped_reducescatter_async, reducescatter_async)
from spark_hvd.torch._reduce_ops import allreduce_async, broadcast_async, grouped_allreduce_async


def _grad_name(name):
    return f"{name}.grad" if name else None


class AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, process_set):
        ctx.args = (name, op, prescale, postscale, process_set)
        return _ops.blocking(allreduce_async, tensor, None, name, op, prescale, postscale,
                             process_set)

    @staticmethod
    def backward(ctx, grad):
        name, op, prescale, postscale, process_set = ctx.args
        g = _ops.blocking(allreduce_async, grad.contiguous(), None, _grad_name(name), op,
                          prescale, postscale, process_set)
        return g, None, None, None, None, None


class GroupedAllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale, postscale, process_set, *tensors):
        ctx.args = (name, op, prescale, postscale, process_set)
        return tuple(_ops.blocking(grouped_allreduce_async,
                                   tensors, None, name, op, prescale, postscale, process_set))

    @staticmethod
    def backward(ctx, *grads):
        name, op, prescale, postscale, process_set = ctx.args
        gs = _ops.blocking(grouped_allreduce_async, [g.contiguous() for g in grads], None,
                           _grad_name(name), op, prescale, postscale, process_set)
        return (None, None, None, None, None, *gs)


def _own_rows(grads, rows, name, process_set):
    """This rank's rows of the Average allreduce of each allgather output gradient.

    ``rows`` are this rank's first dimensions, one per gathered tensor; one
    allgather of them gives every rank's offsets.
    """
    k = len(rows)
    every = _ops.blocking(allgather_async, torch.tensor([rows], dtype=torch.int64),
                          f"{name}.sizes" if name else None, process_set).reshape(-1, k)
    averaged = _ops.blocking(grouped_allreduce_async,
                             [g.contiguous() for g in grads], None, name, ReduceOp.AVERAGE,
                             process_set=process_set)
    me = process_set.rank()
    starts = every[:me].sum(dim=0).tolist()
    return [g.narrow(0, start, n) for g, start, n in zip(averaged, starts, rows)]


def _rows(shape):
    return shape[0] if len(shape) else 1


class AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.args = (name, process_set)
        ctx.shape = tensor.shape
        return _ops.blocking(allgather_async, tensor, name, process_set)

    @staticmethod
    def backward(ctx, grad):
        name, process_set = ctx.args
        g, = _own_rows([grad], [_rows(ctx.shape)], _grad_name(name), process_set)
        return g.reshape(ctx.shape), None, None


class GroupedAllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.args = (name, process_set)
        ctx.shapes = [t.shape for t in tensors]
        return tuple(_ops.blocking(grouped_allgather_async, tensors, name, process_set))

    @staticmethod
    def backward(ctx, *grads):
        name, process_set = ctx.args
        name = _grad_name(name) or _ops._name(None, "grouped_allgather.grad", process_set)
        gs = _own_rows(grads, [_rows(s) for s in ctx.shapes], name, process_set)
        return (None, None, *[g.reshape(s) for g, s in zip(gs, ctx.shapes)])


class BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.args = (root_rank, name, process_set)
        return _ops.blocking(broadcast_async, tensor, root_rank, name, process_set)

    @staticmethod
    def backward(ctx, grad):
        root_rank, name, process_set = ctx.args
        averaged = _ops.blocking(allreduce_async, grad.contiguous(), None, _grad_name(name),
                                 ReduceOp.AVERAGE, process_set=process_set)
        if rank() != root_rank:  # a global rank, as in Horovod
            averaged = torch.zeros_like(averaged)
        return averaged, None, None, None


class AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        ctx.args, ctx.rows = (name, process_set), tensor.shape[0]
        out, received = _ops.blocking(alltoall_async, tensor, splits, name, process_set)
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _grad_splits):
        name, process_set = ctx.args
        g, _ = _ops.blocking(alltoall_async, grad.contiguous(), ctx.received, _grad_name(name),
                             process_set)
        if g.shape[0] < ctx.rows:  # rows after the splits' sum were not sent
            g = torch.cat([g, g.new_zeros((ctx.rows - g.shape[0],) + tuple(g.shape[1:]))])
        return g, None, None, None


def _reducescatter_scale(op, process_set, prescale, postscale):
    """Horovod's factor on a reducescatter's allgathered gradient: the set's size
    for Sum (none for Average), times both scale factors."""
    scale = prescale * postscale
    if op == ReduceOp.SUM:
        scale *= process_set.size()
    return scale


class ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale, postscale):
        ctx.args = (name, process_set, _reducescatter_scale(op, process_set, prescale, postscale))
        return _ops.blocking(reducescatter_async, tensor, name, op, process_set, prescale,
                             postscale)

    @staticmethod
    def backward(ctx, grad):
        name, process_set, scale = ctx.args
        g = _ops.blocking(allgather_async, grad.contiguous(), _grad_name(name), process_set)
        return (g * scale if scale != 1.0 else g), None, None, None, None, None


class GroupedReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale, postscale, *tensors):
        ctx.args = (name, process_set, _reducescatter_scale(op, process_set, prescale, postscale))
        return tuple(_ops.blocking(grouped_reducescatter_async,
                                   tensors, name, op, process_set, prescale, postscale))

    @staticmethod
    def backward(ctx, *grads):
        name, process_set, scale = ctx.args
        gs = _ops.blocking(grouped_allgather_async, [g.contiguous() for g in grads],
                           _grad_name(name), process_set)
        return (None, None, None, None, None, *[g * scale if scale != 1.0 else g for g in gs])
