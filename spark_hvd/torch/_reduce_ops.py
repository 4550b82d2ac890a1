"""allreduce (plain, grouped, sparse) and broadcast on torch tensors: the async
forms and the in-place ones, none of which records a gradient.

The differentiable forms (``mpi_ops.allreduce`` ...) run these inside the
autograd functions of ``_autograd``. Re-exported by ``mpi_ops``.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from spark_hvd import _ops
from spark_hvd._basics import ProcessSet, global_process_set
from spark_hvd._ops import Adasum, Average, Sum
from spark_hvd._types import OpType, ReduceOp
from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.torch._gather_ops import allgather_async
from spark_hvd.torch._handles import GroupHandle, Handle, _name, _submit, synchronize
from spark_hvd.torch._tensors import check, contiguous


# -- allreduce -------------------------------------------------------------------

def _allreduce_async(tensor, name: str, rop: ReduceOp, prescale: float, postscale: float,
                     process_set: ProcessSet, inplace: bool, result, what: str, group: str = "",
                     group_size: int = 0) -> Handle:
    """Allreduce of ``tensor`` into a new tensor, or into ``tensor`` when inplace;
    ``synchronize`` returns ``result`` (the caller's tensor) for the in-place form."""
    t = check(tensor, what)
    src = contiguous(t)
    if rop == Adasum and src.device.type != "cpu":
        return _adasum_staged(t, src, name, rop, prescale, postscale, process_set, inplace,
                              result, group, group_size)
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


def _adasum_staged(t, src, name, rop, prescale, postscale, process_set, inplace, result,
                   group, group_size) -> Handle:
    """op=Adasum on a GPU tensor: the core runs Adasum on host memory (as Horovod's CPU
    Adasum), so the tensor goes through a host copy and the result comes back to its
    device. ``to("cpu")`` waits for the work queued on the tensor's stream."""
    host = src.to("cpu")

    def finish(_r, t=t, host=host):
        if not inplace:
            return host.to(t.device)
        t.copy_(host)
        return result

    return _submit(OpType.ALLREDUCE, name, host, host, (host,), finish, reduce_op=rop,
                   prescale=prescale, postscale=postscale, process_set=process_set,
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
    return _ops.blocking(allreduce_async_, tensor, average, name, op, prescale_factor,
                         postscale_factor, process_set)


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
    return _ops.blocking(grouped_allreduce_async_, tensors, average, name, op, prescale_factor,
                         postscale_factor, process_set)


# -- sparse allreduce (allgather of indices and values) --------------------------------------

class SparseHandle(GroupHandle):
    """sparse_allreduce_async's handle: call it for the result, as Horovod's (a
    function there), or pass it to ``synchronize``/``poll`` like any handle."""

    __slots__ = ()

    def __call__(self) -> torch.Tensor:
        return synchronize(self)


def sparse_allreduce_async(tensor, name: Optional[str] = None, op=Average,
                           process_set: ProcessSet = global_process_set) -> SparseHandle:
    """Reduces a sparse COO tensor by gathering every rank's indices and values
    (Sum or Average); ``handle()`` (or ``synchronize(handle)``) returns a coalesced
    sparse tensor."""
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

    return SparseHandle([h_idx, h_val], finish)


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
    return _broadcast_async(tensor, root_rank, _name(name, "broadcast", process_set), process_set,
                            False, "broadcast")


def broadcast_async_(tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Starts overwriting ``tensor`` with root_rank's tensor."""
    return _broadcast_async(tensor, root_rank, _name(name, "broadcast", process_set), process_set,
                            True, "broadcast_")


def broadcast_(tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return _ops.blocking(broadcast_async_, tensor, root_rank, name, process_set)
