"""Gradient compression for DistributedTrainer: ``Compression.none`` and ``Compression.fp16``
(Horovod's MXNet pair). fp16 sends float32/float64 gradients as float16 (half the bytes or
less; 11 significant bits, overflow above 65504) and casts the result back."""

from __future__ import annotations

from typing import Any, Tuple

import mxnet as mx
import numpy as np


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)``, ``decompress(tensor, ctx)``."""

    @staticmethod
    def compress(tensor: mx.nd.NDArray) -> Tuple[mx.nd.NDArray, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: mx.nd.NDArray, ctx: Any) -> mx.nd.NDArray:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point NDArrays as float16."""

    @staticmethod
    def compress(tensor):
        dtype = np.dtype(tensor.dtype)
        if dtype.kind == "f" and dtype != np.float16:
            return tensor.astype("float16"), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.astype(ctx)


class Compression:
    """The available compressors: ``none``, ``fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
