"""Gradient compression for allreduce on TensorFlow tensors: ``Compression.none``, ``.fp16``
and ``.bf16``, named as in Horovod (the vocabulary and its rules: ``spark_hvd._compression``);
any object with ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)`` can be
passed as ``compression=``."""

from __future__ import annotations

import tensorflow as tf

from spark_hvd._compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class _TFCast(CastCompressor):
    @staticmethod
    def _dtype(tensor):
        return tensor.dtype

    @staticmethod
    def _floating(dtype):
        return dtype.is_floating

    @staticmethod
    def _cast(tensor, dtype):
        return tf.cast(tensor, dtype)


class FP16Compressor(_TFCast):
    """float32/float64 travel as float16 (halves the bytes; 11-bit mantissa)."""

    wire_dtype = tf.float16


class BF16Compressor(_TFCast):
    """float32/float64 travel as bfloat16 (halves the bytes; float32's exponent range)."""

    wire_dtype = tf.bfloat16


class Compression:
    """The built-in compressors, named as in Horovod."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
