"""Horovod's ``horovod.spark.keras`` path: ``KerasEstimator`` and ``KerasModel``.

The classes are :mod:`spark_hvd.estimators`' own, so code written for Horovod changes one
import line. TensorFlow and pyspark are imported when a class is first used.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for type checkers and linters; loaded lazily below
    from spark_hvd.estimators.keras_estimator import KerasEstimator
    from spark_hvd.estimators.keras_model import KerasModel

__all__ = ["KerasEstimator", "KerasModel"]


def __getattr__(name):
    if name == "KerasEstimator":
        from spark_hvd.estimators.keras_estimator import KerasEstimator
        return KerasEstimator
    if name == "KerasModel":
        from spark_hvd.estimators.keras_model import KerasModel
        return KerasModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
