"""Where estimators keep intermediate training data, checkpoints and logs.

A Store is a root path on a ``pyarrow.fs`` filesystem.  ``Store.create(url_or_path)`` picks:

* ``LocalStore`` for plain paths and ``file://`` URLs;
* ``DBFSLocalStore`` for ``/dbfs/...`` and ``dbfs:/...`` (Databricks: Python reads and writes
  through the ``/dbfs`` FUSE mount, Spark gets ``dbfs:/`` paths);
* ``FilesystemStore`` for any other URL (``hdfs://``, ``s3://``, ``gs://``, ``abfss://``...)
  through ``pyarrow.fs.FileSystem.from_uri``, or fsspec when pyarrow does not know the scheme or
  when ``storage_options`` are given (they are fsspec options).

Layout under the root::

    intermediate_train_data/<key>/   Parquet written by Spark (see materialize.py)
    runs/<run_id>/checkpoint/        model checkpoints
    runs/<run_id>/logs/              logs

Paths given to and returned by the methods are full paths in the filesystem's namespace (as the
``get_*_path`` methods return them).  ``to_spark_path`` keeps the scheme and authority of the
URL the store was created with, so create it with the scheme your Spark understands (for
example ``s3a://``; pyarrow does not know ``s3a`` and fsspec's s3fs then opens it).  Stores pickle as their URL and options and reopen their
filesystem where they are unpickled (an executor).
"""

from __future__ import annotations

import os
import posixpath
import uuid
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs

from spark_hvd.exceptions import InvalidArgumentError

DATA_DIR = "intermediate_train_data"
RUNS_DIR = "runs"
CHECKPOINT_DIR = "checkpoint"
LOGS_DIR = "logs"

# Object stores: an object appears whole when its upload completes, and "rename" is a copy.
OBJECT_STORE_SCHEMES = frozenset({"s3", "s3a", "s3n", "gs", "gcs", "abfs", "abfss", "az",
                                  "adl", "wasb", "wasbs", "oss", "r2", "memory"})


class Store:
    """A root directory on a pyarrow filesystem (see the module docstring)."""

    def __init__(self, prefix: str, filesystem: pafs.FileSystem, url: Optional[str] = None,
                 atomic_rename: bool = True) -> None:
        self._prefix = prefix.rstrip("/") or "/"
        self._filesystem = filesystem
        self.url = url if url is not None else self._prefix
        self.atomic_rename = atomic_rename

    # -- construction -------------------------------------------------------------------

    @staticmethod
    def create(url_or_path: str, **storage_options: Any) -> "Store":
        """The Store for a path or URL (see the module docstring for which class)."""
        url_or_path = os.fspath(url_or_path)
        if not url_or_path:
            raise InvalidArgumentError("a Store needs a path or URL, got ''")
        scheme = urlparse(url_or_path).scheme if "://" in url_or_path or \
            url_or_path.startswith("dbfs:") else ""
        if url_or_path.startswith("/dbfs/") or url_or_path == "/dbfs" or scheme == "dbfs":
            return DBFSLocalStore(url_or_path)
        if scheme in ("", "file"):
            return LocalStore(url_or_path)
        return FilesystemStore(url_or_path, **storage_options)

    # -- paths ----------------------------------------------------------------------------

    @property
    def prefix(self) -> str:
        """The root path in the filesystem's namespace."""
        return self._prefix

    @property
    def filesystem(self) -> pafs.FileSystem:
        return self._filesystem

    def join(self, *parts: str) -> str:
        """A path under the root."""
        return posixpath.join(self._prefix, *parts)

    def get_data_path(self, key: str) -> str:
        return self.join(DATA_DIR, key)

    def get_run_path(self, run_id: str) -> str:
        return self.join(RUNS_DIR, run_id)

    def get_checkpoint_path(self, run_id: str) -> str:
        return posixpath.join(self.get_run_path(run_id), CHECKPOINT_DIR)

    def get_logs_path(self, run_id: str) -> str:
        return posixpath.join(self.get_run_path(run_id), LOGS_DIR)

    def to_spark_path(self, path: str) -> str:
        """The URL to give Spark's reader/writer for ``path``."""
        rel = self._relative(path)
        base = self.url.rstrip("/")
        return base + "/" + rel if rel else base

    def _relative(self, path: str) -> str:
        root = self._prefix.rstrip("/")
        norm = posixpath.normpath(path) if path else path
        if norm == root or root == "" and norm == "/":
            return ""
        if not norm.startswith(root + "/"):
            raise InvalidArgumentError(
                f"path '{path}' is not under this store's root '{self._prefix}'")
        return norm[len(root) + 1:]

    # -- file operations ---------------------------------------------------------------

    def exists(self, path: str) -> bool:
        return self._filesystem.get_file_info(path).type != pafs.FileType.NotFound

    def is_dir(self, path: str) -> bool:
        return self._filesystem.get_file_info(path).type == pafs.FileType.Directory

    def makedirs(self, path: str) -> None:
        self._filesystem.create_dir(path, recursive=True)

    def listdir(self, path: str) -> List[str]:
        """The sorted names (not paths) of the entries of directory ``path``."""
        infos = self._filesystem.get_file_info(pafs.FileSelector(path, allow_not_found=False))
        return sorted(info.base_name for info in infos)

    def read_bytes(self, path: str) -> bytes:
        with self._filesystem.open_input_stream(path) as f:
            return f.read()

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one.

        Where the filesystem renames atomically (local disks, HDFS, DBFS FUSE) the bytes go
        to a temporary name in the same directory, then are renamed over ``path``.  Object
        stores (s3, gs, abfs, memory...) have no atomic rename but publish an object only when
        its upload completes, so there the bytes are written to ``path`` directly.
        """
        parent = posixpath.dirname(path)
        if parent:
            self.makedirs(parent)
        if not self.atomic_rename:
            with self._filesystem.open_output_stream(path) as f:
                f.write(data)
            return
        tmp = posixpath.join(parent, f".{posixpath.basename(path)}.{uuid.uuid4().hex}.tmp")
        try:
            with self._filesystem.open_output_stream(tmp) as f:
                f.write(data)
            self._filesystem.move(tmp, path)
        except BaseException:
            self._delete_quietly(tmp)
            raise

    def delete(self, path: str) -> None:
        """Remove ``path`` (a file, or a directory and everything in it); absent is fine.

        Only paths strictly under the store's root can be deleted.
        """
        if not self._relative(path):
            raise InvalidArgumentError(f"refusing to delete the store root '{self._prefix}'")
        info = self._filesystem.get_file_info(path)
        if info.type == pafs.FileType.Directory:
            self._filesystem.delete_dir(path)
        elif info.type != pafs.FileType.NotFound:
            self._filesystem.delete_file(path)

    def _delete_quietly(self, path: str) -> None:
        try:
            self._filesystem.delete_file(path)
        except (OSError, pa.ArrowException):
            pass

    # -- pickling ------------------------------------------------------------------------

    def _reopen_args(self) -> Tuple[Any, ...]:
        return (self._prefix, self._filesystem, self.url, self.atomic_rename)

    def __reduce__(self):
        return (type(self), self._reopen_args())

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._reopen_args() == self._reopen_args()

    def __hash__(self) -> int:
        return hash((type(self), self._prefix, self.url))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class LocalStore(Store):
    """A directory on the local (or locally mounted) filesystem."""

    def __init__(self, path: str) -> None:
        path = os.fspath(path)
        if path.startswith("file:"):
            parsed = urlparse(path)
            if parsed.netloc not in ("", "localhost"):
                raise InvalidArgumentError(
                    f"'{path}' names host '{parsed.netloc}'; a file: URL must be file:///abs/path")
            path = parsed.path
        root = os.path.abspath(os.path.expanduser(path))
        super().__init__(root, pafs.LocalFileSystem(), url="file://" + root)

    def _reopen_args(self) -> Tuple[Any, ...]:
        return (self._prefix,)


class DBFSLocalStore(LocalStore):
    """A DBFS directory used through the ``/dbfs`` FUSE mount; Spark gets ``dbfs:/`` URLs."""

    def __init__(self, path: str) -> None:
        path = os.fspath(path)
        if path.startswith("dbfs:"):
            rest = path[len("dbfs:"):].lstrip("/")
            path = "/dbfs/" + rest
        if not (path == "/dbfs" or path.startswith("/dbfs/")):
            raise InvalidArgumentError(f"'{path}' is not a DBFS path (/dbfs/... or dbfs:/...)")
        super().__init__(path)
        rel = self._prefix[len("/dbfs"):].lstrip("/")
        self.url = "dbfs:/" + rel


class FilesystemStore(Store):
    """A root on any filesystem pyarrow or fsspec can open from a URL."""

    def __init__(self, url: str, **storage_options: Any) -> None:
        self.storage_options: Dict[str, Any] = dict(storage_options)
        filesystem, prefix, scheme = _open_url(url, self.storage_options)
        super().__init__(prefix, filesystem, url=url.rstrip("/"),
                         atomic_rename=scheme not in OBJECT_STORE_SCHEMES)

    def _reopen_args(self) -> Tuple[Any, ...]:
        return (self.url,)

    def __reduce__(self):
        return (_reopen_filesystem_store, (self.url, self.storage_options))


def _reopen_filesystem_store(url: str, storage_options: Dict[str, Any]) -> FilesystemStore:
    return FilesystemStore(url, **storage_options)


def _open_url(url: str, storage_options: Dict[str, Any]) -> Tuple[pafs.FileSystem, str, str]:
    scheme = urlparse(url).scheme.lower()
    if not storage_options:
        try:
            fs, path = pafs.FileSystem.from_uri(url)
            return fs, path, scheme
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass  # a scheme pyarrow does not know: try fsspec
    try:
        import fsspec
    except ImportError:
        raise InvalidArgumentError(
            f"pyarrow cannot open '{url}' and fsspec is not installed; "
            f"pip install fsspec (and the driver for '{scheme}://', e.g. s3fs, gcsfs, adlfs)") \
            from None
    try:
        fs, path = fsspec.core.url_to_fs(url, **storage_options)
    except (ImportError, ValueError) as exc:
        raise InvalidArgumentError(f"cannot open store URL '{url}': {exc}") from exc
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path, scheme
