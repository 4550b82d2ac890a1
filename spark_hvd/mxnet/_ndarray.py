"""MXNet NDArrays as core descriptors, and MXNet's error type on spark_hvd's errors.

The core sees a tensor as (dtype code, shape, data pointer, device). An NDArray's
pointer is taken without a copy, through MXNet's C API, only after MXNet's engine has
finished what it had queued on the array:

1. Input: ``wait_to_read`` (every pending write to the array is done).
2. Output, in-place forms too: ``MXNDArrayWaitToWrite`` (every pending read and write is
   done), so no MXNet op still reads what the core is about to overwrite.
3. ``MXNDArrayGetData`` gives the address (a slice's included); the NDArray objects
   go to the core as the op's ``owner``, so their memory lives until the core is done.

The ops of spark_hvd.mxnet return only when the core has finished, so an MXNet op pushed
after them reads the result. NDArrays on a GPU are refused (see ``check``).
"""

from __future__ import annotations

import ctypes
from typing import Any, Tuple

import mxnet as mx
import numpy as np
from mxnet.base import MXNetError, _LIB, check_call

from spark_hvd import exceptions
from spark_hvd._types import DataType
from spark_hvd.exceptions import InvalidArgumentError

_CODES = {
    np.dtype(np.float32): DataType.FLOAT32,
    np.dtype(np.float64): DataType.FLOAT64,
    np.dtype(np.float16): DataType.FLOAT16,
    np.dtype(np.uint8): DataType.UINT8,
    np.dtype(np.int8): DataType.INT8,
    np.dtype(np.int32): DataType.INT32,
    np.dtype(np.int64): DataType.INT64,
    np.dtype(np.bool_): DataType.BOOL,
}


def dtype_code(tensor: mx.nd.NDArray) -> DataType:
    try:
        return _CODES[np.dtype(tensor.dtype)]
    except (KeyError, TypeError):
        names = ", ".join(str(d) for d in _CODES)
        raise InvalidArgumentError(f"NDArray dtype {tensor.dtype} is not supported; use one "
                                   f"of: {names} (tensor.astype('float32'))") from None


def check(tensor: Any, what: str) -> mx.nd.NDArray:
    """The NDArray itself, or InvalidArgumentError for what the core cannot take: other
    types, sparse storage, GPU memory, unsupported dtypes."""
    if not isinstance(tensor, mx.nd.NDArray):
        raise InvalidArgumentError(f"{what} takes an mxnet.nd.NDArray, got "
                                   f"{type(tensor).__name__}")
    if tensor.stype != "default":
        raise InvalidArgumentError(f"{what}: {tensor.stype} NDArrays are not supported; "
                                   "convert with tensor.tostype('default')")
    device = tensor.context.device_type
    if not device.startswith("cpu"):  # cpu, cpu_pinned, cpu_shared: host memory
        raise InvalidArgumentError(
            f"{what}: the NDArray is on {tensor.context}, and spark_hvd.mxnet runs on host "
            f"memory only (MXNet's GPU builds are not supported). Copy it to the host with "
            f"tensor.as_in_context(mx.cpu()) and back with .copyto(ctx) after the op.")
    dtype_code(tensor)
    return tensor


def pointer(tensor: mx.nd.NDArray, write: bool) -> int:
    """The array's data address once MXNet's engine is done with it (module docstring)."""
    if write:
        check_call(_LIB.MXNDArrayWaitToWrite(tensor.handle))
    else:
        check_call(_LIB.MXNDArrayWaitToRead(tensor.handle))
    if tensor.size == 0:
        return 0
    address = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(tensor.handle, ctypes.byref(address)))
    return int(address.value or 0)


def shape_of(tensor: mx.nd.NDArray) -> Tuple[int, ...]:
    return tuple(int(d) for d in tensor.shape)


def from_result(result, dtype) -> mx.nd.NDArray:
    """A core-allocated output (allgather, alltoall, reducescatter) as a CPU NDArray."""
    shape = [int(d) for d in result[1]]
    arr = result[0].view(np.dtype(dtype)).reshape(shape)
    return mx.nd.array(arr, ctx=mx.cpu(), dtype=arr.dtype)


# -- errors: what Horovod's MXNet ops raise is MXNetError -------------------------------

def _mixed(cls: type) -> type:
    mixed = type(cls.__name__, (cls, MXNetError), {
        "__module__": __name__, "__qualname__": "MXNet" + cls.__name__,
        "__doc__": f"spark_hvd's {cls.__name__} that is also MXNet's MXNetError."})
    globals()["MXNet" + cls.__name__] = mixed  # importable by that name: errors pickle
    return mixed


_ERRORS = {cls: _mixed(cls) for cls in (
    exceptions.InvalidArgumentError, exceptions.TensorMismatchError,
    exceptions.NotInitializedError, exceptions.CollectiveTimeoutError,
    exceptions.PeerLostError, exceptions.StoreError, exceptions.AuthenticationError,
    exceptions.InternalError, exceptions.HorovodInternalError)}


def mxnet_error(exc: exceptions.SparkHvdError) -> BaseException:
    """``exc`` as an instance of a class that is both its own and MXNetError, so code
    written for Horovod (``except MXNetError``) and for spark_hvd both catch it."""
    mixed = _ERRORS.get(type(exc))
    if mixed is None:
        return exc
    out = mixed.__new__(mixed, *exc.args)
    out.args = exc.args
    out.__dict__.update(exc.__dict__)
    return out
