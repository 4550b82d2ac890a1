"""Horovod's ``horovod.mxnet`` collectives on CPU NDArrays, on spark_hvd's core.

Every op takes its NDArrays' memory without a copy (``_ndarray.pointer``: after MXNet's
engine is done with them) and returns once the core has finished, so the result is what
later MXNet ops read. ``priority`` is accepted for Horovod's signatures; the core orders
ops by negotiation, so it has no effect. Errors are spark_hvd's classes, each also
MXNet's ``MXNetError`` (what Horovod's MXNet ops raise).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Sequence

import mxnet as mx
import numpy as np

from spark_hvd import _ops
from spark_hvd._basics import ProcessSet, global_process_set
from spark_hvd._rules import alltoall_splits, check_splits_tensor, op_name
from spark_hvd._types import OpType, ReduceOp
from spark_hvd.exceptions import InvalidArgumentError, SparkHvdError
from spark_hvd.mxnet._ndarray import (check, dtype_code, from_result, mxnet_error, pointer,
                                      shape_of)

Sum = ReduceOp.SUM
Average = ReduceOp.AVERAGE
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM


def _mxnet_errors(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SparkHvdError as exc:
            raise mxnet_error(exc) from None
    return wrapper


_name = op_name  # spark_hvd._rules: the name given, or one generated per kind and set


def _submit(op: int, name: str, tensor: mx.nd.NDArray, out: Optional[mx.nd.NDArray],
            finish: Callable, **kw) -> _ops.Handle:
    """One op on ``tensor`` (read) into ``out`` (written; ``tensor`` itself in place, None
    when the core allocates the output). Both NDArrays are the op's owner."""
    in_place = out is tensor
    in_ptr = pointer(tensor, write=in_place)
    out_ptr = in_ptr if in_place else (pointer(out, write=True) if out is not None else 0)
    return _ops.submit(op, name, dtype_code(tensor), shape_of(tensor), in_ptr, out_ptr,
                       (tensor, out), finish, **kw)


def _empty_like(tensor: mx.nd.NDArray) -> mx.nd.NDArray:
    return mx.nd.empty(tensor.shape, ctx=tensor.context, dtype=tensor.dtype)


# -- allreduce -------------------------------------------------------------------

def _allreduce_async(tensor, name: str, rop: ReduceOp, prescale: float, postscale: float,
                     process_set: ProcessSet, inplace: bool, what: str, group: str = "",
                     group_size: int = 0) -> _ops.Handle:
    t = check(tensor, what)
    out = t if inplace else _empty_like(t)
    return _submit(OpType.ALLREDUCE, name, t, out, lambda _r: out, reduce_op=rop,
                   prescale=prescale, postscale=postscale, process_set=process_set,
                   group=group, group_size=group_size)


@_mxnet_errors
def allreduce(tensor, average=None, name: Optional[str] = None, priority: int = 0,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set, op=None) -> mx.nd.NDArray:
    """Reduces ``tensor`` across ranks (default Average) into a new NDArray."""
    rop = _ops._reduce_op(op, average)
    return _ops.synchronize(_allreduce_async(
        tensor, _name(name, "allreduce", process_set), rop, prescale_factor, postscale_factor,
        process_set, False, "allreduce"))


@_mxnet_errors
def allreduce_(tensor, average=None, name: Optional[str] = None, priority: int = 0,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set, op=None) -> mx.nd.NDArray:
    """Reduces ``tensor`` across ranks in place and returns it."""
    rop = _ops._reduce_op(op, average)
    return _ops.synchronize(_allreduce_async(
        tensor, _name(name, "allreduce", process_set), rop, prescale_factor, postscale_factor,
        process_set, True, "allreduce_"))


def _grouped_allreduce_async(tensors, name, rop, prescale, postscale, process_set, inplace,
                             what) -> _ops.GroupHandle:
    tensors = list(tensors)
    base = _name(name, "grouped_allreduce", process_set)
    with _ops.submit_together():
        handles = [_allreduce_async(t, f"{base}.{i}", rop, prescale, postscale, process_set,
                                    inplace, what, group=base, group_size=len(tensors))
                   for i, t in enumerate(tensors)]
    return _ops.GroupHandle(handles, list)


@_mxnet_errors
def grouped_allreduce(tensors, average=None, name: Optional[str] = None, priority: int = 0,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      op=None) -> List[mx.nd.NDArray]:
    """Reduces a list of NDArrays as one group (negotiated and fused together)."""
    if not tensors:
        return list(tensors)
    return _ops.synchronize(_grouped_allreduce_async(
        tensors, name, _ops._reduce_op(op, average), prescale_factor, postscale_factor,
        process_set, False, "grouped_allreduce"))


@_mxnet_errors
def grouped_allreduce_(tensors, average=None, name: Optional[str] = None, priority: int = 0,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set,
                       op=None) -> List[mx.nd.NDArray]:
    """Reduces a list of NDArrays in place as one group; returns them."""
    if not tensors:
        return list(tensors)
    return _ops.synchronize(_grouped_allreduce_async(
        tensors, name, _ops._reduce_op(op, average), prescale_factor, postscale_factor,
        process_set, True, "grouped_allreduce_"))


# -- allgather, broadcast ----------------------------------------------------------

def _allgather_async(tensor, name: str, process_set: ProcessSet, what: str, group: str = "",
                     group_size: int = 0) -> _ops.Handle:
    t = check(tensor, what)
    if t.ndim == 0:
        t = t.reshape((1,))
    return _submit(OpType.ALLGATHER, name, t, None, lambda r, dt=t.dtype: from_result(r, dt),
                   process_set=process_set, group=group, group_size=group_size)


@_mxnet_errors
def allgather(tensor, name: Optional[str] = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> mx.nd.NDArray:
    """Concatenates every rank's NDArray along the first dimension (sizes may differ)."""
    return _ops.synchronize(_allgather_async(tensor, _name(name, "allgather", process_set),
                                             process_set, "allgather"))


@_mxnet_errors
def grouped_allgather(tensors, name: Optional[str] = None, priority: int = 0,
                      process_set: ProcessSet = global_process_set) -> List[mx.nd.NDArray]:
    tensors = list(tensors)
    if not tensors:
        return tensors
    base = _name(name, "grouped_allgather", process_set)
    with _ops.submit_together():
        handles = [_allgather_async(t, f"{base}.{i}", process_set, "grouped_allgather", base,
                                    len(tensors)) for i, t in enumerate(tensors)]
    return _ops.synchronize(_ops.GroupHandle(handles, list))


def _broadcast_async(tensor, root_rank: int, name: str, process_set: ProcessSet,
                     inplace: bool, what: str) -> _ops.Handle:
    t = check(tensor, what)
    buf = t if inplace else t.copy()  # the copy is queued on MXNet's engine; pointer() waits
    return _submit(OpType.BROADCAST, name, buf, buf, lambda _r: buf, root=root_rank,
                   process_set=process_set)


@_mxnet_errors
def broadcast(tensor, root_rank: int, name: Optional[str] = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> mx.nd.NDArray:
    """root_rank's NDArray, as a new NDArray on every rank."""
    return _ops.synchronize(_broadcast_async(tensor, root_rank,
                                             _name(name, "broadcast", process_set),
                                             process_set, False, "broadcast"))


@_mxnet_errors
def broadcast_(tensor, root_rank: int, name: Optional[str] = None, priority: int = 0,
               process_set: ProcessSet = global_process_set) -> mx.nd.NDArray:
    """Overwrites ``tensor`` with root_rank's, in place, and returns it."""
    return _ops.synchronize(_broadcast_async(tensor, root_rank,
                                             _name(name, "broadcast", process_set),
                                             process_set, True, "broadcast_"))


# -- alltoall, reducescatter -------------------------------------------------------

@_mxnet_errors
def alltoall(tensor, splits=None, name: Optional[str] = None, priority: int = 0,
             process_set: ProcessSet = global_process_set):
    """Sends ``splits[i]`` rows to rank i (equal parts when None). Returns the received rows,
    and, when ``splits`` was given, also the int32 NDArray of the rows received from each
    rank, as Horovod's: ``(rows, received_splits)``. An NDArray of splits must be int32
    (Horovod's rule, ``spark_hvd._rules``)."""
    t = check(tensor, "alltoall")
    if t.ndim == 0:
        raise InvalidArgumentError("alltoall needs an NDArray with at least one dimension")
    values = splits
    if isinstance(splits, mx.nd.NDArray):
        check_splits_tensor(np.dtype(splits.dtype).name, splits.ndim,
                            "splits.astype('int32')")
        values = splits.asnumpy().reshape(-1)

    def finish(r, dt=t.dtype):
        return from_result(r, dt), mx.nd.array(np.asarray(r[2], dtype=np.int32),
                                               dtype=np.int32)

    out, received = _ops.synchronize(_submit(
        OpType.ALLTOALL, _name(name, "alltoall", process_set), t, None, finish,
        splits=alltoall_splits(values) or (), process_set=process_set))
    return out if splits is None else (out, received)


def _reducescatter_async(tensor, name: str, op, process_set: ProcessSet, prescale: float,
                         postscale: float, what: str, group: str = "",
                         group_size: int = 0) -> _ops.Handle:
    rop = _ops._reduce_op(op, None)
    if rop == Adasum:
        raise InvalidArgumentError(f"{what} does not support op=Adasum")
    t = check(tensor, what)
    if t.ndim == 0:
        raise InvalidArgumentError(f"{what} needs an NDArray with at least one dimension")
    return _submit(OpType.REDUCESCATTER, name, t, None, lambda r, dt=t.dtype: from_result(r, dt),
                   reduce_op=rop, prescale=prescale, postscale=postscale,
                   process_set=process_set, group=group, group_size=group_size)


@_mxnet_errors
def reducescatter(tensor, op=Average, name: Optional[str] = None, priority: int = 0,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> mx.nd.NDArray:
    """Reduces across ranks, then keeps this rank's block of rows (the first
    ``rows % size`` ranks get one extra row)."""
    return _ops.synchronize(_reducescatter_async(
        tensor, _name(name, "reducescatter", process_set), op, process_set, prescale_factor,
        postscale_factor, "reducescatter"))


@_mxnet_errors
def grouped_reducescatter(tensors, op=Average, name: Optional[str] = None, priority: int = 0,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[mx.nd.NDArray]:
    tensors = list(tensors)
    if not tensors:
        return tensors
    base = _name(name, "grouped_reducescatter", process_set)
    with _ops.submit_together():
        handles = [_reducescatter_async(t, f"{base}.{i}", op, process_set, prescale_factor,
                                        postscale_factor, "grouped_reducescatter", base,
                                        len(tensors)) for i, t in enumerate(tensors)]
    return _ops.synchronize(_ops.GroupHandle(handles, list))


@_mxnet_errors
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Returns once every rank of the set has called barrier."""
    _ops.barrier(process_set)


@_mxnet_errors
def join() -> int:
    """Marks this rank as out of data (see spark_hvd.join); returns the last rank to join."""
    return _ops.join()


def _submit_all(fn: Callable[[], Sequence[_ops.Handle]]) -> List[Any]:
    """Runs ``fn`` (which submits ops) and waits for every handle it returns, raising the
    first error as MXNet's (every handle is waited for, so none is left unclaimed)."""
    try:
        handles = fn()
        return _ops.synchronize(_ops.GroupHandle(list(handles), list))
    except SparkHvdError as exc:
        raise mxnet_error(exc) from None
