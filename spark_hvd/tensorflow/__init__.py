"""Horovod's TensorFlow 2 API on spark_hvd: ``import spark_hvd.tensorflow as hvd``.

Collectives take and return ``tf.Tensor`` s, eagerly and inside ``tf.function`` (not
under XLA: see :mod:`spark_hvd.tensorflow.mpi_ops`), with gradients.
``DistributedGradientTape`` is for custom training loops; Keras models use
``spark_hvd.tensorflow.keras.DistributedOptimizer`` (``DistributedOptimizer`` here
accepts Keras optimizers too). TensorFlow 1 graph mode (``tf.compat.v1``, in a session or
MonitoredTrainingSession) has ``DistributedOptimizer`` on tf.compat.v1.train optimizers,
``broadcast_global_variables`` and ``BroadcastGlobalVariablesHook``. ``elastic`` has the
elastic states (TensorFlowKerasState, TensorFlowState) and ``run``.
"""

from spark_hvd._basics import (ccl_built, cuda_built, ddl_built,  # noqa: F401
                               mpi_threads_supported, rocm_built)
from spark_hvd._basics import (ProcessSet, add_process_set, cross_rank, cross_size,
                               global_process_set, gloo_built, gloo_enabled, init,
                               is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                               mpi_enabled, nccl_built, rank, remove_process_set, shutdown, size,
                               start_timeline, stop_timeline)
from spark_hvd._types import ReduceOp
from spark_hvd.exceptions import (CollectiveTimeoutError, HorovodInternalError,
                                  HostsUpdatedInterrupt, InternalError, InvalidArgumentError,
                                  NotInitializedError, PeerLostError, SparkHvdError,
                                  TensorMismatchError)
from spark_hvd.tensorflow.compression import Compression
from spark_hvd.tensorflow._legacy import BroadcastGlobalVariablesHook, broadcast_global_variables
from spark_hvd.tensorflow.functions import (allgather_object, broadcast_object,
                                            broadcast_object_fn, broadcast_variables)
from spark_hvd.tensorflow.gradient_tape import (DistributedGradientTape,
                                                PartialDistributedGradientTape)
from spark_hvd.tensorflow.sync_batch_norm import SyncBatchNormalization
from spark_hvd.tensorflow.mpi_ops import (Adasum, Average, Max, Min, Product, Sum, allgather,
                                          allreduce, alltoall, barrier, broadcast, broadcast_,
                                          grouped_allgather, grouped_allreduce,
                                          grouped_reducescatter, join, local_rank_op,
                                          local_size_op, process_set_included_op, rank_op,
                                          reducescatter, size_op)
from spark_hvd.tensorflow import elastic  # hvd.elastic: imported last, it uses the above


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",
                         device_sparse="", compression=Compression.none,
                         sparse_as_dense=False, backward_passes_per_step=1, op=Average,
                         gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set,
                         scale_local_gradients=True):
    """Wraps an optimizer so that it applies gradients reduced across the ranks.

    A Keras optimizer gets :func:`spark_hvd.tensorflow.keras.DistributedOptimizer`. A
    ``tf.compat.v1.train.Optimizer`` (TF1 graph mode, or eagerly) gets a copy of itself whose
    ``compute_gradients`` (so ``minimize``) returns the gradients reduced in one fused group
    (``op``, default Average; ``compression``, ``gradient_predivide_factor``,
    ``sparse_as_dense``, ``process_set``; ``register_local_var(v)`` keeps ``v``'s gradient
    local). In a graph, ``backward_passes_per_step=k`` accumulates k passes and reduces and
    applies their sum (divided by k with ``average_aggregated_gradients``) every k-th pass,
    as Horovod's. ``name`` prefixes the collectives' names; ``use_locking``,
    ``device_dense``, ``device_sparse``, ``num_groups`` and ``groups`` are accepted for
    Horovod compatibility.
    """
    import tensorflow as tf

    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        from spark_hvd.tensorflow._legacy import wrap_v1
        from spark_hvd.tensorflow._reducer import GradientReducer

        reducer = GradientReducer(compression=compression, op=op,
                                  gradient_predivide_factor=gradient_predivide_factor,
                                  sparse_as_dense=sparse_as_dense, process_set=process_set,
                                  prefix=name or f"Distributed{type(optimizer).__name__}")
        return wrap_v1(optimizer, reducer, backward_passes_per_step=backward_passes_per_step,
                       average_aggregated_gradients=average_aggregated_gradients,
                       scale_local_gradients=scale_local_gradients, name=name)
    from spark_hvd.tensorflow.keras.optimizer import DistributedOptimizer as keras_optimizer

    return keras_optimizer(optimizer, name=name, compression=compression,
                           sparse_as_dense=sparse_as_dense,
                           gradient_predivide_factor=gradient_predivide_factor, op=op,
                           backward_passes_per_step=backward_passes_per_step,
                           average_aggregated_gradients=average_aggregated_gradients,
                           process_set=process_set,
                           scale_local_gradients=scale_local_gradients)


__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "gloo_built", "gloo_enabled", "mpi_built",
    "mpi_enabled", "nccl_built", "start_timeline", "stop_timeline", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set", "ReduceOp",
    "Sum", "Average", "Min", "Max", "Product", "Adasum", "Compression",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
    "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier",
    "size_op", "rank_op", "local_size_op", "local_rank_op", "process_set_included_op",
    "broadcast_variables", "broadcast_object", "broadcast_object_fn", "allgather_object",
    "broadcast_global_variables", "BroadcastGlobalVariablesHook", "DistributedGradientTape",
    "PartialDistributedGradientTape",
    "SyncBatchNormalization", "mpi_threads_supported", "cuda_built", "rocm_built", "ccl_built",
    "ddl_built",
    "DistributedOptimizer",
    "SparkHvdError", "InvalidArgumentError", "TensorMismatchError", "NotInitializedError",
    "CollectiveTimeoutError", "PeerLostError", "InternalError",
    "HorovodInternalError", "HostsUpdatedInterrupt", "elastic",
]
