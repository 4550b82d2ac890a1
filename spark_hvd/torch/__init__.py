"""spark_hvd on PyTorch: ``import spark_hvd.torch as hvd`` in place of ``horovod.torch``.

Collectives on CPU and CUDA torch tensors (async, in-place and differentiable forms),
DistributedOptimizer, broadcast_parameters / broadcast_optimizer_state,
Compression, SyncBatchNorm, join, and ``elastic`` (TorchState, ElasticSampler, run).
CUDA tensors run on NCCL, or staged through pinned host memory on the CPU backend where
NCCL does not load (``cuda_built()`` says whether the CUDA runtime does).
"""

from spark_hvd._basics import (ccl_built, ddl_built, mpi_threads_supported,  # noqa: F401
                               rocm_built)
from spark_hvd._basics import (ProcessSet, add_process_set, cross_rank, cross_size, cuda_built,
                               global_process_set, gloo_built, gloo_enabled, init,
                               is_homogeneous, is_initialized, local_rank, local_size,
                               mpi_built, mpi_enabled, nccl_built, rank, remove_process_set,
                               shutdown, size, start_timeline, stop_timeline)
from spark_hvd._types import ReduceOp
from spark_hvd.exceptions import (CollectiveTimeoutError, HorovodInternalError,
                                  HostsUpdatedInterrupt, InternalError, InvalidArgumentError,
                                  NotInitializedError, PeerLostError, SparkHvdError,
                                  TensorMismatchError)
from spark_hvd.torch.compression import Compression
from spark_hvd.torch.functions import (allgather_object, broadcast_object,
                                       broadcast_optimizer_state, broadcast_parameters)
from spark_hvd.torch.mpi_ops import (Adasum, Average, GroupHandle, Handle, Max, Min, Product,
                                     Sum, allgather, allgather_async, allreduce, allreduce_,
                                     allreduce_async, allreduce_async_, alltoall, alltoall_async,
                                     barrier, broadcast, broadcast_, broadcast_async,
                                     broadcast_async_, grouped_allgather,
                                     grouped_allgather_async, grouped_allreduce,
                                     grouped_allreduce_, grouped_allreduce_async,
                                     grouped_allreduce_async_, grouped_reducescatter,
                                     grouped_reducescatter_async, join, poll, reducescatter,
                                     reducescatter_async, sparse_allreduce_async, synchronize)
from spark_hvd.torch.optimizer import DistributedOptimizer, GradientsPendingError
from spark_hvd.torch.sync_batch_norm import SyncBatchNorm
from spark_hvd.torch import elastic  # hvd.elastic: imported last, it uses the above


__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "gloo_built", "mpi_built", "nccl_built",
    "gloo_enabled", "mpi_enabled", "mpi_threads_supported", "cuda_built", "rocm_built",
    "ddl_built", "ccl_built", "start_timeline", "stop_timeline",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Sum", "Average", "Min", "Max", "Product", "Adasum", "ReduceOp", "Handle", "GroupHandle",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_",
    "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async",
    "join", "barrier", "poll", "synchronize",
    "broadcast_object", "allgather_object", "broadcast_parameters", "broadcast_optimizer_state",
    "Compression", "DistributedOptimizer", "GradientsPendingError", "SyncBatchNorm",
    "SparkHvdError", "InvalidArgumentError", "TensorMismatchError", "NotInitializedError",
    "CollectiveTimeoutError", "PeerLostError", "InternalError",
    "HorovodInternalError", "HostsUpdatedInterrupt", "elastic",
]
