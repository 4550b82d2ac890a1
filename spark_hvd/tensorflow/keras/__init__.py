"""Horovod's Keras API for Keras 3 on TensorFlow: ``import spark_hvd.tensorflow.keras as hvd``.

``DistributedOptimizer`` wraps a Keras optimizer for ``model.fit``; ``callbacks`` has
BroadcastGlobalVariablesCallback, MetricAverageCallback and the learning-rate callbacks;
``load_model`` loads a saved model with its optimizer made distributed; ``elastic`` has
KerasState and the elastic callbacks. The value-level collectives here (``allreduce``,
``allgather``, ``broadcast``, ...) take array-likes and return numpy arrays, as Horovod's
Keras API returns evaluated values.
"""

from typing import Optional

import numpy as np

from spark_hvd._basics import (ccl_built, cuda_built, ddl_built,  # noqa: F401
                               mpi_threads_supported, rocm_built)
from spark_hvd._basics import (ProcessSet, add_process_set, cross_rank, cross_size,
                               global_process_set, gloo_built, gloo_enabled, init,
                               is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                               mpi_enabled, nccl_built, rank, remove_process_set, shutdown, size,
                               start_timeline, stop_timeline)
from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.tensorflow import mpi_ops as _tf_ops
from spark_hvd.tensorflow.compression import Compression
from spark_hvd.tensorflow.functions import (allgather_object, broadcast_object,
                                            broadcast_variables)
from spark_hvd.tensorflow.keras import callbacks, elastic
from spark_hvd.tensorflow.keras.optimizer import (DistributedOptimizer,
                                                  PartialDistributedOptimizer, is_distributed)
from spark_hvd.tensorflow.mpi_ops import Adasum, Average, Max, Min, Product, Sum


def allreduce(value, name: Optional[str] = None, average=None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op=None, compression=Compression.none,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduces ``value`` over the ranks (default: Average); returns a numpy array."""
    return _tf_ops.allreduce(value, average=average, compression=compression, op=op,
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             name=name, process_set=process_set).numpy()


def allgather(value, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Concatenates every rank's ``value`` along the first dimension; returns numpy."""
    return _tf_ops.allgather(value, name=name, process_set=process_set).numpy()


def broadcast(value, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Returns root_rank's ``value`` on every rank, as numpy."""
    return _tf_ops.broadcast(value, root_rank, name=name, process_set=process_set).numpy()


def reducescatter(value, name: Optional[str] = None, op=Average,
                  process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduces ``value`` over the ranks and returns this rank's block of rows, as numpy."""
    return _tf_ops.reducescatter(value, name=name, op=op, process_set=process_set).numpy()


def broadcast_global_variables(root_rank: int):
    """TF1 only; with Keras 3 use callbacks.BroadcastGlobalVariablesCallback."""
    raise InvalidArgumentError(
        "broadcast_global_variables() is TF1-only; with Keras 3 add "
        "callbacks.BroadcastGlobalVariablesCallback(root_rank) to fit(), or call "
        "broadcast_variables(model.variables, root_rank)")


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, sparse_as_dense: bool = False,
               gradient_predivide_factor: float = 1.0, op=Average,
               backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
               process_set: ProcessSet = global_process_set):
    """``keras.models.load_model`` whose compiled optimizer (with its restored state) is made
    distributed with the given settings. ``custom_optimizers`` lists optimizer classes the
    file refers to, added to ``custom_objects``."""
    import keras

    from spark_hvd.tensorflow.keras.optimizer import _settings, make_distributed

    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        objects[cls.__name__] = cls
    model = keras.models.load_model(filepath, custom_objects=objects)
    if getattr(model, "optimizer", None) is not None:
        make_distributed(model.optimizer, _settings(
            compression, sparse_as_dense, gradient_predivide_factor, op,
            backward_passes_per_step, average_aggregated_gradients, process_set))
    return model


__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "gloo_built", "gloo_enabled", "mpi_built",
    "mpi_enabled", "nccl_built", "start_timeline", "stop_timeline", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set",
    "Sum", "Average", "Min", "Max", "Product", "Adasum", "Compression",
    "mpi_threads_supported", "cuda_built", "rocm_built", "ddl_built", "ccl_built",
    "DistributedOptimizer", "PartialDistributedOptimizer", "is_distributed", "callbacks",
    "elastic", "load_model",
    "allreduce", "allgather", "broadcast", "reducescatter", "broadcast_variables",
    "broadcast_object", "allgather_object", "broadcast_global_variables",
]
