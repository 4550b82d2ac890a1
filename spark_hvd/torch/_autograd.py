"""Gradients of the collectives: each backward is the dual collective.

With ranks r = 0..n-1 each holding x_r and a loss L = sum_r L_r(outputs on r):

* allreduce (Sum / Average, with scale factors): dL/dx_r is the same allreduce
  of the output gradients (Min, Max, Product and Adasum use their own op too,
  as Horovod does; that is not a true gradient for them).
* allgather: rank r's rows of the *summed* output gradient.
* broadcast: the summed gradient on the root, zero on every other rank (their
  input does not reach the output).
* alltoall: the output gradient sent back with an alltoall over the received
  splits.
* reducescatter: the allgather of the block gradients, times the forward's
  total scale (1/size for Average, prescale * postscale).

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
from spark_hvd.torch._handles import synchronize
from spark_hvd.torch._reduce_ops import allreduce_async, broadcast_async, grouped_allreduce_async
from spark_hvd.torch._tensors import row_offsets


def _grad_name(name):
    return f"{name}.grad" if name else None


class AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, process_set):
        ctx.args = (name, op, prescale, postscale, process_set)
        return synchronize(allreduce_async(tensor, None, name, op, prescale, postscale,
                                           process_set))

    @staticmethod
    def backward(ctx, grad):
        name, op, prescale, postscale, process_set = ctx.args
        g = synchronize(allreduce_async(grad.contiguous(), None, _grad_name(name), op,
                                        prescale, postscale, process_set))
        return g, None, None, None, None, None


class GroupedAllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale, postscale, process_set, *tensors):
        ctx.args = (name, op, prescale, postscale, process_set)
        return tuple(synchronize(grouped_allreduce_async(
            tensors, None, name, op, prescale, postscale, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        name, op, prescale, postscale, process_set = ctx.args
        gs = synchronize(grouped_allreduce_async(
            [g.contiguous() for g in grads], None, _grad_name(name), op, prescale, postscale,
            process_set))
        return (None, None, None, None, None, *gs)


def _allgather_backward(grad, rows, name, process_set):
    """This rank's rows of the summed gradient of an allgather output."""
    sizes = synchronize(allgather_async(
        torch.tensor([rows], dtype=torch.int64), f"{name}.sizes" if name else None,
        process_set)).tolist()
    summed = synchronize(allreduce_async(grad.contiguous(), None, name, ReduceOp.SUM,
                                         process_set=process_set))
    me = process_set.rank()
    start = row_offsets(sizes)[me]
    return summed.narrow(0, start, sizes[me])


class AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.args = (name, process_set)
        ctx.shape = tensor.shape
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        name, process_set = ctx.args
        rows = ctx.shape[0] if len(ctx.shape) else 1
        g = _allgather_backward(grad, rows, _grad_name(name), process_set)
        return g.reshape(ctx.shape), None, None


class GroupedAllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.args = (name, process_set)
        ctx.shapes = [t.shape for t in tensors]
        return tuple(synchronize(grouped_allgather_async(tensors, name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        name, process_set = ctx.args
        base = _grad_name(name) or _ops._name(None, "grouped_allgather.grad")
        out = []
        for i, (g, shape) in enumerate(zip(grads, ctx.shapes)):
            rows = shape[0] if len(shape) else 1
            out.append(_allgather_backward(g, rows, f"{base}.{i}", process_set).reshape(shape))
        return (None, None, *out)


class BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.args = (root_rank, name, process_set)
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        root_rank, name, process_set = ctx.args
        summed = synchronize(allreduce_async(grad.contiguous(), None, _grad_name(name),
                                             ReduceOp.SUM, process_set=process_set))
        if rank() != root_rank:  # a global rank, as in Horovod
            summed = torch.zeros_like(summed)
        return summed, None, None, None


class AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        ctx.args = (name, process_set)
        out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _grad_splits):
        name, process_set = ctx.args
        g, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received, _grad_name(name),
                                          process_set))
        return g, None, None, None


def _reducescatter_scale(op, process_set, prescale, postscale):
    scale = prescale * postscale
    if op == ReduceOp.AVERAGE:
        scale /= process_set.size()
    return scale


class ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale, postscale):
        ctx.args = (name, process_set, _reducescatter_scale(op, process_set, prescale, postscale))
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale,
                                               postscale))

    @staticmethod
    def backward(ctx, grad):
        name, process_set, scale = ctx.args
        g = synchronize(allgather_async(grad.contiguous(), _grad_name(name), process_set))
        return (g * scale if scale != 1.0 else g), None, None, None, None, None


class GroupedReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale, postscale, *tensors):
        ctx.args = (name, process_set, _reducescatter_scale(op, process_set, prescale, postscale))
        return tuple(synchronize(grouped_reducescatter_async(
            tensors, name, op, process_set, prescale, postscale)))

    @staticmethod
    def backward(ctx, *grads):
        name, process_set, scale = ctx.args
        gs = synchronize(grouped_allgather_async([g.contiguous() for g in grads],
                                                 _grad_name(name), process_set))
        return (None, None, None, None, None, *[g * scale if scale != 1.0 else g for g in gs])
