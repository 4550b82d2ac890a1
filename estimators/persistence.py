"""MLWriter/MLReader for the estimators and models, so that Pipelines save and load them.

A saved instance is a directory:

    metadata/   Spark ML's DefaultParamsWriter metadata (class, uid, the JSON params), so
                ``PipelineModel.load`` finds the class and calls its ``read().load``
    objects/    the params that are Python objects (the torch model with its weights, the
                optimizer, loss functions...), cloudpickled into one blob and stored as a
                one-column binary Parquet dataset (chunks of ``CHUNK_BYTES``).  A class may
                encode them first (``_encode_objects``/``_decode_objects``): the Keras
                classes keep the model as ``.keras`` bytes and the optimizer as its config

Both parts are written by Spark itself when Spark has a filesystem for the path's scheme
(local, HDFS, DBFS, and object stores through the cluster's connector: ``s3a://`` with
hadoop-aws...), so no filesystem client is needed on the driver.  An object-store URL Spark
has no connector for (``s3://`` on a plain Spark, where Hadoop knows no ``s3`` filesystem)
is written and read through a Store instead (pyarrow over fsspec, as the training data):
the same files, ``metadata/part-00000`` and ``objects/part-00000.parquet``, which Spark's
readers read too.  A Pipeline's own metadata is written by pyspark's writer, through Spark,
so ``pipeline.write().save`` on an object store needs Spark's connector for that scheme;
pipelines.py (``save_pipeline``/``load_pipeline``) writes it through a Store instead.  Which params
are JSON and which are objects is the ``persist`` column of the param tables
(estimators/params.py).  Loading unpickles the objects: load only what you or your team saved.
"""

from __future__ import annotations

import io
import os
import posixpath
from typing import Any, Dict, Optional, Type
from urllib.parse import urlparse

from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.spark import is_connect

from .store import OBJECT_STORE_SCHEMES, Store

OBJECTS_DIR = "objects"
METADATA_DIR = "metadata"
CHUNK_BYTES = 16 * 1024 * 1024
FORMAT_VERSION = 1
_META_KEY = "sparkHvd"


def write_blob(spark: Any, path: str, data: bytes) -> None:
    """Store ``data`` under ``path`` as binary Parquet (one Spark job)."""
    (spark.createDataFrame(_chunks(data), "part int, data binary")
     .coalesce(1).write.mode("overwrite").parquet(path))


def read_blob(spark: Any, path: str) -> bytes:
    """The bytes ``write_blob`` stored under ``path``."""
    rows = spark.read.parquet(path).collect()
    return b"".join(bytes(r["data"]) for r in sorted(rows, key=lambda r: r["part"]))


def _chunks(data: bytes) -> list:
    return [(i, data[off:off + CHUNK_BYTES])
            for i, off in enumerate(range(0, max(len(data), 1), CHUNK_BYTES))]


def spark_can_open(spark: Any, path: str) -> bool:
    """Whether Spark's Hadoop configuration has a filesystem for ``path``'s scheme (under
    Spark Connect, where the driver cannot ask, assumed so)."""
    scheme = urlparse(path).scheme if "://" in path else ""
    if scheme in ("", "file"):
        return True
    try:
        jvm, conf = spark._jvm, spark._jsc.hadoopConfiguration()
    except Exception:  # Spark Connect: no JVM handle
        return True
    try:
        jvm.org.apache.hadoop.fs.FileSystem.getFileSystemClass(scheme, conf)
        return True
    except Exception:  # UnsupportedFileSystemException, through py4j
        return False


def metadata_context(spark: Any) -> Any:
    """What pyspark's DefaultParamsWriter/Reader take for ``spark``: its SparkContext (the
    only thing pyspark 3.5 takes; later versions also take a session), or under Spark
    Connect, which has no SparkContext, the session (pyspark >= 4.0)."""
    if not is_connect(spark):
        return spark.sparkContext
    _require_connect_ml()
    return spark


def _require_connect_ml() -> None:
    """An error naming the version needed where pyspark has no Spark ML on Connect (its
    Connect server's ML helper, from pyspark 4.0)."""
    import pyspark
    import pyspark.ml.util as ml_util
    if not hasattr(ml_util, "ML_CONNECT_HELPER_ID"):
        raise InvalidArgumentError(
            f"saving or loading a spark_hvd model or estimator under Spark Connect needs "
            f"pyspark >= 4.0 (Spark ML on Connect); this is pyspark {pyspark.__version__}. "
            f"Save it from a classic SparkSession, or save the framework model itself "
            f"(model.getModel())")


def connect_overwrite(path: str) -> None:
    """Deletes ``path`` on the Spark Connect server, as ``write().overwrite()`` does (pyspark's
    MLWriter deletes through the JVM, which a Connect client does not have)."""
    _require_connect_ml()
    from pyspark.ml.util import ML_CONNECT_HELPER_ID
    from pyspark.ml.wrapper import JavaWrapper
    JavaWrapper(java_obj=ML_CONNECT_HELPER_ID)._call_java("handleOverwrite", path, True)


def direct_store(spark: Any, path: str) -> Optional[Store]:
    """A Store rooted at ``path`` when it is an object-store URL Spark cannot open; None
    when Spark reads and writes it (see the module docstring)."""
    scheme = urlparse(path).scheme.lower() if "://" in path else ""
    if scheme not in OBJECT_STORE_SCHEMES or spark_can_open(spark, path):
        return None
    return Store.create(path)


def direct_target(path: str, overwrite: bool,
                  how: str = "write().overwrite().save(path)") -> tuple:
    """``(store, directory)`` for writing an instance to ``path`` through a Store: an existing
    ``path`` is removed when ``overwrite``, else an error naming ``how`` to replace it."""
    parent, name = posixpath.split(path.rstrip("/"))
    store = Store.create(parent)  # to delete `path` itself (a store never deletes its root)
    target = store.join(name)
    if store.exists(target):
        if not overwrite:
            raise InvalidArgumentError(f"path {path} already exists; use {how} to replace it")
        store.delete(target)
    return store, target


def write_metadata(store: Store, target: str, text: str) -> None:
    """A DefaultParamsWriter metadata JSON line, where Spark's writer puts it."""
    store.write_bytes_atomic(posixpath.join(target, METADATA_DIR, "part-00000"),
                             (text + "\n").encode())


def read_metadata(store: Store, directory: str) -> Dict[str, Any]:
    """The metadata of the instance saved in ``directory`` (by Spark or ``write_metadata``)."""
    meta_dir = posixpath.join(directory, METADATA_DIR)
    if not store.is_dir(meta_dir):
        where = store.to_spark_path(directory)
        raise InvalidArgumentError(f"{where} holds no saved instance (no {METADATA_DIR}/)")
    text = store.read_bytes(_visible_files(store, meta_dir)[0]).decode()
    return DefaultParamsReader._parseMetaData(text.splitlines()[0])


def _save_direct(instance: Any, spark: Any, path: str, overwrite: bool,
                 extra: Dict[str, Any], plain: Dict[str, Any], blob: Optional[bytes]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    store, target = direct_target(path, overwrite)
    write_metadata(store, target,
                   DefaultParamsWriter._get_metadata_to_save(instance, metadata_context(spark),
                                                             extra, plain))
    if blob is not None:
        parts = _chunks(blob)
        table = pa.table({"part": pa.array([p for p, _ in parts], pa.int32()),
                          "data": pa.array([d for _, d in parts], pa.binary())})
        sink = io.BytesIO()
        pq.write_table(table, sink)
        store.write_bytes_atomic(posixpath.join(target, OBJECTS_DIR, "part-00000.parquet"),
                                 sink.getvalue())


def _visible_files(store: Store, directory: str) -> list:
    return [posixpath.join(directory, n) for n in store.listdir(directory)
            if not n.startswith(("_", "."))]


def _load_direct(store: Store) -> tuple:
    """(metadata dict, objects blob or None) of what ``_save_direct`` (or Spark) wrote."""
    import pyarrow.parquet as pq
    metadata = read_metadata(store, store.prefix)
    objects_dir = store.join(OBJECTS_DIR)
    if not store.is_dir(objects_dir):
        return metadata, None
    rows = []
    for f in _visible_files(store, objects_dir):
        rows += pq.read_table(io.BytesIO(store.read_bytes(f))).to_pylist()
    return metadata, b"".join(r["data"] for r in sorted(rows, key=lambda r: r["part"]))


class TableParamsWriter(MLWriter):
    """Writes a ``ParamsFromTable`` instance (see the module docstring)."""

    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance

    def save(self, path: str) -> None:
        if direct_store(self.sparkSession, path) is None:
            if self.shouldOverwrite and is_connect(self.sparkSession):
                connect_overwrite(path)
                self.saveImpl(path)
            else:
                super().save(path)
            return
        plain, objects, extra = self._parts()
        _save_direct(self.instance, self.sparkSession, path, self.shouldOverwrite, extra,
                     plain, self._blob(objects))

    def _parts(self) -> tuple:
        plain, objects = self.instance._split_for_persistence()
        extra = {_META_KEY: {"format": FORMAT_VERSION, "objects": sorted(objects)}}
        return plain, objects, extra

    @staticmethod
    def _blob(objects: Dict[str, Any]) -> Optional[bytes]:
        import cloudpickle
        return cloudpickle.dumps(objects) if objects else None

    def saveImpl(self, path: str) -> None:
        plain, objects, extra = self._parts()
        DefaultParamsWriter.saveMetadata(self.instance, path, metadata_context(self.sparkSession),
                                         extraMetadata=extra, paramMap=plain)
        if objects:
            write_blob(self.sparkSession, os.path.join(path, OBJECTS_DIR), self._blob(objects))


class TableParamsReader(MLReader):
    """Reads what :class:`TableParamsWriter` wrote into a new instance of ``cls``."""

    def __init__(self, cls: Type[Any]) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        import cloudpickle
        store = direct_store(self.sparkSession, path)
        if store is None:
            metadata = DefaultParamsReader.loadMetadata(path, metadata_context(self.sparkSession))
        else:
            metadata, blob = _load_direct(store)
        ours = metadata.get(_META_KEY)
        if not isinstance(ours, dict) or ours.get("format") != FORMAT_VERSION:
            raise ValueError(f"{path} was not saved by spark_hvd's {self.cls.__name__} "
                             f"(class {metadata.get('class')})")
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        if ours.get("objects"):
            if store is None:
                blob = read_blob(self.sparkSession, os.path.join(path, OBJECTS_DIR))
            objects: Dict[str, Any] = cloudpickle.loads(blob)
            instance._set(**instance._decode_objects(objects))
        return instance
