"""allgather, alltoall and reducescatter (and grouped forms) on torch tensors: the
async forms, which record no gradient.

Their outputs are allocated by the core (allgather, alltoall) and returned as
tensors sharing that buffer. The differentiable forms (``mpi_ops.allgather`` ...)
run these inside the autograd functions of ``_autograd``. Re-exported by ``mpi_ops``.
"""

from __future__ import annotations

from typing import Optional

import torch

from spark_hvd import _ops
from spark_hvd._basics import ProcessSet, global_process_set
from spark_hvd._rules import alltoall_splits, check_splits_tensor
from spark_hvd._types import OpType, ReduceOp
from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.torch._handles import GroupHandle, Handle, _name, _submit
from spark_hvd.torch._tensors import check, contiguous, from_result

Average = ReduceOp.AVERAGE
Adasum = ReduceOp.ADASUM


# -- allgather -------------------------------------------------------------------

def allgather_async(tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Starts concatenating every rank's tensor along the first dimension."""
    t = contiguous(check(tensor, "allgather"))
    if t.dim() == 0:
        t = t.reshape(1)
    return _submit(OpType.ALLGATHER, _name(name, "allgather", process_set), t, None, (t,),
                   lambda r, dt=t.dtype: from_result(r, dt), process_set=process_set)


def grouped_allgather_async(tensors, name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> GroupHandle:
    tensors = list(tensors)
    base = _name(name, "grouped_allgather", process_set)
    handles = []
    with _ops.submit_together():
        for i, tensor in enumerate(tensors):
            t = contiguous(check(tensor, "grouped_allgather"))
            if t.dim() == 0:
                t = t.reshape(1)
            handles.append(_submit(OpType.ALLGATHER, f"{base}.{i}", t, None, (t,),
                                   lambda r, dt=t.dtype: from_result(r, dt),
                                   process_set=process_set, group=base,
                                   group_size=len(tensors)))
    return GroupHandle(handles, list)


# -- alltoall --------------------------------------------------------------------

def alltoall_async(tensor, splits=None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Starts sending splits[i] rows to rank i; ``synchronize`` returns
    (received rows, int32 tensor of the rows received from each rank)."""
    t = contiguous(check(tensor, "alltoall"))
    if t.dim() == 0:
        raise InvalidArgumentError("alltoall needs a tensor with at least one dimension")
    if isinstance(splits, torch.Tensor):  # Horovod's: int32 only, refused on every rank
        check_splits_tensor(str(splits.dtype).replace("torch.", ""), splits.dim(),
                            "splits.to(torch.int32)")
        splits = splits.tolist() if splits.dim() else [splits.item()]
    split_list = alltoall_splits(splits) or ()

    def finish(r, dt=t.dtype):
        return from_result(r, dt), torch.tensor([int(s) for s in r[2]], dtype=torch.int32)

    return _submit(OpType.ALLTOALL, _name(name, "alltoall", process_set), t, None, (t,), finish,
                   splits=split_list, process_set=process_set)


# -- reducescatter ---------------------------------------------------------------

def _reducescatter_async(tensor, name, op, process_set, prescale, postscale, what,
                         group: str = "", group_size: int = 0) -> Handle:
    rop = _ops._reduce_op(op, None)
    if rop == Adasum:
        raise InvalidArgumentError("reducescatter does not support op=Adasum")
    t = contiguous(check(tensor, what))
    if t.dim() == 0:
        raise InvalidArgumentError("reducescatter needs a tensor with at least one dimension")
    return _submit(OpType.REDUCESCATTER, name, t, None, (t,),
                   lambda r, dt=t.dtype: from_result(r, dt), reduce_op=rop,
                   prescale=prescale, postscale=postscale, process_set=process_set,
                   group=group, group_size=group_size)


def reducescatter_async(tensor, name: Optional[str] = None, op=Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    """Starts reducing across ranks and keeping this rank's block of rows (the
    first ``rows % size`` ranks get one extra row)."""
    return _reducescatter_async(tensor, _name(name, "reducescatter", process_set), op, process_set,
                                prescale_factor, postscale_factor, "reducescatter")


def grouped_reducescatter_async(tensors, name: Optional[str] = None, op=Average,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> GroupHandle:
    tensors = list(tensors)
    base = _name(name, "grouped_reducescatter", process_set)
    with _ops.submit_together():
        handles = [_reducescatter_async(t, f"{base}.{i}", op, process_set, prescale_factor,
                                        postscale_factor, "grouped_reducescatter", base,
                                        len(tensors))
                   for i, t in enumerate(tensors)]
    return GroupHandle(handles, list)
