"""Torch tensors as core descriptors: dtype codes, checks, results back to tensors.

The core sees a tensor as (dtype code, shape, data pointer); everything here is
about producing that descriptor from a CPU tensor (with a clear error for
anything else) and turning the core's byte buffer back into a tensor.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from spark_hvd._types import DataType
from spark_hvd.exceptions import InvalidArgumentError

_CODES = {
    torch.uint8: DataType.UINT8,
    torch.int8: DataType.INT8,
    torch.int16: DataType.INT16,
    torch.int32: DataType.INT32,
    torch.int64: DataType.INT64,
    torch.float16: DataType.FLOAT16,
    torch.bfloat16: DataType.BFLOAT16,
    torch.float32: DataType.FLOAT32,
    torch.float64: DataType.FLOAT64,
    torch.bool: DataType.BOOL,
}

SUPPORTED_DTYPES = tuple(_CODES)


def dtype_code(dtype: torch.dtype) -> DataType:
    try:
        return _CODES[dtype]
    except KeyError:
        names = ", ".join(str(d).replace("torch.", "") for d in _CODES)
        raise InvalidArgumentError(f"dtype {dtype} is not supported; use one of: {names}") from None


def check(tensor, what: str) -> torch.Tensor:
    """Validates a tensor for the core and returns it detached (no autograd history).

    Raises InvalidArgumentError for non-tensors, GPU or other non-CPU tensors,
    sparse tensors and unsupported dtypes.
    """
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        if tensor.device.type == "cuda":
            raise InvalidArgumentError(
                f"{what}: the tensor is on {tensor.device}, but GPU tensors need a spark_hvd "
                "build with NCCL, which is not available yet (spark_hvd.nccl_built() is "
                "False). Move the tensor to the CPU first (tensor.cpu()).")
        raise InvalidArgumentError(f"{what}: the tensor is on {tensor.device}; spark_hvd.torch "
                                   "supports CPU tensors only")
    if tensor.layout != torch.strided:
        raise InvalidArgumentError(
            f"{what}: {tensor.layout} tensors are not supported; convert with .to_dense() "
            "(DistributedOptimizer(sparse_as_dense=True)) or use sparse_allreduce_async")
    dtype_code(tensor.dtype)
    return tensor.detach()


def contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def shape_of(tensor: torch.Tensor) -> List[int]:
    return list(tensor.shape)


def from_result(result, dtype: torch.dtype) -> torch.Tensor:
    """The core-allocated output of an op as a tensor (shares the core's buffer,
    which the numpy array, and so the tensor, keeps alive)."""
    shape = [int(d) for d in result[1]]
    if result[0].size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(result[0]).view(dtype).reshape(shape)


def int_list(values, what: str) -> List[int]:
    """splits given as a list, tuple, numpy array or tensor, as a list of ints."""
    if isinstance(values, torch.Tensor):
        values = values.reshape(-1).tolist()
    try:
        out = [int(v) for v in values]
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{what} must be a sequence of integers, got {values!r}") \
            from None
    return out


def even_splits(rows: int, n: int) -> List[int]:
    base, rem = divmod(rows, n)
    return [base + (1 if i < rem else 0) for i in range(n)]


def row_offsets(sizes: Sequence[int]) -> List[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += int(s)
    return out
