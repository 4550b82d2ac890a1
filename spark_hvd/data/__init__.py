"""Training data for spark_hvd: Parquet (written by Spark) -> sharded numpy/torch batches.

``ParquetShardReader`` is spark_hvd's own reader on pyarrow: every rank takes the same number
of steps per epoch and every row is read exactly once per epoch across the ranks.
``make_reader(..., reader="petastorm")`` uses petastorm instead, where it imports.
Torch helpers live in :mod:`spark_hvd.data.torch` (torch is imported only there).
"""

from __future__ import annotations

from typing import Any, Union

from ..exceptions import InvalidArgumentError
from ._arrow import array_to_numpy, numpy_dtype_of, table_to_numpy
from ._rows import RowsMissingError
from ._shard import steps_per_epoch
from .reader import Batch, ParquetShardReader, list_parquet_files

# The Arrow -> numpy conversions are also the seam the estimators (the layer above) use.
__all__ = ["Batch", "ParquetShardReader", "RowsMissingError", "array_to_numpy",
           "list_parquet_files", "make_reader", "numpy_dtype_of", "steps_per_epoch",
           "table_to_numpy"]

READERS = ("arrow", "petastorm")


def make_reader(paths_or_dir: Any, *, rank: int, size: int, batch_size: int,
                reader: str = "arrow", **kwargs: Any) -> Union[ParquetShardReader, Any]:
    """A batch reader over Parquet files for one rank.

    Parameters
    ----------
    reader : {"arrow", "petastorm"}
        ``"arrow"`` (default): :class:`ParquetShardReader`, which takes the remaining keyword
        arguments.  ``"petastorm"``: :class:`spark_hvd.data.petastorm_reader.PetastormBatchReader`
        (raises ImportError with the reason when petastorm does not import).
    """
    if reader == "arrow":
        return ParquetShardReader(paths_or_dir, rank=rank, size=size, batch_size=batch_size,
                                  **kwargs)
    if reader == "petastorm":
        from .petastorm_reader import PetastormBatchReader
        return PetastormBatchReader(paths_or_dir, rank=rank, size=size, batch_size=batch_size,
                                    **kwargs)
    raise InvalidArgumentError(f"reader must be one of {READERS}, got {reader!r}")
