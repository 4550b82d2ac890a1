"""The training data written by the executors through the Store, without Spark's writer.

Used for object stores (materialize.py's ``writer="arrow"``): Spark's Parquet writer reaches
``s3a://``, ``gs://`` or ``abfss://`` only through a Hadoop connector jar (hadoop-aws,
gcs-connector, hadoop-azure) matched to Spark's Hadoop version, and commits by renaming,
which object stores do by copying every file.  The readers already open the data through
the Store (pyarrow over fsspec), so the executors write it the same way, with the same
client and the same credentials.  The protocol:

1. The driver removes ``base`` (a failed earlier write of the same key).
2. One Spark job, ``mapInArrow``: each task writes its rows, split by the split column, to
   ``<base>/<split column>=<split>/part-<partition>.parquet`` with pyarrow, row groups of
   about ``row_group_size_bytes`` (in Arrow memory), and returns one manifest row per file it
   completed (split, path, rows).  A task that fails deletes what it wrote.
3. The driver collects the manifest: one successful attempt per partition.
4. Any other file under ``base`` (an attempt Spark gave up on, a speculative copy) is deleted,
   so the directory holds exactly the manifest.  The file names are fixed per partition, so a
   retried attempt overwrites its predecessor's file rather than adding one.

An object appears only once its upload completes, so a reader never sees half a file.
"""

from __future__ import annotations

import logging
import posixpath
from typing import Any, Dict, Iterator, List, Optional

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

MANIFEST_SCHEMA = "split string, path string, rows long"
# Spark's `compression` option names -> pyarrow's.
_CODECS = {None: "snappy", "none": "none", "uncompressed": "none", "snappy": "snappy",
           "gzip": "gzip", "zstd": "zstd", "lz4": "lz4", "lz4_raw": "lz4", "brotli": "brotli"}


def codec(compression: Optional[str]) -> str:
    """pyarrow's name for Spark's Parquet ``compression`` option (default: snappy, as Spark)."""
    key = compression.lower() if isinstance(compression, str) else compression
    if key not in _CODECS:
        from spark_hvd.exceptions import InvalidArgumentError
        raise InvalidArgumentError(
            f"compression={compression!r} is not a Parquet codec: use one of "
            f"{sorted(k for k in _CODECS if k)}")
    return _CODECS[key]


class _SplitFile:
    """One split's Parquet file of one task, written in row groups of about ``group_bytes``."""

    def __init__(self, fs: pafs.FileSystem, path: str, schema: pa.Schema, group_bytes: int,
                 compression: str) -> None:
        self.path, self.group_bytes = path, group_bytes
        self.writer = pq.ParquetWriter(path, schema, filesystem=fs, compression=compression)
        self.pending: List[pa.Table] = []
        self.pending_bytes = self.rows = 0

    def add(self, table: pa.Table) -> None:
        self.pending.append(table)
        self.pending_bytes += table.nbytes
        self.rows += table.num_rows
        if self.pending_bytes >= self.group_bytes:
            self._flush()

    def _flush(self, final: bool = False) -> None:
        """Write the pending rows as row groups of about ``group_bytes``; the rows that do not
        fill a group stay pending, unless ``final``."""
        if not self.pending:
            return
        table = pa.concat_tables(self.pending)
        per_group = max(1, int(self.group_bytes * table.num_rows / max(1, table.nbytes)))
        full = table.num_rows if final else table.num_rows - table.num_rows % per_group
        if full:
            self.writer.write_table(table.slice(0, full), row_group_size=per_group)
        rest = table.slice(full)
        self.pending = [rest] if rest.num_rows else []
        self.pending_bytes = rest.nbytes if rest.num_rows else 0

    def close(self) -> None:
        self._flush(final=True)
        self.writer.close()


def _partition_writer(store: Any, base: str, split_col: str, group_bytes: int,
                      compression: str) -> Any:
    """The ``mapInArrow`` function of step 2 (a closure: it travels with the store)."""

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext
        partition = TaskContext.get().partitionId()
        fs = store.filesystem
        files: Dict[str, _SplitFile] = {}
        try:
            for batch in batches:
                table = pa.Table.from_batches([batch])
                splits = table.column(split_col)
                rows = table.drop_columns([split_col])
                for split in pc.unique(splits).to_pylist():
                    part = rows.filter(pc.equal(splits, split))
                    if split not in files:
                        directory = posixpath.join(base, f"{split_col}={split}")
                        store.makedirs(directory)  # local stores; nothing on object stores
                        path = posixpath.join(directory, f"part-{partition:05d}.parquet")
                        files[split] = _SplitFile(fs, path, part.schema, group_bytes,
                                                  compression)
                    files[split].add(part)
            for f in files.values():
                f.close()
        except BaseException:
            for f in files.values():  # closing publishes what was written: delete it
                try:
                    f.writer.close()
                    store.delete(f.path)
                except Exception as exc:  # the driver removes it with the failed write
                    logger.warning("could not remove %s: %s", f.path, exc)
            raise
        if files:
            yield pa.RecordBatch.from_pylist(
                [{"split": s, "path": f.path, "rows": f.rows} for s, f in files.items()],
                schema=pa.schema([("split", pa.string()), ("path", pa.string()),
                                  ("rows", pa.int64())]))

    return write


def write_with_arrow(out: Any, store: Any, base: str, split_col: str,
                     row_group_size_bytes: int, compression: Optional[str]) -> List[Any]:
    """Steps 1-4 of the module docstring; the manifest rows."""
    if store.exists(base):
        store.delete(base)
    fn = _partition_writer(store, base, split_col, row_group_size_bytes, codec(compression))
    manifest = out.mapInArrow(fn, MANIFEST_SCHEMA).collect()
    kept = {r["path"] for r in manifest}
    if store.exists(base):
        found = store.filesystem.get_file_info(pafs.FileSelector(base, recursive=True))
        for info in found:
            if info.type == pafs.FileType.File and info.path not in kept:
                logger.info("removing %s: not written by a successful task", info.path)
                store.filesystem.delete_file(info.path)
    return manifest
