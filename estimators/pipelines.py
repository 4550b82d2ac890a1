"""Pipelines and PipelineModels saved to and loaded from any Store URL.

``pipeline.write().save(path)`` is pyspark's: it writes the Pipeline's own metadata through
Spark, so on an object store it needs Spark's connector for the scheme (``s3a://`` with
hadoop-aws, Databricks' ``s3://``...).  ``save_pipeline`` and ``load_pipeline`` do the same
where Spark can open the path, and where it cannot (``s3://`` on a plain Spark) write the same
layout through a Store (persistence.py): ``metadata/part-00000`` with the stage uids, and
``stages/<index>_<uid>/`` for each stage, written by the stage's own writer when it is a
spark_hvd estimator or model, as DefaultParamsWriter metadata when it is a Python stage with
``DefaultParamsWritable``, recursively when it is a Pipeline.  So a Spark that has the
connector reads it with ``PipelineModel.load``, and ``load_pipeline`` reads it without one.
A JVM stage (VectorAssembler, StringIndexer...) can only be written by Spark: such a Pipeline
on a scheme Spark cannot open is an error naming the stage, before anything is written.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, List

from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter

from spark_hvd.exceptions import InvalidArgumentError

from .persistence import (TableParamsReader, TableParamsWriter, direct_store, direct_target,
                          metadata_context, read_metadata, write_metadata)
from .store import Store

__all__ = ["save_pipeline", "load_pipeline"]

_HOW = "save_pipeline(..., overwrite=True)"


def _session() -> Any:
    from pyspark.sql import SparkSession
    return SparkSession.active()


def _stages(instance: Any) -> List[Any]:
    from pyspark.ml import Pipeline, PipelineModel
    if isinstance(instance, Pipeline):
        return list(instance.getStages())
    if isinstance(instance, PipelineModel):
        return list(instance.stages)
    raise InvalidArgumentError(
        f"save_pipeline takes a Pipeline or a PipelineModel, got {type(instance).__name__}; "
        f"save other instances with instance.write().save(path)")


def _stage_path(directory: str, uid: str, index: int, count: int) -> str:
    from pyspark.ml.pipeline import PipelineSharedReadWrite
    return PipelineSharedReadWrite.getStagePath(uid, index, count,
                                                os.path.join(directory, "stages"))


def _check_writable(instance: Any, path: str) -> None:
    """Every stage, nested ones too, can be written without Spark (else the error)."""
    for stage in _stages(instance):
        if _is_pipeline(stage):
            _check_writable(stage, path)
            continue
        writer = stage.write() if hasattr(stage, "write") else None
        if not isinstance(writer, (TableParamsWriter, DefaultParamsWriter)):
            scheme = path.split("://", 1)[0]
            raise InvalidArgumentError(
                f"stage {stage.uid} ({type(stage).__name__}) is written by Spark, which has no "
                f"filesystem for {scheme}:// here, so the pipeline cannot be saved to {path}. "
                f"Fix: give Spark the connector for the store (for S3: an s3a:// URL with "
                f"hadoop-aws on the classpath), or save to a path Spark can write (local, "
                f"HDFS, DBFS) and copy it")


def _is_pipeline(stage: Any) -> bool:
    from pyspark.ml import Pipeline, PipelineModel
    return isinstance(stage, (Pipeline, PipelineModel))


def save_pipeline(instance: Any, path: str, overwrite: bool = False) -> None:
    """Save a Pipeline or PipelineModel to ``path`` (see the module docstring); an existing
    ``path`` is replaced only with ``overwrite=True``."""
    _stages(instance)  # a Pipeline or a PipelineModel, else the error
    spark = _session()
    path = os.fspath(path)
    if direct_store(spark, path) is None:
        writer = instance.write()
        (writer.overwrite() if overwrite else writer).save(path)
        return
    _check_writable(instance, path)
    store, target = direct_target(path, overwrite, _HOW)
    _write(instance, spark, store, target)


def _write(instance: Any, spark: Any, store: Store, target: str) -> None:
    stages = _stages(instance)
    params = {"stageUids": [s.uid for s in stages], "language": "Python"}
    write_metadata(store, target,
                   DefaultParamsWriter._get_metadata_to_save(instance, metadata_context(spark),
                                                             paramMap=params))
    for index, stage in enumerate(stages):
        sub = _stage_path(target, stage.uid, index, len(stages))
        if _is_pipeline(stage):
            _write(stage, spark, store, sub)
            continue
        writer = stage.write()
        if isinstance(writer, TableParamsWriter):
            writer.save(store.to_spark_path(sub))
        else:  # a Python stage's DefaultParamsWriter: its params are its metadata
            write_metadata(store, sub, DefaultParamsWriter._get_metadata_to_save(
                stage, metadata_context(spark)))


def load_pipeline(path: str) -> Any:
    """The Pipeline or PipelineModel ``save_pipeline`` (or ``write().save``) saved at
    ``path``."""
    spark = _session()
    path = os.fspath(path)
    store = direct_store(spark, path)
    if store is None:
        return DefaultParamsReader.loadParamsInstance(path, spark)
    return _read(store, store.prefix)


def _read(store: Store, directory: str) -> Any:
    from pyspark.ml import Pipeline, PipelineModel
    metadata = read_metadata(store, directory)
    cls = _class(metadata["class"])
    if cls in (Pipeline, PipelineModel):
        uids = metadata["paramMap"]["stageUids"]
        stages = [_read(store, _stage_path(directory, uid, i, len(uids)))
                  for i, uid in enumerate(uids)]
        return cls(stages=stages)._resetUid(metadata["uid"])
    url = store.to_spark_path(directory)
    reader = cls.read() if hasattr(cls, "read") else None
    if isinstance(reader, TableParamsReader):
        return reader.load(url)
    if not isinstance(reader, DefaultParamsReader):
        raise InvalidArgumentError(
            f"stage {metadata['uid']} ({metadata['class']}) at {url} was written by Spark; "
            f"load this pipeline with PipelineModel.load/Pipeline.load on a Spark that has "
            f"the connector for the store")
    instance = cls()
    instance._resetUid(metadata["uid"])
    DefaultParamsReader.getAndSetParams(instance, metadata)
    return instance


def _class(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise InvalidArgumentError(f"the saved stage class {name} cannot be imported here "
                                   f"({exc}); install the package that defines it") from None
