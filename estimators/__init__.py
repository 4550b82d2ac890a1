"""Spark ML estimators for spark_hvd, installed as ``spark_hvd.estimators``.

Stores (where intermediate data, checkpoints and logs live) and the
DataFrame -> Parquet materialization are here; TorchEstimator/TorchModel,
LightningEstimator (whose fitted model is a TorchModel) and KerasEstimator/KerasModel build
on them (torch, or TensorFlow and Keras, are imported
only when they are used).
"""

from .store import DBFSLocalStore, FilesystemStore, HDFSStore, LocalStore, Store

__all__ = ["Store", "LocalStore", "FilesystemStore", "DBFSLocalStore", "HDFSStore",
           "TorchEstimator", "TorchModel", "KerasEstimator", "KerasModel", "LightningEstimator",
           "save_pipeline", "load_pipeline"]

_LAZY = {"TorchEstimator": ".torch_estimator", "TorchModel": ".torch_model",
         "KerasEstimator": ".keras_estimator", "KerasModel": ".keras_model",
         "LightningEstimator": ".lightning_estimator",
         "save_pipeline": ".pipelines", "load_pipeline": ".pipelines"}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
