"""Horovod's ``horovod.spark.common.store`` path: the Stores of :mod:`spark_hvd.estimators`
(the same classes, not copies).

``Store.create(url)`` picks the class from the URL; ``FilesystemStore`` also serves the object
stores (``s3://``, ``gs://``, ``abfss://``...) through fsspec. Horovod's
``AbstractFilesystemStore`` has no counterpart: ``Store`` is the base of every store here.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for type checkers and linters; loaded on first use below
    from spark_hvd.estimators.store import (DBFSLocalStore, FilesystemStore, HDFSStore,
                                            LocalStore, Store)

__all__ = ["Store", "FilesystemStore", "LocalStore", "HDFSStore", "DBFSLocalStore"]


def __getattr__(name):
    if name in __all__:  # the estimators' classes, imported when first used, as torch.py's
        from spark_hvd.estimators import store
        return getattr(store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
