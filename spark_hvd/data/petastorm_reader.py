"""``reader="petastorm"``: Petastorm's ``make_batch_reader`` (its worker pool) over the same
Parquet files, with spark_hvd's guarantees on top.

Optional, and imported lazily: petastorm 0.13.1 (its latest release) imports only with
pyarrow <= 14 (so numpy < 2); the project's compat environment (``make compat``) has it.
Elsewhere this path raises a clear ImportError and ``reader="arrow"`` is the one to use.

The contract, for a rank of ``size``:

1. Petastorm shards by row group: its pieces are the files' row groups in the given file
   order (empty ones included), and piece ``i`` belongs to rank ``i % size``. Read at
   construction from the footers, that gives every rank's row count, so every rank knows
   every share without talking.
2. Every rank takes ``steps = ceil(max share / batch_size)`` steps per epoch (with
   ``drop_last``: ``min share // batch_size`` full batches) and cuts its own rows into
   exactly that many batches, sizes differing by at most one: equal steps on every rank,
   every row once per epoch (a rank with a smaller share has smaller batches).
3. Each epoch reads the shard with ``num_epochs=1`` and counts the rows: petastorm's
   thread pool can end an iteration early (its end-of-data test reads the workers' counts
   and then the ventilator's state, and the ventilator thread can fill the workers in
   between), leaving row groups queued in its workers; the reader then asks once more, and
   a shard still short of its footers' rows is a RowsMissingError naming its files.

The rows of an epoch are always the same, but not always in the same order: petastorm's
pool hands row groups over as its threads finish them (``reader="arrow"`` is deterministic).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterator, List, Optional, Sequence

import numpy as np
import pyarrow.fs as pafs

from ..exceptions import InvalidArgumentError
from . import _batching, _rows, _shard
from .reader import DEFAULT_SHUFFLE_BUFFER_ROWS, PathsOrDir, _read_footers, list_parquet_files

logger = logging.getLogger(__name__)

Batch = _rows.Batch


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
            f"run in an environment with petastorm 0.13.1 and pyarrow<=14 (`make compat`).") \
            from exc
    return make_batch_reader


def _as_column(values: Any) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype == object and len(arr) and isinstance(arr[0], np.ndarray):
        return np.stack(list(arr))
    return arr


class PetastormBatchReader:
    """Batches of ``{column: numpy array}`` from petastorm's batch reader, one shard per rank,
    equal steps on every rank, every row once per epoch (module docstring).

    The arguments mirror :class:`spark_hvd.data.ParquetShardReader`; ``workers_count`` is
    petastorm's (its thread pool, default 10); other keyword arguments go to
    ``petastorm.make_batch_reader``. ``prefetch`` is accepted for symmetry (petastorm's pool
    reads ahead); with ``shuffle`` rows are mixed through ``shuffle_buffer_rows`` as in
    ParquetShardReader, and petastorm permutes the row groups every epoch.
    """

    def __init__(self, paths_or_dir: PathsOrDir, *, rank: int, size: int, batch_size: int,
                 columns: Optional[Sequence[str]] = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, prefetch: int = 0,
                 shuffle_buffer_rows: Optional[int] = None, filesystem: Any = None,
                 workers_count: Optional[int] = None, **petastorm_kwargs: Any) -> None:
        self._make_batch_reader = import_make_batch_reader()
        if batch_size < 1 or not 0 <= rank < size:
            raise InvalidArgumentError(
                f"need batch_size >= 1 and 0 <= rank < size, got batch_size={batch_size}, "
                f"rank={rank}, size={size}")
        if workers_count is not None and (isinstance(workers_count, bool)
                                          or not isinstance(workers_count, int)
                                          or workers_count < 1):
            raise InvalidArgumentError(f"workers_count (train_reader_num_workers) must be an "
                                       f"integer >= 1, got {workers_count!r}")
        fs, self.files = list_parquet_files(paths_or_dir, filesystem)
        if not isinstance(fs, pafs.LocalFileSystem):
            raise InvalidArgumentError(
                f"reader='petastorm' reads local files here; {paths_or_dir!r} is on "
                f"{type(fs).__name__}. Use reader='arrow', which reads every filesystem.")
        self.rank, self.size, self.batch_size = rank, size, batch_size
        self.columns = list(columns) if columns is not None else None
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.shuffle_buffer_rows = (max(4 * batch_size, DEFAULT_SHUFFLE_BUFFER_ROWS)
                                    if shuffle_buffer_rows is None else shuffle_buffer_rows)
        self.urls = ["file://" + os.path.abspath(f) for f in self.files]
        footers = _read_footers(fs, self.files)
        pieces = [(i, md.row_group(j).num_rows) for i, md in enumerate(footers)
                  for j in range(md.num_row_groups)]
        if len(pieces) < size:
            raise InvalidArgumentError(
                f"petastorm shards by row group, and {len(self.files)} file(s) hold "
                f"{len(pieces)} row group(s) for {size} ranks. Write at least one row group "
                f"per rank, or use reader='arrow' (it splits row groups).")
        self.shares = [sum(n for k, (_, n) in enumerate(pieces) if k % size == r)
                       for r in range(size)]
        self.num_rows = self.shares[rank]
        self.shard_files = sorted({self.files[i] for k, (i, _) in enumerate(pieces)
                                   if k % size == rank})
        if drop_last:
            self.steps_per_epoch = min(self.shares) // batch_size
        else:
            self.steps_per_epoch = -(-max(self.shares) // batch_size)
        if self.steps_per_epoch == 0 or (not drop_last and min(self.shares) <
                                         self.steps_per_epoch):
            raise InvalidArgumentError(
                f"petastorm's row-group shards hold {self.shares} rows (rank by rank); with "
                f"batch_size={batch_size}{' and drop_last' if drop_last else ''} some rank "
                f"would get {'no batch' if drop_last else 'empty batches'}. Use a smaller "
                f"batch_size, more evenly sized row groups, or reader='arrow'.")
        self._kwargs = dict(petastorm_kwargs)
        if workers_count is not None:
            self._kwargs["workers_count"] = workers_count
        self._next_epoch = 0

    def __len__(self) -> int:
        return self.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        self._next_epoch = epoch

    def __iter__(self) -> Iterator[Batch]:
        epoch, self._next_epoch = self._next_epoch, self._next_epoch + 1
        return self.epoch(epoch)

    def batch_sizes(self) -> List[int]:
        if self.drop_last:
            return [self.batch_size] * self.steps_per_epoch
        return _shard.batch_sizes(self.num_rows, self.steps_per_epoch)

    def epoch(self, epoch: int) -> Iterator[Batch]:
        """This rank's ``len(self)`` batches of ``epoch``, checked against the footers."""
        sizes = self.batch_sizes()
        return _rows.checked(self._batches(epoch, sizes), expected_rows=sum(sizes),
                             expected_batches=len(sizes), what="PetastormBatchReader",
                             rank=self.rank, epoch=epoch, files=self.shard_files)

    def _batches(self, epoch: int, sizes: List[int]) -> Iterator[Batch]:
        chunks = self._chunks(epoch)
        if self.shuffle and self.shuffle_buffer_rows >= 2:
            rng = np.random.default_rng([self.seed, epoch, self.rank, 2])
            return _batching.shuffled_batches(chunks, sizes, self.shuffle_buffer_rows, rng)
        return _batching.sequential_batches(chunks, sizes)

    def _chunks(self, epoch: int) -> Iterator[Batch]:
        """The shard's row groups as petastorm's pool delivers them (module docstring, 3)."""
        # petastorm takes a seed of 0 as "no seed" (a random order): never pass 0.
        kwargs = dict(schema_fields=self.columns, cur_shard=self.rank, shard_count=self.size,
                      shuffle_row_groups=self.shuffle,
                      seed=1 + (self.seed * 1_000_003 + epoch) % (2 ** 31 - 2), num_epochs=1)
        kwargs.update(self._kwargs)
        received = 0
        with self._make_batch_reader(self.urls, **kwargs) as reader:
            items = iter(reader)
            asked_again = False
            while True:
                try:
                    item = next(items)
                except StopIteration:
                    if received >= self.num_rows or asked_again:
                        break
                    asked_again = True
                    logger.info("petastorm ended epoch %d of rank %d after %d of %d rows; "
                                "asking its pool again", epoch, self.rank, received,
                                self.num_rows)
                    continue
                asked_again = False
                chunk = {k: _as_column(v) for k, v in item._asdict().items()
                         if self.columns is None or k in self.columns}
                received += _rows.rows_of(chunk)
                yield chunk
        if received != self.num_rows:
            raise _rows.missing("PetastormBatchReader", self.rank, epoch, received,
                                self.num_rows, self.shard_files, " (from petastorm's pool)")

    def close(self) -> None:
        """Nothing to stop: each epoch's petastorm reader is closed when the epoch ends."""

    def __repr__(self) -> str:
        return (f"PetastormBatchReader(rank={self.rank}, size={self.size}, "
                f"batch_size={self.batch_size}, rows={self.num_rows} of {sum(self.shares)}, "
                f"steps_per_epoch={self.steps_per_epoch})")
