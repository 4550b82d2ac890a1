"""Gradient compression, in one vocabulary for every framework: a compressor is a class with
``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor`` (Horovod's
interface); ``Compression.none`` passes tensors through, ``Compression.fp16`` and
``Compression.bf16`` send floating-point tensors wider than their ``wire_dtype`` as it
(half the bytes or less) and cast the result back. Non-floating tensors are never cast.
fp16 keeps 11 significant bits but overflows above 65504; bf16 keeps float32's range with
8 significant bits.

Each framework gives the casting compressor its three hooks (``_dtype``, ``_floating``,
``_cast``) and its ``wire_dtype``s (``spark_hvd.torch.compression``,
``spark_hvd.tensorflow.compression``, ``spark_hvd.mxnet.compression``).
"""

from __future__ import annotations

from typing import Any, Tuple


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)``, ``decompress(tensor, ctx)``."""

    @staticmethod
    def compress(tensor: Any) -> Tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class CastCompressor(Compressor):
    """Casts floating tensors other than ``wire_dtype`` to it; ``ctx`` is the dtype to cast
    the result back to (None: the tensor went as it was)."""

    wire_dtype: Any = None

    @staticmethod
    def _dtype(tensor: Any) -> Any:
        raise NotImplementedError

    @staticmethod
    def _floating(dtype: Any) -> bool:
        raise NotImplementedError

    @staticmethod
    def _cast(tensor: Any, dtype: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def compress(cls, tensor):
        dtype = cls._dtype(tensor)
        if cls._floating(dtype) and dtype != cls.wire_dtype:
            return cls._cast(tensor, cls.wire_dtype), dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor, ctx):
        return tensor if ctx is None else cls._cast(tensor, ctx)
