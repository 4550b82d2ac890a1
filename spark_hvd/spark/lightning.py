"""Horovod's ``horovod.spark.lightning`` path, under Horovod's names for its Lightning
estimator: ``TorchEstimator`` here is :class:`spark_hvd.estimators.LightningEstimator`, and
``TorchModel`` the model it fits (:class:`spark_hvd.estimators.TorchModel`, the same class as
``spark_hvd.spark.torch.TorchModel``).

torch, Lightning and pyspark are imported when a class is first used.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for type checkers and linters; loaded lazily below
    from spark_hvd.estimators.lightning_estimator import LightningEstimator as TorchEstimator
    from spark_hvd.estimators.torch_model import TorchModel

__all__ = ["TorchEstimator", "TorchModel"]


def __getattr__(name):
    if name == "TorchEstimator":
        from spark_hvd.estimators.lightning_estimator import LightningEstimator
        return LightningEstimator
    if name == "TorchModel":
        from spark_hvd.estimators.torch_model import TorchModel
        return TorchModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
