"""MLWriter/MLReader for the estimators and models, so that Pipelines save and load them.

A saved instance is a directory:

    metadata/   Spark ML's DefaultParamsWriter metadata (class, uid, the JSON params), so
                ``PipelineModel.load`` finds the class and calls its ``read().load``
    objects/    the params that are Python objects (the torch model with its weights, the
                optimizer, loss functions...), cloudpickled into one blob and stored as a
                one-column binary Parquet dataset (chunks of ``CHUNK_BYTES``).  A class may
                encode them first (``_encode_objects``/``_decode_objects``): the Keras
                classes keep the model as ``.keras`` bytes and the optimizer as its config

Both parts are written by Spark itself, so any path Spark can write (local, HDFS, S3,
DBFS...) works, and no filesystem client is needed on the driver.  Which params are JSON and
which are objects is the ``persist`` column of the param tables (estimators/params.py).
Loading unpickles the objects: load only what you or your team saved.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Type

from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

OBJECTS_DIR = "objects"
CHUNK_BYTES = 16 * 1024 * 1024
FORMAT_VERSION = 1
_META_KEY = "sparkHvd"


def write_blob(spark: Any, path: str, data: bytes) -> None:
    """Store ``data`` under ``path`` as binary Parquet (one Spark job)."""
    chunks = [(i, data[off:off + CHUNK_BYTES])
              for i, off in enumerate(range(0, max(len(data), 1), CHUNK_BYTES))]
    (spark.createDataFrame(chunks, "part int, data binary")
     .coalesce(1).write.mode("overwrite").parquet(path))


def read_blob(spark: Any, path: str) -> bytes:
    """The bytes ``write_blob`` stored under ``path``."""
    rows = spark.read.parquet(path).collect()
    return b"".join(bytes(r["data"]) for r in sorted(rows, key=lambda r: r["part"]))


class TableParamsWriter(MLWriter):
    """Writes a ``ParamsFromTable`` instance (see the module docstring)."""

    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        import cloudpickle
        plain, objects = self.instance._split_for_persistence()
        extra = {_META_KEY: {"format": FORMAT_VERSION, "objects": sorted(objects)}}
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sparkSession,
                                         extraMetadata=extra, paramMap=plain)
        if objects:
            write_blob(self.sparkSession, os.path.join(path, OBJECTS_DIR),
                       cloudpickle.dumps(objects))


class TableParamsReader(MLReader):
    """Reads what :class:`TableParamsWriter` wrote into a new instance of ``cls``."""

    def __init__(self, cls: Type[Any]) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        import cloudpickle
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        ours = metadata.get(_META_KEY)
        if not isinstance(ours, dict) or ours.get("format") != FORMAT_VERSION:
            raise ValueError(f"{path} was not saved by spark_hvd's {self.cls.__name__} "
                             f"(class {metadata.get('class')})")
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        if ours.get("objects"):
            objects: Dict[str, Any] = cloudpickle.loads(
                read_blob(self.sparkSession, os.path.join(path, OBJECTS_DIR)))
            instance._set(**instance._decode_objects(objects))
        return instance
