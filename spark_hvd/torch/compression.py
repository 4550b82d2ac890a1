"""Gradient compression for allreduce on torch tensors: ``Compression.none``, ``.fp16`` and
``.bf16`` (the vocabulary and its rules: ``spark_hvd._compression``)."""

from __future__ import annotations

import torch

from spark_hvd._compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class _TorchCast(CastCompressor):
    @staticmethod
    def _dtype(tensor):
        return tensor.dtype

    @staticmethod
    def _floating(dtype):
        return dtype.is_floating_point

    @staticmethod
    def _cast(tensor, dtype):
        return tensor.to(dtype)


class FP16Compressor(_TorchCast):
    """Sends floating-point tensors as float16."""

    wire_dtype = torch.float16


class BF16Compressor(_TorchCast):
    """Sends floating-point tensors as bfloat16."""

    wire_dtype = torch.bfloat16


class Compression:
    """The available compressors: ``none``, ``fp16``, ``bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
