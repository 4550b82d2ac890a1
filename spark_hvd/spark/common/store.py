"""Horovod's ``horovod.spark.common.store`` path: the Stores of :mod:`spark_hvd.estimators`
(the same classes, not copies).

``Store.create(url)`` picks the class from the URL; ``FilesystemStore`` also serves the object
stores (``s3://``, ``gs://``, ``abfss://``...) through fsspec. Horovod's
``AbstractFilesystemStore`` has no counterpart: ``Store`` is the base of every store here.
"""

from spark_hvd.estimators.store import (DBFSLocalStore, FilesystemStore, HDFSStore, LocalStore,
                                        Store)

__all__ = ["Store", "FilesystemStore", "LocalStore", "HDFSStore", "DBFSLocalStore"]
