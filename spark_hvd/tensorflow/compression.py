"""Gradient compression for allreduce: cast floating tensors to a 16-bit type on the wire.

``Compression.none``, ``Compression.fp16`` and ``Compression.bf16`` are objects with
``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``; any
object with those two methods can be passed as ``compression=``.
"""

from __future__ import annotations

from typing import Any, Tuple

import tensorflow as tf


class Compressor:
    """Interface: compress before the collective, decompress after it."""

    @staticmethod
    def compress(tensor) -> Tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _CastCompressor(Compressor):
    """Casts floating tensors wider than ``wire`` to it, and back afterwards."""

    wire: tf.DType = tf.float16

    @classmethod
    def compress(cls, tensor):
        dtype = tensor.dtype
        if dtype.is_floating and dtype != cls.wire:
            return tf.cast(tensor, cls.wire), dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class FP16Compressor(_CastCompressor):
    """float32/float64 travel as float16 (halves the bytes; 11-bit mantissa)."""

    wire = tf.float16


class BF16Compressor(_CastCompressor):
    """float32/float64 travel as bfloat16 (halves the bytes; float32's exponent range)."""

    wire = tf.bfloat16


class Compression:
    """The built-in compressors, named as in Horovod."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
