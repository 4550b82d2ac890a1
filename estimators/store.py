"""Where estimators keep intermediate training data, checkpoints and logs.

A Store is a root path on a ``pyarrow.fs`` filesystem.  ``Store.create(url_or_path)`` picks:

* ``LocalStore`` for plain paths and ``file://`` URLs;
* ``DBFSLocalStore`` for ``/dbfs/...`` and ``dbfs:/...`` (Databricks: Python reads and writes
  through the ``/dbfs`` FUSE mount, Spark gets ``dbfs:/`` paths);
* ``FilesystemStore`` for any other URL (``_open_url`` picks the client):

  - object stores (``s3://``, ``s3a://``, ``gs://``, ``abfss://``, ``az://``... see
    ``OBJECT_STORE_DRIVERS``) through fsspec and the scheme's driver (s3fs, gcsfs, adlfs),
    never pyarrow's own S3 client, which contacts AWS to find the bucket's region whenever it
    is created (a request per executor, and a 6 s failure where AWS cannot be reached);
    credentials and endpoints come from the cloud SDK's usual sources (environment variables,
    ``~/.aws/config``, instance roles...) of each process that opens the store, or from
    ``storage_options``.  A missing driver is an error naming the package to install;
  - ``hdfs://`` (and ``viewfs://``) through ``pyarrow.fs.HadoopFileSystem`` (libhdfs and a
    JVM; a missing one is an error naming what to set);
  - anything else through ``pyarrow.fs.FileSystem.from_uri``, or fsspec when pyarrow does not
    know the scheme or when ``storage_options`` are given (they are fsspec options).

Layout under the root::

    intermediate_train_data/<key>/   Parquet written by Spark (see materialize.py)
    runs/<run_id>/checkpoint/        model checkpoints
    runs/<run_id>/logs/              logs

Paths given to and returned by the methods are full paths in the filesystem's namespace (as the
``get_*_path`` methods return them).  ``to_spark_path`` keeps the scheme and authority of the
URL the store was created with (Spark writes the training data of local, DBFS and HDFS stores;
on object stores the executors write it through the store, see materialize.py).  Stores
pickle as their URL and options and reopen their filesystem where they are unpickled (an
executor): ``storage_options`` travel with them, credentials from the environment do not.

Writes: ``write_bytes_atomic`` writes a temporary object next to the target, checks its size,
then moves it over the target: a rename on local disks, HDFS and DBFS, a server-side copy on
object stores, which publish an object whole.  A reader therefore sees the old file or the
whole new one, never a half-written one, on every store.  A temporary left by a process killed
mid-write (``.<name>.<32 hex>.tmp``, hidden from the data reader) is removed by the next write
of the same name, and by ``remove_temporaries`` (fit calls it when it resumes a run).
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
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

logger = logging.getLogger(__name__)

# Object stores: no directories, an object appears whole when its upload completes, and
# "rename" is a copy.  Each scheme's fsspec driver, as `pip install` names it.
OBJECT_STORE_DRIVERS = {
    "s3": "s3fs", "s3a": "s3fs", "s3n": "s3fs",
    "gs": "gcsfs", "gcs": "gcsfs",
    "abfs": "adlfs", "abfss": "adlfs", "az": "adlfs", "adl": "adlfs",
    "wasb": "adlfs", "wasbs": "adlfs",
    "oss": "ossfs",
    "memory": "fsspec",
}
OBJECT_STORE_SCHEMES = frozenset(OBJECT_STORE_DRIVERS)
HADOOP_SCHEMES = frozenset({"hdfs", "viewfs"})

_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.[0-9a-f]{32}\.tmp$")


class Store:
    """A root directory on a pyarrow filesystem (see the module docstring)."""

    def __init__(self, prefix: str, filesystem: pafs.FileSystem, url: Optional[str] = None,
                 object_store: bool = False) -> None:
        self._prefix = prefix.rstrip("/") or "/"
        self._filesystem = filesystem
        self.url = url if url is not None else self._prefix
        #: No directories and no atomic rename (s3, gs, abfs...): see the module docstring.
        self.object_store = object_store

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
        """Create directory ``path`` and its parents; nothing on object stores, which have no
        directories (and where fsspec would create a missing bucket)."""
        if not self.object_store:
            self._filesystem.create_dir(path, recursive=True)

    def listdir(self, path: str) -> List[str]:
        """The sorted names (not paths) of the entries of directory ``path``."""
        infos = self._filesystem.get_file_info(pafs.FileSelector(path, allow_not_found=False))
        return sorted(info.base_name for info in infos if not _below_an_entry(path, info.path))

    def read_bytes(self, path: str) -> bytes:
        with self._filesystem.open_input_stream(path) as f:
            return f.read()

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one.

        The bytes go to a temporary name in the same directory; once its size is checked it is
        moved over ``path`` (see the module docstring).  Temporaries of ``path`` left by a
        killed writer are removed first.
        """
        parent, name = posixpath.split(path)
        if parent:
            self.makedirs(parent)
            self.remove_temporaries(parent, name)
        tmp = posixpath.join(parent, f".{name}.{uuid.uuid4().hex}.tmp")
        try:
            with self._filesystem.open_output_stream(tmp) as f:
                f.write(data)
            written = self._filesystem.get_file_info(tmp).size
            if written != len(data):
                raise OSError(f"writing {path}: the temporary {tmp} holds {written} bytes of "
                              f"{len(data)}; the old file is left as it was")
            self._filesystem.move(tmp, path)
        except BaseException:
            self._delete_quietly(tmp)
            raise

    def remove_temporaries(self, directory: str, name: Optional[str] = None) -> List[str]:
        """Remove the temporaries ``write_bytes_atomic`` left in ``directory`` (only those of
        ``name`` when given): what a writer killed mid-write leaves.  Returns their paths."""
        try:
            names = self.listdir(directory)
        except (FileNotFoundError, NotADirectoryError):
            return []
        stale = [posixpath.join(directory, n) for n in names
                 if (m := _TEMPORARY.match(n)) and (name is None or m.group("name") == name)]
        for path in stale:
            logger.info("removing %s, left by an interrupted write", path)
            self._delete_quietly(path)
        return stale

    def check_writable(self) -> None:
        """Raise InvalidArgumentError naming the store and the fix unless a file can be
        written, read back and deleted under the root.  Leaves nothing behind: directories it
        had to create are removed again."""
        created = [] if self.object_store else self._missing_dirs(self._prefix)
        probe = self.join(f".spark_hvd-write-check-{uuid.uuid4().hex}")
        try:
            self.makedirs(self._prefix)
            with self._filesystem.open_output_stream(probe) as f:
                f.write(b"ok")
            self._filesystem.delete_file(probe)
        except Exception as exc:  # any failure (OSError, a cloud SDK's own) means: not usable
            self._delete_quietly(probe)
            raise InvalidArgumentError(
                f"the store {self.url} is not writable: writing {probe} failed with "
                f"{type(exc).__name__}: {exc}. {self._writable_fix()}") from None
        finally:
            for path in created:
                try:
                    self._filesystem.delete_dir(path)
                except Exception:  # as below: the probe's own error is the one to raise
                    pass

    def _missing_dirs(self, path: str) -> List[str]:
        """``path`` and its ancestors that do not exist yet, innermost first."""
        missing = []
        while path and path != posixpath.dirname(path):
            try:
                if self._filesystem.get_file_info(path).type != pafs.FileType.NotFound:
                    break
            except (OSError, pa.ArrowException):
                break
            missing.append(path)
            path = posixpath.dirname(path)
        return missing

    def _writable_fix(self) -> str:
        if self.object_store:
            return ("Fix: check that the bucket or container exists and that the credentials "
                    "this process finds (environment variables, the cloud SDK's config files, "
                    "an instance role) may write under this prefix on the driver and on every "
                    "executor; or pass credentials or an endpoint as storage_options to "
                    "Store.create.")
        return ("Fix: create the directory, or give a path this user can write on the driver "
                "and on every executor (on a cluster: a shared filesystem such as HDFS, DBFS "
                "or an object store).")

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
        """Delete ``path`` if it can be; any failure (OSError, Arrow's, or a cloud SDK's own,
        such as botocore's NoCredentialsError) is ignored: this runs while another error is
        being raised, which must not be replaced."""
        try:
            self._filesystem.delete_file(path)
        except Exception:
            pass

    # -- pickling ------------------------------------------------------------------------

    def _reopen_args(self) -> Tuple[Any, ...]:
        return (self._prefix, self._filesystem, self.url, self.object_store)

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
                         object_store=scheme in OBJECT_STORE_SCHEMES)

    def _reopen_args(self) -> Tuple[Any, ...]:
        return (self.url,)

    def __reduce__(self):
        return (_reopen_filesystem_store, (self.url, self.storage_options))


class HDFSStore(FilesystemStore):
    """Horovod's ``HDFSStore``: ``prefix_path`` on HDFS (``hdfs://host:port/path``, or a path
    with ``host``/``port`` given apart), through pyarrow's HadoopFileSystem (a JVM and
    libhdfs on the driver and every executor). ``user`` and ``kerb_ticket`` go to it;
    ``driver`` must be ``'libhdfs'`` (pyarrow dropped libhdfs3); ``extra_conf`` and
    ``temp_dir`` are accepted for Horovod compatibility."""

    def __init__(self, prefix_path: str, host: Optional[str] = None,
                 port: Optional[int] = None, user: Optional[str] = None,
                 kerb_ticket: Optional[str] = None, driver: str = "libhdfs",
                 extra_conf: Optional[Dict[str, str]] = None, temp_dir: Optional[str] = None,
                 *args: Any, **kwargs: Any) -> None:
        if driver != "libhdfs":
            raise InvalidArgumentError(f"HDFSStore(driver={driver!r}): only 'libhdfs' is "
                                       f"available (pyarrow's HadoopFileSystem)")
        super().__init__(hdfs_url(prefix_path, host, port, user, kerb_ticket))


def hdfs_url(prefix_path: str, host: Optional[str] = None, port: Optional[int] = None,
             user: Optional[str] = None, kerb_ticket: Optional[str] = None) -> str:
    """The ``hdfs://`` URL of HDFSStore's arguments (user and ticket as pyarrow's query
    options)."""
    parsed = urlparse(prefix_path)
    if parsed.scheme:
        if parsed.scheme.lower() not in HADOOP_SCHEMES:
            raise InvalidArgumentError(f"HDFSStore needs an hdfs:// path, got {prefix_path!r}")
        url = prefix_path
    else:
        where = f"{host or 'default'}" + (f":{port}" if port else "")
        url = f"hdfs://{where}/{prefix_path.lstrip('/')}"
    query = "&".join(f"{k}={v}" for k, v in (("user", user), ("kerb_ticket", kerb_ticket)) if v)
    return f"{url}{'&' if '?' in url else '?'}{query}" if query else url


def _below_an_entry(directory: str, path: str) -> bool:
    """Whether ``path``, listed for ``directory``, lies below one of its entries: adlfs's
    ``find`` ignores ``maxdepth``, so pyarrow lists an Azure directory recursively."""
    prefix = directory.rstrip("/") + "/"
    return path.startswith(prefix) and "/" in path[len(prefix):].strip("/")


def _reopen_filesystem_store(url: str, storage_options: Dict[str, Any]) -> FilesystemStore:
    return FilesystemStore(url, **storage_options)


def _open_url(url: str, storage_options: Dict[str, Any]) -> Tuple[pafs.FileSystem, str, str]:
    scheme = urlparse(url).scheme.lower()
    if scheme in OBJECT_STORE_SCHEMES:
        return _open_fsspec(url, scheme, storage_options)
    if scheme in HADOOP_SCHEMES and not storage_options:
        return _open_hadoop(url, scheme)
    if not storage_options:
        try:
            fs, path = pafs.FileSystem.from_uri(url)
            return fs, path, scheme
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass  # a scheme pyarrow does not know: try fsspec
    return _open_fsspec(url, scheme, storage_options)


def _open_fsspec(url: str, scheme: str, storage_options: Dict[str, Any]
                 ) -> Tuple[pafs.FileSystem, str, str]:
    """``url`` through fsspec.  Object stores get ``use_listings_cache=False`` unless the
    options say otherwise: other processes (the executors) write there, and a cached listing
    would miss their files."""
    package = OBJECT_STORE_DRIVERS.get(scheme)
    install = f"pip install {package}" if package else "pip install the fsspec driver for it"
    try:
        import fsspec
    except ImportError:
        raise InvalidArgumentError(
            f"cannot open the store '{url}': fsspec is not installed; pip install fsspec "
            f"{package or ''}".rstrip()) from None
    options = dict(storage_options)
    if scheme in OBJECT_STORE_SCHEMES and scheme != "memory":
        options.setdefault("use_listings_cache", False)
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        raise InvalidArgumentError(
            f"cannot open the store '{url}': the fsspec driver for '{scheme}://' does not "
            f"import ({exc}). Fix: {install} on the driver and on every executor"
            f"{' (or pip install spark_hvd[s3])' if package == 's3fs' else ''}.") from None
    except ValueError as exc:  # "Protocol not known": no installed driver registers it
        fix = (f" Fix: {install} on the driver and on every executor." if package else "")
        raise InvalidArgumentError(f"cannot open store URL '{url}': {exc}.{fix}") from None
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path, scheme


def _open_hadoop(url: str, scheme: str) -> Tuple[pafs.FileSystem, str, str]:
    """``hdfs://`` through pyarrow's HadoopFileSystem, which loads libhdfs and a JVM."""
    try:
        fs, path = pafs.FileSystem.from_uri(url)
    except (OSError, pa.ArrowException) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidArgumentError(
            f"cannot open the store '{url}' with pyarrow's HadoopFileSystem: {first}. It needs "
            f"a JVM and libhdfs on the driver and on every executor: set JAVA_HOME, "
            f"HADOOP_HOME (or ARROW_LIBHDFS_DIR, the directory holding libhdfs.so) and "
            f"CLASSPATH=$(hadoop classpath --glob), and check that the namenode in the URL "
            f"answers.") from None
    return fs, path, scheme
