"""The core's enums (``spark_hvd._core``) and the numpy dtype mapping.

DataType, ReduceOp, OpType and StatusCode are the native core's own enums
(csrc/common/types.h, status.h), bound as ``enum.IntEnum`` subclasses: there is no
Python copy of their values to drift. Importing this module loads the core.
"""

from __future__ import annotations

import numpy as np

from spark_hvd._core import DataType, OpType, ReduceOp, StatusCode
from spark_hvd.exceptions import InvalidArgumentError

__all__ = ["DataType", "OpType", "ReduceOp", "StatusCode", "BFLOAT16_NUMPY", "numpy_code",
           "numpy_dtype"]

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
    if isinstance(dtype, np.dtype):  # an array's: no conversion on the per-op path
        code = _NUMPY.get(dtype)
        if code is not None:
            return code
    dt = np.dtype(dtype)
    try:
        return _NUMPY[dt]
    except KeyError:
        supported = ", ".join(sorted(str(d) for d in _NUMPY))
        raise InvalidArgumentError(f"dtype {dt} is not supported; use one of: {supported}") \
            from None


def numpy_dtype(code: int) -> np.dtype:
    """Numpy dtype for a core code (bfloat16 needs ml_dtypes; else uint16 bits)."""
    if code == DataType.BFLOAT16 and BFLOAT16_NUMPY is None:
        return np.dtype(np.uint16)
    return _FROM_CODE[DataType(code)]

