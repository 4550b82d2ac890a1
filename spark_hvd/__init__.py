"""spark_hvd: Horovod-style distributed training driven from Apache Spark.

``import spark_hvd as hvd`` gives the framework-neutral API on numpy arrays;
``spark_hvd.torch`` and ``spark_hvd.tensorflow`` give it on their tensors;
``spark_hvd.spark.run`` launches a function as a distributed job on Spark;
``spark_hvd.estimators`` has the Spark ML estimators.
"""

from spark_hvd._basics import (ProcessSet, add_process_set, cross_rank, cross_size,
                               global_process_set, gloo_built, gloo_enabled, init,
                               is_homogeneous, is_initialized, local_rank, local_size,
                               mpi_built, mpi_enabled, nccl_built, rank, remove_process_set,
                               shutdown, size, start_timeline, stop_timeline)
from spark_hvd._ops import (Adasum, Average, Handle, Max, Min, Product, Sum, allgather,
                            allgather_async, allgather_object, allreduce, allreduce_async,
                            alltoall, alltoall_async, barrier, broadcast, broadcast_async,
                            broadcast_object, grouped_allreduce, grouped_allreduce_async, join,
                            poll, reducescatter, reducescatter_async, synchronize)
from spark_hvd._types import ReduceOp
from spark_hvd.exceptions import (CollectiveTimeoutError, InternalError, InvalidArgumentError,
                                  NotInitializedError, PeerLostError, SparkHvdError,
                                  TensorMismatchError)

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "gloo_built", "mpi_built", "nccl_built",
    "gloo_enabled", "mpi_enabled", "start_timeline", "stop_timeline",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async",
    "allgather", "allgather_async", "broadcast", "broadcast_async", "alltoall",
    "alltoall_async", "reducescatter", "reducescatter_async", "barrier", "join",
    "broadcast_object", "allgather_object", "poll", "synchronize", "Handle",
    "Sum", "Average", "Min", "Max", "Product", "Adasum", "ReduceOp",
    "SparkHvdError", "InvalidArgumentError", "TensorMismatchError", "NotInitializedError",
    "CollectiveTimeoutError", "PeerLostError", "InternalError",
]
