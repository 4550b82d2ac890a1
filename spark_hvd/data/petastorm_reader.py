"""``reader="petastorm"``: Petastorm's ``make_batch_reader`` over the same Parquet files.

Optional, and imported lazily: petastorm 0.13.1 (its latest release) imports only with
pyarrow <= 14, which needs numpy < 2 and is older than pyspark 4.1+ requires, so in most
current environments this path raises a clear ImportError and the default ``reader="arrow"``
(:class:`spark_hvd.data.ParquetShardReader`) is the one to use.

Petastorm shards by row group, so ranks may get different numbers of rows and steps per epoch,
and a training loop whose ranks take different numbers of steps waits forever in a collective
unless it uses ``join``.  This reader therefore has no ``len()``.  ``prefetch`` and
``shuffle_buffer_rows`` are accepted for symmetry and ignored (petastorm has its own pool).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np

from ..exceptions import InvalidArgumentError
from .reader import PathsOrDir

Batch = Dict[str, np.ndarray]


def _versions() -> str:
    found = []
    for mod in ("pyarrow", "numpy"):
        try:
            found.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            found.append(f"{mod} not installed")
    return ", ".join(found)


def import_make_batch_reader() -> Callable[..., Any]:
    """``petastorm.make_batch_reader``, or an ImportError that says why and what to do."""
    try:
        from petastorm import make_batch_reader
    except Exception as exc:  # petastorm fails with AttributeError etc. on new pyarrow/numpy
        raise ImportError(
            f"reader='petastorm' needs petastorm, which could not be imported "
            f"({type(exc).__name__}: {exc}). petastorm 0.13.1, the latest release, works "
            f"only with pyarrow<=14 (and so numpy<2); this environment has {_versions()}. "
            f"Use reader='arrow' (the default: spark_hvd's own reader on the same files), or "
            f"run in an environment with petastorm 0.13.1 and pyarrow<=14.") from exc
    return make_batch_reader


def _to_url(path: str) -> str:
    return path if "://" in path else "file://" + os.path.abspath(path)


def _as_column(values: Any) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype == object and len(arr) and isinstance(arr[0], np.ndarray):
        return np.stack(list(arr))
    return arr


class PetastormBatchReader:
    """Batches of ``{column: numpy array}`` from petastorm's batch reader, one shard per rank.

    The arguments mirror :class:`spark_hvd.data.ParquetShardReader`; extra keyword arguments
    go to ``petastorm.make_batch_reader``.
    """

    def __init__(self, paths_or_dir: PathsOrDir, *, rank: int, size: int, batch_size: int,
                 columns: Optional[Sequence[str]] = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, prefetch: int = 0,
                 shuffle_buffer_rows: Optional[int] = None, **petastorm_kwargs: Any) -> None:
        self._make_batch_reader = import_make_batch_reader()
        if isinstance(paths_or_dir, (str, os.PathLike)):
            self.urls: Any = _to_url(os.fspath(paths_or_dir))
        else:
            self.urls = [_to_url(os.fspath(p)) for p in paths_or_dir]
        if batch_size < 1 or not 0 <= rank < size:
            raise InvalidArgumentError(
                f"need batch_size >= 1 and 0 <= rank < size, got batch_size={batch_size}, "
                f"rank={rank}, size={size}")
        self.rank, self.size, self.batch_size = rank, size, batch_size
        self.columns = list(columns) if columns is not None else None
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self._kwargs = petastorm_kwargs
        self._next_epoch = 0

    def __iter__(self) -> Iterator[Batch]:
        epoch, self._next_epoch = self._next_epoch, self._next_epoch + 1
        return self.epoch(epoch)

    def epoch(self, epoch: int) -> Iterator[Batch]:
        """One pass over this rank's shard, re-cut into batches of ``batch_size`` rows."""
        kwargs = dict(schema_fields=self.columns, cur_shard=self.rank, shard_count=self.size,
                      shard_seed=self.seed, shuffle_row_groups=self.shuffle,
                      seed=self.seed + epoch, num_epochs=1)
        kwargs.update(self._kwargs)
        pending: List[Batch] = []
        have = 0
        with self._make_batch_reader(self.urls, **kwargs) as reader:
            for item in reader:
                chunk = {k: _as_column(v) for k, v in item._asdict().items()
                         if self.columns is None or k in self.columns}
                pending.append(chunk)
                have += len(next(iter(chunk.values())))
                while have >= self.batch_size:
                    merged = {k: np.concatenate([c[k] for c in pending]) for k in pending[0]}
                    yield {k: v[:self.batch_size] for k, v in merged.items()}
                    rest = {k: v[self.batch_size:] for k, v in merged.items()}
                    have -= self.batch_size
                    pending = [rest] if have else []
        if have and not self.drop_last:
            yield {k: np.concatenate([c[k] for c in pending]) for k in pending[0]}
