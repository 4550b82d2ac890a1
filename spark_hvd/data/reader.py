"""spark_hvd's Parquet reader: sharded by rank, equal steps per epoch, prefetched, zero-copy.

How it reads (the sharding contract is in :mod:`spark_hvd.data._shard`):

1. At construction, list the files (a directory is searched recursively; names starting with
   ``_`` or ``.`` such as ``_SUCCESS`` and ``.crc`` files are skipped) and read their footers
   only: the row count of every row group.  No data is read.
2. Each epoch, every rank computes the same row-group order and takes its contiguous share of
   the rows, reading only the row groups that overlap it (cut at the edges).
3. A background thread reads those pieces, converts them to numpy column by column and cuts
   them into the planned batches (through a shuffle buffer when ``shuffle``), at most
   ``prefetch`` batches ahead of the training loop.
"""

from __future__ import annotations

import difflib
import logging
import os
import posixpath
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..exceptions import InvalidArgumentError
from . import _batching, _rows, _shard
from ._arrow import table_to_numpy
from ._prefetch import Prefetcher

logger = logging.getLogger(__name__)

Batch = Dict[str, np.ndarray]
PathsOrDir = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]

DEFAULT_SHUFFLE_BUFFER_ROWS = 4096
_FOOTER_THREADS = 8


def as_arrow_filesystem(filesystem: Any) -> pafs.FileSystem:
    """A pyarrow filesystem as is; an fsspec filesystem wrapped for pyarrow."""
    if isinstance(filesystem, pafs.FileSystem):
        return filesystem
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec is optional
        fsspec = None
    if fsspec is not None and isinstance(filesystem, fsspec.AbstractFileSystem):
        return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem))
    raise InvalidArgumentError(
        f"filesystem must be a pyarrow.fs.FileSystem or an fsspec filesystem, "
        f"got {type(filesystem).__name__}")


def _filesystem_for(path: str, filesystem: Any) -> Tuple[pafs.FileSystem, str]:
    if filesystem is not None:
        return as_arrow_filesystem(filesystem), path
    if "://" not in path:
        return pafs.LocalFileSystem(), os.path.abspath(path)
    try:
        return pafs.FileSystem.from_uri(path)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        try:
            import fsspec
        except ImportError:
            raise InvalidArgumentError(
                f"pyarrow cannot open '{path}' and fsspec is not installed; install fsspec "
                f"(and its driver for this scheme) or pass filesystem=...") from None
        fs, p = fsspec.core.url_to_fs(path)
        return as_arrow_filesystem(fs), p


def _is_hidden(relative: str) -> bool:
    return any(part.startswith(("_", ".")) for part in relative.split("/") if part)


def list_parquet_files(paths_or_dir: PathsOrDir,
                       filesystem: Any = None) -> Tuple[pafs.FileSystem, List[str]]:
    """The filesystem and the sorted data files under ``paths_or_dir``."""
    if isinstance(paths_or_dir, (str, os.PathLike)):
        given = [os.fspath(paths_or_dir)]
    else:
        given = [os.fspath(p) for p in paths_or_dir]
    if not given:
        raise InvalidArgumentError("no Parquet path given: pass a directory or a list of files")
    fs, _ = _filesystem_for(given[0], filesystem)
    files: List[str] = []
    for raw in given:
        _, path = _filesystem_for(raw, filesystem)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise InvalidArgumentError(f"no such Parquet file or directory: '{raw}'")
        if info.type == pafs.FileType.Directory:
            base = path.rstrip("/")
            found = fs.get_file_info(pafs.FileSelector(base, recursive=True))
            files.extend(sorted(
                f.path for f in found if f.type == pafs.FileType.File
                and not _is_hidden(posixpath.relpath(f.path, base))))
        else:
            files.append(path)
    if not files:
        raise InvalidArgumentError(
            f"no Parquet files under {given}: the directory is empty or holds only hidden "
            f"files (names starting with '_' or '.')")
    return fs, files


def _read_footers(fs: pafs.FileSystem, files: Sequence[str]) -> List[pq.FileMetaData]:
    def one(path: str) -> pq.FileMetaData:
        try:
            return pq.read_metadata(path, filesystem=fs)
        except (pa.ArrowInvalid, OSError) as exc:
            raise InvalidArgumentError(f"cannot read the Parquet footer of '{path}': {exc}") \
                from exc
    if len(files) <= 1:
        return [one(p) for p in files]
    with ThreadPoolExecutor(min(_FOOTER_THREADS, len(files))) as pool:
        return list(pool.map(one, files))


class ParquetShardReader:
    """Read this rank's share of a Parquet dataset as batches of numpy columns.

    Parameters
    ----------
    paths_or_dir : str, path or list of them
        A directory (searched recursively) or Parquet files; local paths or URLs
        (``file://``, ``hdfs://``, ``s3://``, fsspec schemes...).
    rank, size : int
        This reader's rank and the number of ranks reading the same data.
    batch_size : int
        Upper bound of a batch's rows.  All ranks take ``len(reader)`` steps per epoch; a
        rank's batches differ in size by at most one row (see :mod:`spark_hvd.data._shard`).
    columns : list of str, optional
        The columns to read (default: all).
    shuffle : bool
        Permute the row groups every epoch (same permutation on every rank, seeded by
        ``(seed, epoch)``) and mix rows within the rank through a shuffle buffer.
    seed : int
        Seed of all shuffling; use the same on every rank.
    shuffle_buffer_rows : int, optional
        Rows mixed together (default ``max(4 * batch_size, 4096)``); < 2 disables row mixing
        (row groups are still permuted).
    prefetch : int
        Batches prepared ahead in a background thread; 0 reads in the caller's thread.
    filesystem : pyarrow.fs.FileSystem or fsspec filesystem, optional
        The filesystem of the paths (default: inferred from the path).
    drop_last : bool
        Give every batch exactly ``batch_size`` rows, dropping each rank's leftover rows.

    Batches are ``{column: numpy array}``; Parquet lists (Spark arrays, ``vector_to_array``)
    become 2-D arrays.  Arrays that come out zero-copy are read-only views of Arrow memory.
    Iterating the reader itself runs epoch 0, 1, 2... in turn; ``reader.epoch(e)`` runs one.
    In the rare case ``batch_size == 1`` with rows not divisible by ``size``, the ranks with
    one row fewer end the epoch with a zero-row batch so that every rank takes equal steps.
    """

    def __init__(self, paths_or_dir: PathsOrDir, *, rank: int, size: int, batch_size: int,
                 columns: Optional[Sequence[str]] = None, shuffle: bool = True, seed: int = 0,
                 shuffle_buffer_rows: Optional[int] = None, prefetch: int = 2,
                 filesystem: Any = None, drop_last: bool = False) -> None:
        _check_int("size", size, 1)
        _check_int("rank", rank, 0)
        if rank >= size:
            raise InvalidArgumentError(f"rank={rank} must be < size={size}")
        _check_int("batch_size", batch_size, 1)
        _check_int("seed", seed, 0)
        _check_int("prefetch", prefetch, 0)
        if shuffle_buffer_rows is not None:
            _check_int("shuffle_buffer_rows", shuffle_buffer_rows, 0)
        self.rank, self.size, self.batch_size = rank, size, batch_size
        self.shuffle, self.seed, self.prefetch, self.drop_last = shuffle, seed, prefetch, drop_last
        self.shuffle_buffer_rows = (max(4 * batch_size, DEFAULT_SHUFFLE_BUFFER_ROWS)
                                    if shuffle_buffer_rows is None else shuffle_buffer_rows)
        self.filesystem, self.files = list_parquet_files(paths_or_dir, filesystem)
        self._footers = _read_footers(self.filesystem, self.files)
        self.schema: pa.Schema = self._footers[0].schema.to_arrow_schema()
        self.columns = self._check_columns(columns)
        self.row_groups = [_shard.RowGroup(i, j, md.row_group(j).num_rows)
                           for i, md in enumerate(self._footers)
                           for j in range(md.num_row_groups)]
        self.num_rows = sum(g.num_rows for g in self.row_groups)
        _shard.check_shardable(self.num_rows, size, batch_size, drop_last,
                               what=f"the Parquet data in {self.files[0]!r}"
                               + (f" and {len(self.files) - 1} more file(s)"
                                  if len(self.files) > 1 else ""))
        self.steps_per_epoch = _shard.steps_per_epoch(self.num_rows, size, batch_size, drop_last)
        self._next_epoch = 0
        self._lock = threading.Lock()
        self._active: set = set()
        self._closes = 0  # close() calls: an epoch cut short by one is not missing rows

    def _check_columns(self, columns: Optional[Sequence[str]]) -> List[str]:
        names = list(self.schema.names)
        if columns is None:
            return names
        if isinstance(columns, str):
            columns = [columns]
        for path, md in zip(self.files, self._footers):
            have = set(md.schema.to_arrow_schema().names)
            missing = [c for c in columns if c not in have]
            if missing:
                hints = {c: difflib.get_close_matches(c, sorted(have), n=2) for c in missing}
                hint = "; ".join(f"'{c}' (did you mean {', '.join(map(repr, h))}?)" if h
                                 else f"'{c}'" for c, h in hints.items())
                raise InvalidArgumentError(
                    f"column(s) {hint} not found in '{path}', which has {sorted(have)}")
        return list(columns)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def plan(self, epoch: int) -> _shard.EpochPlan:
        """This rank's slices and batch sizes for ``epoch``."""
        return _shard.plan_epoch(self.row_groups, rank=self.rank, size=self.size,
                                 batch_size=self.batch_size, epoch=epoch, seed=self.seed,
                                 shuffle=self.shuffle, drop_last=self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter(reader)`` run ``epoch``."""
        self._next_epoch = epoch

    def __iter__(self) -> Iterator[Batch]:
        epoch, self._next_epoch = self._next_epoch, self._next_epoch + 1
        return self.epoch(epoch)

    def epoch(self, epoch: int) -> Iterator[Batch]:
        """Yield the ``len(self)`` batches of ``epoch`` for this rank; raise RowsMissingError
        (naming the files) if they hold fewer rows than the plan read from the footers."""
        plan = self.plan(epoch)
        files = sorted({self.files[s.group.file] for s in plan.slices})
        closes = self._closes
        return _rows.checked(self._epoch(epoch), expected_rows=plan.num_rows,
                             expected_batches=len(plan.batch_sizes), what="ParquetShardReader",
                             rank=self.rank, epoch=epoch, files=files,
                             stopped=lambda: self._closes != closes)

    def _epoch(self, epoch: int) -> Iterator[Batch]:
        if self.prefetch == 0:
            yield from self._batches(epoch)
            return
        # This body runs on the first next(), so a generator that is never started never
        # owns a thread; its finally (run on exhaustion, break or garbage collection) stops it.
        pre = Prefetcher(lambda: self._batches(epoch), self.prefetch,
                         name=f"spark_hvd-prefetch-rank{self.rank}-epoch{epoch}")
        with self._lock:
            self._active.add(pre)
        try:
            yield from pre
        finally:
            pre.close()
            with self._lock:
                self._active.discard(pre)

    def _batches(self, epoch: int) -> Iterator[Batch]:
        plan = self.plan(epoch)
        chunks = self._read(plan.slices)
        if self.shuffle and self.shuffle_buffer_rows >= 2:
            rng = np.random.default_rng([self.seed, epoch, self.rank, 1])
            return _batching.shuffled_batches(chunks, plan.batch_sizes,
                                              self.shuffle_buffer_rows, rng)
        return _batching.sequential_batches(chunks, plan.batch_sizes)

    def _read(self, slices: Sequence[_shard.Slice]) -> Iterator[Batch]:
        opened: Dict[int, pq.ParquetFile] = {}
        try:
            for piece in slices:
                group = piece.group
                pf = opened.get(group.file)
                if pf is None:
                    pf = pq.ParquetFile(self.files[group.file], filesystem=self.filesystem,
                                        metadata=self._footers[group.file])
                    opened[group.file] = pf
                table = pf.read_row_group(group.index, columns=self.columns)
                where = f" in '{self.files[group.file]}' row group {group.index}"
                if table.num_rows != group.num_rows:
                    raise _rows.RowsMissingError(
                        f"{table.num_rows} rows read{where}, whose footer says "
                        f"{group.num_rows}")
                if piece.start or piece.stop != group.num_rows:
                    table = table.slice(piece.start, piece.num_rows)
                yield table_to_numpy(table, self.columns, where)
        finally:
            for pf in opened.values():
                pf.close()

    def close(self) -> None:
        """Stop any prefetch thread still running (iterating to the end needs no close)."""
        with self._lock:
            self._closes += 1
            active, self._active = list(self._active), set()
        for pre in active:
            pre.close()

    def __enter__(self) -> "ParquetShardReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ParquetShardReader(rank={self.rank}, size={self.size}, "
                f"batch_size={self.batch_size}, rows={self.num_rows}, files={len(self.files)}, "
                f"row_groups={len(self.row_groups)}, steps_per_epoch={self.steps_per_epoch})")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}")
