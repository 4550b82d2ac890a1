"""Collectives on torch tensors (CPU), as in ``horovod.torch.mpi_ops``.

Three shapes per op, as in Horovod:

* ``op(tensor, ...)`` returns a new tensor and is differentiable (see
  ``_autograd``); ``op_async(tensor, ...)`` returns a handle for
  ``synchronize``/``poll`` and does not record a gradient;
* ``op_(tensor, ...)`` / ``op_async_(tensor, ...)`` (allreduce, broadcast and
  their grouped forms) write the result into ``tensor`` itself.

Tensors reach the core as (dtype code, shape, data pointer); the handle keeps
every tensor whose pointer went to the core alive until the op completes.
Non-contiguous inputs are reduced through a contiguous copy (written back for
the in-place forms). Ops that return core-allocated outputs (allgather,
alltoall, reducescatter) give tensors sharing that buffer, no copy.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from spark_hvd import _ops
from spark_hvd._basics import ProcessSet, global_process_set
from spark_hvd._types import OpType, ReduceOp
from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.torch import _adasum
from spark_hvd.torch._gather_ops import (allgather, allgather_async, alltoall, alltoall_async,
                                         grouped_allgather, grouped_allgather_async,
                                         grouped_reducescatter, grouped_reducescatter_async,
                                         reducescatter, reducescatter_async)
from spark_hvd.torch._handles import GroupHandle, Handle, _name, _submit, poll, synchronize
from spark_hvd.torch._tensors import check, contiguous, from_result
from spark_hvd.torch.compression import Compression

from spark_hvd._ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401 - re-exported


# -- allreduce -------------------------------------------------------------------

def _allreduce_async(tensor, name: str, rop: ReduceOp, prescale: float, postscale: float,
                     process_set: ProcessSet, inplace: bool, result, what: str, group: str = "",
                     group_size: int = 0) -> Handle:
    """Allreduce of ``tensor`` into a new tensor, or into ``tensor`` when inplace;
    ``synchronize`` returns ``result`` (the caller's tensor) for the in-place form."""
    t = check(tensor, what)
    src = contiguous(t)
    if rop == Adasum:
        return _adasum_async(t, src, name, prescale, postscale, process_set, inplace, result,
                             group, group_size)
    out = src if inplace else torch.empty_like(src, memory_format=torch.contiguous_format)

    def finish(_r, t=t, out=out):
        if not inplace:
            return out
        if out is not t:  # reduced through a contiguous copy
            t.copy_(out)
        return result

    return _submit(OpType.ALLREDUCE, name, src, out, (src, out), finish, reduce_op=rop,
                   prescale=prescale, postscale=postscale, process_set=process_set,
                   group=group, group_size=group_size)


def _adasum_async(t, src, name, prescale, postscale, process_set, inplace, result, group,
                  group_size) -> Handle:
    _adasum.check_dtype(src)
    flat = src.reshape(-1)
    if prescale != 1.0:
        flat = flat * prescale

    def finish(r, t=t):
        combined = _adasum.combine_gathered(from_result(r, flat.dtype), t)
        if postscale != 1.0:
            combined = combined * postscale
        if inplace:
            t.copy_(combined)
            return result
        return combined

    return _submit(OpType.ALLGATHER, name, flat, None, (flat,), finish, process_set=process_set,
                   group=group, group_size=group_size)


def allreduce_async(tensor, average=None, name: Optional[str] = None, op=None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Starts reducing ``tensor`` across ranks (default Average) into a new tensor."""
    rop = _ops._reduce_op(op, average)
    return _allreduce_async(tensor, _name(name, "allreduce", process_set), rop, prescale_factor,
                            postscale_factor, process_set, False, None, "allreduce")


def allreduce_async_(tensor, average=None, name: Optional[str] = None, op=None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Starts reducing ``tensor`` across ranks in place."""
    rop = _ops._reduce_op(op, average)
    return _allreduce_async(tensor, _name(name, "allreduce", process_set), rop, prescale_factor,
                            postscale_factor, process_set, True, tensor, "allreduce_")


def allreduce_(tensor, average=None, name: Optional[str] = None, op=None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduces ``tensor`` across ranks in place and returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def allreduce(tensor, average=None, name: Optional[str] = None, compression=Compression.none,
              op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduces ``tensor`` across ranks (default Average) and returns the result.

    Differentiable: the gradient is the allreduce of the output's gradient with
    the same op and scale factors. ``compression`` compresses before the
    reduction and decompresses after.
    """
    from spark_hvd.torch._autograd import AllreduceFn

    rop = _ops._reduce_op(op, average)
    compressed, ctx = compression.compress(tensor)
    reduced = AllreduceFn.apply(compressed, name, rop, prescale_factor, postscale_factor,
                                process_set)
    return compression.decompress(reduced, ctx)


# -- grouped allreduce --------------------------------------------------------------

def _grouped_allreduce_async(tensors, name, rop, prescale, postscale, process_set, inplace,
                             what) -> GroupHandle:
    tensors = list(tensors)
    base = _name(name, "grouped_allreduce", process_set)
    with _ops.submit_together():
        handles = [_allreduce_async(t, f"{base}.{i}", rop, prescale, postscale, process_set,
                                    inplace, t, what, group=base, group_size=len(tensors))
                   for i, t in enumerate(tensors)]
    return GroupHandle(handles, list)


def grouped_allreduce_async(tensors, average=None, name: Optional[str] = None, op=None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> GroupHandle:
    """Starts one grouped allreduce of a list of tensors: negotiated and fused together."""
    return _grouped_allreduce_async(tensors, name, _ops._reduce_op(op, average),
                                    prescale_factor, postscale_factor, process_set, False,
                                    "grouped_allreduce")


def grouped_allreduce_async_(tensors, average=None, name: Optional[str] = None, op=None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> GroupHandle:
    return _grouped_allreduce_async(tensors, name, _ops._reduce_op(op, average),
                                    prescale_factor, postscale_factor, process_set, True,
                                    "grouped_allreduce_")


def grouped_allreduce_(tensors, average=None, name: Optional[str] = None, op=None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def grouped_allreduce(tensors, average=None, name: Optional[str] = None,
                      compression=Compression.none, op=None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """Differentiable allreduce of a list of tensors as one group."""
    from spark_hvd.torch._autograd import GroupedAllreduceFn

    tensors = list(tensors)
    rop = _ops._reduce_op(op, average)
    pairs = [compression.compress(t) for t in tensors]
    outs = GroupedAllreduceFn.apply(name, rop, prescale_factor, postscale_factor, process_set,
                                    *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


# -- sparse allreduce (allgather of indices and values) --------------------------------------

def sparse_allreduce_async(tensor, name: Optional[str] = None, op=Average,
                           process_set: ProcessSet = global_process_set) -> GroupHandle:
    """Reduces a sparse COO tensor by gathering every rank's indices and values
    (Sum or Average); ``synchronize`` returns a coalesced sparse tensor."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise InvalidArgumentError("sparse_allreduce_async takes a sparse COO tensor")
    if op not in (Sum, Average):
        raise InvalidArgumentError("sparse_allreduce_async supports op=Sum or op=Average")
    check(torch.empty(0, dtype=tensor.dtype, device=tensor.device), "sparse_allreduce_async")
    sp = tensor.detach().coalesce()
    base = _name(name, "sparse_allreduce", process_set)
    indices = sp.indices().t().contiguous()  # rows = nonzeros, as allgather concatenates rows
    values = sp.values().contiguous()
    with _ops.submit_together():
        h_idx = allgather_async(indices, f"{base}.indices", process_set)
        h_val = allgather_async(values, f"{base}.values", process_set)
    n = process_set.size()

    def finish(results):
        idx, val = results
        out = torch.sparse_coo_tensor(idx.t(), val, sp.shape, dtype=sp.dtype).coalesce()
        return out / n if op == Average else out

    return GroupHandle([h_idx, h_val], finish)


# -- broadcast -------------------------------------------------------------------

def _broadcast_async(tensor, root_rank: int, name: str, process_set: ProcessSet,
                     inplace: bool, what: str) -> Handle:
    t = check(tensor, what)
    if inplace:
        buf = contiguous(t)
    else:
        buf = t.clone(memory_format=torch.contiguous_format)

    def finish(_r, t=t, buf=buf):
        if not inplace:
            return buf
        if buf is not t:
            t.copy_(buf)
        return tensor

    return _submit(OpType.BROADCAST, name, buf, buf, (buf,), finish, root=root_rank,
                   process_set=process_set)


def broadcast_async(tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Starts sending root_rank's tensor to every rank (into a new tensor)."""
    return _broadcast_async(tensor, root_rank, _name(name, "broadcast", process_set), process_set, False,
                            "broadcast")


def broadcast_async_(tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Starts overwriting ``tensor`` with root_rank's tensor."""
    return _broadcast_async(tensor, root_rank, _name(name, "broadcast", process_set), process_set, True,
                            "broadcast_")


def broadcast_(tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast(tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Returns root_rank's tensor on every rank. Differentiable: the gradient is
    the sum of every rank's gradient on root_rank, zero elsewhere."""
    from spark_hvd.torch._autograd import BroadcastFn

    return BroadcastFn.apply(tensor, root_rank, name, process_set)


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
