"""Spark ML estimators for spark_hvd, installed as ``spark_hvd.estimators``.

Stores (where intermediate data, checkpoints and logs live) and the
DataFrame -> Parquet materialization are here; TorchEstimator/KerasEstimator
build on them.
"""

from .store import DBFSLocalStore, FilesystemStore, LocalStore, Store

__all__ = ["Store", "LocalStore", "FilesystemStore", "DBFSLocalStore"]
