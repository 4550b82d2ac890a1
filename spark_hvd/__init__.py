"""spark_hvd: Horovod-style distributed training driven from Apache Spark.

``import spark_hvd as hvd`` gives the framework-neutral API on numpy arrays;
``spark_hvd.torch`` and ``spark_hvd.tensorflow`` give it on their tensors;
``spark_hvd.spark.run`` launches a function as a distributed job on Spark;
``spark_hvd.estimators`` has the Spark ML estimators.

The native core (``spark_hvd._core``) loads on first use of the collective API,
so drivers that only launch jobs or prepare data never need it.
"""

import importlib

from spark_hvd.exceptions import (CollectiveTimeoutError, HorovodInternalError,
                                  HostsUpdatedInterrupt, InternalError, InvalidArgumentError,
                                  NotInitializedError, PeerLostError, SparkHvdError,
                                  TensorMismatchError)

__version__ = "0.1.0"

_BASICS = (
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "gloo_built", "mpi_built", "nccl_built",
    "cuda_built", "mpi_threads_supported", "rocm_built", "ddl_built", "ccl_built",
    "gloo_enabled", "mpi_enabled", "start_timeline", "stop_timeline",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
)
_OPS = (
    "allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_async", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "barrier",
    "join",
    "broadcast_object", "allgather_object", "poll", "synchronize", "Handle",
    "Sum", "Average", "Min", "Max", "Product", "Adasum",
)
_LAZY = {**{n: "spark_hvd._basics" for n in _BASICS}, **{n: "spark_hvd._ops" for n in _OPS},
         "ReduceOp": "spark_hvd._types",
         "run": "spark_hvd.runner"}  # horovod.run: a function as N ranks (spark_hvd.runner.run)

__all__ = list(_BASICS) + list(_OPS) + [
    "ReduceOp", "run", "SparkHvdError", "InvalidArgumentError", "TensorMismatchError",
    "NotInitializedError", "CollectiveTimeoutError", "PeerLostError", "InternalError",
    "HorovodInternalError", "HostsUpdatedInterrupt",
]


def __getattr__(name):
    if name == "elastic":  # hvd.elastic after a plain `import spark_hvd as hvd`, as Horovod's
        return importlib.import_module("spark_hvd.elastic")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'spark_hvd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
