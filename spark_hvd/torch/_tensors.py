"""Torch tensors as core descriptors: dtype codes, checks, results back to tensors.

The core sees a tensor as (dtype code, shape, data pointer, device); everything
here is about producing that descriptor from a CPU or CUDA tensor (with a clear
error for anything else) and turning the core's output back into a tensor.
"""

from __future__ import annotations

import functools
from typing import Tuple

import numpy as np

import torch
import torch.utils.dlpack

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

def dtype_code(dtype: torch.dtype) -> DataType:
    try:
        return _CODES[dtype]
    except KeyError:
        names = ", ".join(str(d).replace("torch.", "") for d in _CODES)
        raise InvalidArgumentError(f"dtype {dtype} is not supported; use one of: {names}") from None


def check(tensor, what: str) -> torch.Tensor:
    """Validates a tensor for the core and returns it detached (no autograd history).

    Raises InvalidArgumentError for non-tensors, CUDA tensors where the CUDA runtime
    does not load, tensors on other devices, sparse tensors and unsupported dtypes.
    Called on every op: the common case (a strided CPU tensor of a supported dtype
    that records no gradient) costs a few attribute reads.
    """
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_cpu:
        _check_device(tensor, what)
    if tensor.layout is not torch.strided:
        raise InvalidArgumentError(
            f"{what}: {tensor.layout} tensors are not supported; convert with .to_dense() "
            "(DistributedOptimizer(sparse_as_dense=True)) or use sparse_allreduce_async")
    if tensor.dtype not in _CODES:
        dtype_code(tensor.dtype)  # raises, naming the supported dtypes
    # detach() makes a new tensor object; one that records no gradient has no history
    return tensor.detach() if tensor.requires_grad else tensor


def _check_device(tensor: torch.Tensor, what: str) -> None:
    if tensor.is_cuda:
        if not _gpu_operations():
            from spark_hvd import _core

            raise InvalidArgumentError(
                f"{what}: the tensor is on {tensor.device}, but spark_hvd cannot run GPU "
                f"tensors here: they need the CUDA runtime, with NCCL or staged through host "
                f"memory (spark_hvd.cuda_built() is False: {_core.nccl_unavailable_reason()}). "
                "Install the nvidia-nccl and nvidia-cuda-runtime wheels (GPU builds of PyTorch "
                "bring them) or set SPARK_HVD_CUDA_LIBRARY / SPARK_HVD_NCCL_LIBRARY, or move "
                "the tensor to the CPU (tensor.cpu()).")
    else:
        raise InvalidArgumentError(f"{what}: the tensor is on {tensor.device}; spark_hvd.torch "
                                   "supports CPU and CUDA tensors")


@functools.lru_cache(maxsize=None)
def _gpu_operations() -> bool:
    """True when a CUDA tensor has a backend here: NCCL, or the CUDA runtime alone
    (the core then stages GPU tensors through pinned host memory on a CPU backend)."""
    from spark_hvd._basics import cuda_built

    return cuda_built()


def device_of(tensor: torch.Tensor) -> Tuple[int, int]:
    """(device id, producing stream) for the core: (-1, 0) for a CPU tensor; a CUDA
    tensor's ordinal and the current stream of its device (the core's NCCL work waits
    for what is queued there)."""
    if not tensor.is_cuda:
        return -1, 0
    return tensor.device.index, torch.cuda.current_stream(tensor.device).cuda_stream


def contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def shape_of(tensor: torch.Tensor) -> Tuple[int, ...]:
    return tensor.shape  # a torch.Size: a tuple of ints


def from_result(result, dtype: torch.dtype) -> torch.Tensor:
    """The core-allocated output of an op as a tensor (shares the core's buffer,
    which the numpy array, and so the tensor, keeps alive). A GPU output comes as a
    DLPack capsule: a CUDA tensor sharing the core's memory."""
    if not isinstance(result[0], np.ndarray):
        return torch.utils.dlpack.from_dlpack(result[0])
    shape = [int(d) for d in result[1]]
    if result[0].size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(result[0]).view(dtype).reshape(shape)
