"""Collectives on torch tensors (CPU and CUDA), as in ``horovod.torch.mpi_ops``.

Three shapes per op, as in Horovod:

* ``op(tensor, ...)`` returns a new tensor and is differentiable (see
  ``_autograd``); ``op_async(tensor, ...)`` returns a handle for
  ``synchronize``/``poll`` and does not record a gradient;
* ``op_(tensor, ...)`` / ``op_async_(tensor, ...)`` (allreduce, broadcast and
  their grouped forms) write the result into ``tensor`` itself.

The async and in-place forms live in ``_reduce_ops`` and ``_gather_ops``, the
gradients in ``_autograd``; this module puts the differentiable forms on top and
re-exports the rest.

Tensors reach the core as (dtype code, shape, data pointer, device, stream) with an
owner: the core itself holds every tensor whose pointer it got until it is done with
the op, whatever happens to the handle (dropping one is safe). Non-contiguous inputs
are reduced through a contiguous copy (written back for the in-place forms). Ops that
return core-allocated outputs (allgather, alltoall, reducescatter) give tensors sharing
that buffer, no copy (CUDA ones through DLPack).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from spark_hvd import _ops
from spark_hvd._basics import ProcessSet, global_process_set
from spark_hvd.torch._autograd import (AllgatherFn, AllreduceFn, AlltoallFn, BroadcastFn,
                                       GroupedAllgatherFn, GroupedAllreduceFn,
                                       GroupedReducescatterFn, ReducescatterFn)
from spark_hvd.torch._gather_ops import (allgather_async, alltoall_async,
                                         grouped_allgather_async, grouped_reducescatter_async,
                                         reducescatter_async)
from spark_hvd.torch._handles import GroupHandle, Handle, poll, synchronize
from spark_hvd.torch._reduce_ops import (allreduce_, allreduce_async, allreduce_async_,
                                         broadcast_, broadcast_async, broadcast_async_,
                                         grouped_allreduce_, grouped_allreduce_async,
                                         grouped_allreduce_async_, sparse_allreduce_async)
from spark_hvd.torch.compression import Compression

from spark_hvd._ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401 - re-exported
# Horovod's torch.mpi_ops has these names too (scripts import them from there).
from spark_hvd.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401,E402


# -- the differentiable forms (gradients: _autograd) -------------------------------------

def _records_grad(tensor) -> bool:
    """Whether an op on ``tensor`` goes into the autograd graph. When not, the forms
    below run the async op directly: torch's Function.apply costs ~10 us per call and
    would give the same tensor, with no history."""
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


def allreduce(tensor, average=None, name: Optional[str] = None, compression=Compression.none,
              op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduces ``tensor`` across ranks (default Average) and returns the result.

    Differentiable: the gradient is the allreduce of the output's gradient with
    the same op and scale factors. ``compression`` compresses before the
    reduction and decompresses after.
    """
    rop = _ops._reduce_op(op, average)
    compressed, ctx = compression.compress(tensor)
    if _records_grad(compressed):
        reduced = AllreduceFn.apply(compressed, name, rop, prescale_factor, postscale_factor,
                                    process_set)
    else:
        reduced = _ops.blocking(allreduce_async, compressed, None, name, rop, prescale_factor,
                                postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors, average=None, name: Optional[str] = None,
                      compression=Compression.none, op=None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """Differentiable allreduce of a list of tensors as one group."""
    tensors = list(tensors)
    rop = _ops._reduce_op(op, average)
    pairs = [compression.compress(t) for t in tensors]
    outs = GroupedAllreduceFn.apply(name, rop, prescale_factor, postscale_factor, process_set,
                                    *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def broadcast(tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Returns root_rank's tensor on every rank. Differentiable as in Horovod: the
    gradient is the average of every rank's gradient on root_rank, zero elsewhere."""
    if _records_grad(tensor):
        return BroadcastFn.apply(tensor, root_rank, name, process_set)
    return _ops.blocking(broadcast_async, tensor, root_rank, name, process_set)


def allgather(tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenates every rank's tensor along the first dimension (sizes may
    differ). Differentiable as in Horovod: a rank's gradient is its rows of the
    averaged output gradient."""
    if _records_grad(tensor):
        return AllgatherFn.apply(tensor, name, process_set)
    return _ops.blocking(allgather_async, tensor, name, process_set)


def grouped_allgather(tensors, name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    return list(GroupedAllgatherFn.apply(name, process_set, *tensors))


def alltoall(tensor, splits=None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set):
    """Sends splits[i] rows of ``tensor`` to rank i (even splits when None).

    Returns the received rows, in rank order; when ``splits`` was given, returns
    ``(rows, received_splits)`` as Horovod does. Differentiable: the gradient
    goes back through an alltoall with the received splits.
    """
    out, received = AlltoallFn.apply(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


def reducescatter(tensor, name: Optional[str] = None, compression=Compression.none, op=Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduces across ranks (default Average) and returns this rank's block of
    rows. Differentiable as in Horovod: the gradient is the allgather of the blocks'
    gradients, times the scale factors and, for Sum, the process set's size."""
    compressed, ctx = compression.compress(tensor)
    out = ReducescatterFn.apply(compressed, name, _ops._reduce_op(op, None), process_set,
                                prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors, name: Optional[str] = None, compression=Compression.none,
                          op=Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    pairs = [compression.compress(t) for t in tensors]
    outs = GroupedReducescatterFn.apply(name, _ops._reduce_op(op, None), process_set,
                                        prescale_factor, postscale_factor,
                                        *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


# -- control ---------------------------------------------------------------------

def join(device: int = -1) -> int:
    """Marks this rank as out of data; returns the last rank to join once all have.

    Until then this rank takes part in other ranks' allreduces with neutral
    values (and in allgathers with zero rows). ``device`` is accepted for
    Horovod compatibility; CPU only.
    """
    return _ops.join(device)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Returns once every rank of the set has called barrier."""
    _ops.barrier(process_set)


__all__ = [
    "Sum", "Average", "Min", "Max", "Product", "Adasum", "Handle", "GroupHandle", "poll",
    "synchronize", "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_",
    "grouped_allreduce_async_", "sparse_allreduce_async", "allgather", "allgather_async",
    "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_async", "broadcast_",
    "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "join", "barrier",
]
