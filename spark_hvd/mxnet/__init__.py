"""spark_hvd on MXNet: ``import spark_hvd.mxnet as hvd`` in place of ``horovod.mxnet``.

Collectives on CPU NDArrays (without a copy, after MXNet's engine is done with them),
DistributedTrainer (Gluon), DistributedOptimizer (Module), broadcast_parameters with
deferred initialisation, Compression.fp16. MXNet 1.9 needs numpy < 1.24: the project's
compat environment (``make compat``, ``.venv-compat``) has it. GPU NDArrays are refused
with a clear error.
"""

from spark_hvd._basics import (ProcessSet, add_process_set, ccl_built, cross_rank,  # noqa: F401
                               cross_size, cuda_built, ddl_built, global_process_set,
                               gloo_built, gloo_enabled, init, is_homogeneous,
                               is_initialized, local_rank, local_size, mpi_built,
                               mpi_enabled, mpi_threads_supported, nccl_built, rank,
                               remove_process_set, rocm_built, shutdown, size,
                               start_timeline, stop_timeline)
from spark_hvd._types import ReduceOp
from spark_hvd.exceptions import (CollectiveTimeoutError, HorovodInternalError,
                                  HostsUpdatedInterrupt, InternalError, InvalidArgumentError,
                                  NotInitializedError, PeerLostError, SparkHvdError,
                                  TensorMismatchError)
from spark_hvd.mxnet.compression import Compression
from spark_hvd.mxnet.functions import allgather_object, broadcast_object, broadcast_parameters
from spark_hvd.mxnet.mpi_ops import (Adasum, Average, Max, Min, Product, Sum, allgather,
                                     allreduce, allreduce_, alltoall, barrier, broadcast,
                                     broadcast_, grouped_allgather, grouped_allreduce,
                                     grouped_allreduce_, grouped_reducescatter, join,
                                     reducescatter)
from spark_hvd.mxnet.optimizer import DistributedOptimizer, DistributedTrainer

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "gloo_built", "mpi_built", "nccl_built",
    "gloo_enabled", "mpi_enabled", "mpi_threads_supported", "cuda_built", "rocm_built",
    "ddl_built", "ccl_built", "start_timeline", "stop_timeline",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Sum", "Average", "Min", "Max", "Product", "Adasum", "ReduceOp",
    "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_",
    "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall",
    "reducescatter", "grouped_reducescatter", "barrier", "join",
    "broadcast_object", "allgather_object", "broadcast_parameters",
    "Compression", "DistributedOptimizer", "DistributedTrainer",
    "SparkHvdError", "InvalidArgumentError", "TensorMismatchError", "NotInitializedError",
    "CollectiveTimeoutError", "PeerLostError", "InternalError",
    "HorovodInternalError", "HostsUpdatedInterrupt",
]
