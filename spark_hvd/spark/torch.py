"""Horovod's ``horovod.spark.torch`` path: ``TorchEstimator`` and ``TorchModel``.

The classes are :mod:`spark_hvd.estimators`' own (``spark_hvd.spark.torch.TorchEstimator is
spark_hvd.estimators.TorchEstimator``), so code written for Horovod changes one import line::

    from spark_hvd.spark.torch import TorchEstimator   # was: from horovod.spark.torch import ...

torch and pyspark are imported when a class is first used, not with this module.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for type checkers and linters; loaded lazily below
    from spark_hvd.estimators.torch_estimator import TorchEstimator
    from spark_hvd.estimators.torch_model import TorchModel

__all__ = ["TorchEstimator", "TorchModel"]


def __getattr__(name):
    if name == "TorchEstimator":
        from spark_hvd.estimators.torch_estimator import TorchEstimator
        return TorchEstimator
    if name == "TorchModel":
        from spark_hvd.estimators.torch_model import TorchModel
        return TorchModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
