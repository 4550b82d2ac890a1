"""Codes shared with the native core (csrc/common/types.h) and numpy dtype mapping."""

from __future__ import annotations

import enum

import numpy as np


class DataType(enum.IntEnum):
    UINT8 = 0
    INT8 = 1
    INT16 = 2
    INT32 = 3
    INT64 = 4
    FLOAT16 = 5
    BFLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BOOL = 9


class ReduceOp(enum.IntEnum):
    """Reduction operations; ``spark_hvd.Sum`` etc. are these members."""

    SUM = 0
    AVERAGE = 1
    MIN = 2
    MAX = 3
    PRODUCT = 4
    ADASUM = 5


class OpType(enum.IntEnum):
    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    REDUCESCATTER = 4
    BARRIER = 5
    JOIN = 6
    ADD_PROCESS_SET = 100
    REMOVE_PROCESS_SET = 101


_NUMPY = {
    np.dtype(np.uint8): DataType.UINT8,
    np.dtype(np.int8): DataType.INT8,
    np.dtype(np.int16): DataType.INT16,
    np.dtype(np.int32): DataType.INT32,
    np.dtype(np.int64): DataType.INT64,
    np.dtype(np.float16): DataType.FLOAT16,
    np.dtype(np.float32): DataType.FLOAT32,
    np.dtype(np.float64): DataType.FLOAT64,
    np.dtype(np.bool_): DataType.BOOL,
}
try:  # numpy has no bfloat16; ml_dtypes (installed with TensorFlow/JAX) adds one
    import ml_dtypes

    BFLOAT16_NUMPY = np.dtype(ml_dtypes.bfloat16)
    _NUMPY[BFLOAT16_NUMPY] = DataType.BFLOAT16
except ImportError:  # pragma: no cover - depends on the environment
    BFLOAT16_NUMPY = None

_FROM_CODE = {code: dt for dt, code in _NUMPY.items()}


def numpy_code(dtype) -> DataType:
    """The core's code for a numpy dtype; a clear error for unsupported ones."""
    dt = np.dtype(dtype)
    try:
        return _NUMPY[dt]
    except KeyError:
        supported = ", ".join(sorted(str(d) for d in _NUMPY))
        raise _invalid(f"dtype {dt} is not supported; use one of: {supported}") from None


def numpy_dtype(code: int) -> np.dtype:
    """Numpy dtype for a core code (bfloat16 needs ml_dtypes; else uint16 bits)."""
    if code == DataType.BFLOAT16 and BFLOAT16_NUMPY is None:
        return np.dtype(np.uint16)
    return _FROM_CODE[DataType(code)]


def _invalid(msg: str):
    from spark_hvd.exceptions import InvalidArgumentError

    return InvalidArgumentError(msg)
