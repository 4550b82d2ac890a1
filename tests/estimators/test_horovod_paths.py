"""Horovod's estimator import paths give spark_hvd.estimators' own classes, not copies:
``from spark_hvd.spark.torch import TorchEstimator`` is a change of one import line from
``horovod.spark.torch`` (tests/compat/test_horovod_surface.py checks the names)."""

import importlib

import pytest

# Horovod's path -> the spark_hvd.estimators name of the class it must give.
SAME_CLASSES = {
    ("spark_hvd.spark.torch", "TorchEstimator"): "TorchEstimator",
    ("spark_hvd.spark.torch", "TorchModel"): "TorchModel",
    ("spark_hvd.spark.keras", "KerasEstimator"): "KerasEstimator",
    ("spark_hvd.spark.keras", "KerasModel"): "KerasModel",
    ("spark_hvd.spark.lightning", "TorchEstimator"): "LightningEstimator",
    ("spark_hvd.spark.lightning", "TorchModel"): "TorchModel",
    ("spark_hvd.spark.common.store", "Store"): "Store",
    ("spark_hvd.spark.common.store", "LocalStore"): "LocalStore",
    ("spark_hvd.spark.common.store", "FilesystemStore"): "FilesystemStore",
    ("spark_hvd.spark.common.store", "HDFSStore"): "HDFSStore",
    ("spark_hvd.spark.common.store", "DBFSLocalStore"): "DBFSLocalStore",
}


NEEDS = {"spark_hvd.spark.torch": "torch", "spark_hvd.spark.keras": "tensorflow",
         "spark_hvd.spark.lightning": "pytorch_lightning"}


@pytest.mark.parametrize("path,name", sorted(SAME_CLASSES))
def test_estimator_paths_give_the_same_classes(path, name):
    if path in NEEDS:
        pytest.importorskip(NEEDS[path])
    import spark_hvd.estimators

    assert getattr(importlib.import_module(path), name) is \
        getattr(spark_hvd.estimators, SAME_CLASSES[(path, name)])
