"""Gradient compression for DistributedTrainer: ``Compression.none`` and ``Compression.fp16``
(Horovod's MXNet pair; the vocabulary and its rules: ``spark_hvd._compression``)."""

from __future__ import annotations

import numpy as np

from spark_hvd._compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


class FP16Compressor(CastCompressor):
    """Sends floating-point NDArrays as float16."""

    wire_dtype = np.dtype(np.float16)

    @staticmethod
    def _dtype(tensor):
        return np.dtype(tensor.dtype)

    @staticmethod
    def _floating(dtype):
        return dtype.kind == "f"

    @staticmethod
    def _cast(tensor, dtype):
        return tensor.astype(np.dtype(dtype).name)


class Compression:
    """The available compressors: ``none``, ``fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
