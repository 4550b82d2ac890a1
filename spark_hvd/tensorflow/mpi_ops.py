"""Collectives on TensorFlow tensors, eagerly and inside ``tf.function``, with gradients.

Each collective is one op of spark_hvd's asynchronous TensorFlow kernels (``_async``,
built on first use by ``_kernels``), eagerly and in graphs: the kernel hands the tensors
to the core and holds no thread while the ranks meet, and, as Horovod's, the ops are not
stateful, so a graph runs independent collectives in any order and completes whatever
their number and TensorFlow's inter-op thread count. Where the kernels cannot be built
(no compiler; ``SPARK_HVD_TF_KERNELS=host``) each collective is a host function on numpy
arrays (``_host``, ``spark_hvd._ops``): eagerly at once, in a graph one stateful
``tf.numpy_function`` node that blocks its executor thread until the collective is done,
run in program order inside a ``tf.function``.

XLA compiles neither: inside ``tf.function(jit_compile=True)`` the ops raise a clear error
(the Keras ``DistributedOptimizer`` turns XLA off for ``fit`` instead).

Names: an explicit ``name=`` is used as given. Without one, an eager op gets the next
name of a per-kind, per-process-set counter and a graph op a name unique within its
``tf.function`` graph (``<function>/<scope>/tf.allreduce_3``, ``.../tf.allreduce.ps1_3`` on
process set 1), which is the same on every rank and every retrace as long as the ranks run the
same code (an op on a set some ranks are not in shifts no other set's names).

The ops live in ``_reduce_ops`` (allreduce, grouped_allreduce, broadcast, broadcast_) and
``_gather_ops`` (allgather, grouped_allgather, alltoall, reducescatter, grouped_reducescatter),
built on ``_collective``, as torch's are; this module gives them their public place and holds
join, barrier and the size and rank ops.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from spark_hvd import _ops
from spark_hvd._basics import ProcessSet, global_process_set, local_rank, local_size
from spark_hvd.tensorflow import _async
from spark_hvd.tensorflow._collective import _scalar_at_run
# The public ops, in their public place.
from spark_hvd.tensorflow._gather_ops import (alltoall, allgather, grouped_allgather,  # noqa: F401
                                              grouped_reducescatter, reducescatter)
from spark_hvd.tensorflow._reduce_ops import (allreduce, broadcast, broadcast_,  # noqa: F401
                                              grouped_allreduce)
from spark_hvd.tensorflow._host import (_not_autograph, _set_shape,
                                        collective_name, host_call, kernels)

from spark_hvd._ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401 - re-exported


# -- join, barrier, size ops -----------------------------------------------------------------

@_not_autograph
def join():
    """Marks this rank as out of data (see ``spark_hvd.join``); returns the last rank to join."""
    if kernels("join"):
        out = _async.join()
        return int(out) if tf.executing_eagerly() else out
    if tf.executing_eagerly():
        return _ops.join()
    (out,) = host_call(lambda: [np.asarray(_ops.join(), dtype=np.int32)], [], [tf.int32], "join")
    return _set_shape(out, [])


@_not_autograph
def barrier(process_set: ProcessSet = global_process_set):
    """Returns once every rank of the set has called barrier."""
    if kernels("barrier"):
        out = _async.barrier(collective_name(None, "barrier", process_set), process_set)
        return None if tf.executing_eagerly() else out
    if tf.executing_eagerly():
        return _ops.barrier(process_set)

    def fn():
        _ops.barrier(process_set)
        return [np.asarray(True)]
    (out,) = host_call(fn, [], [tf.bool], "barrier")
    return out


def _int_at_run(value: Callable[[], int], name: Optional[str]):
    """An int32 scalar read when the op runs, as Horovod's ``*_op`` are."""
    out = _scalar_at_run(value, tf.int32, "query")
    return tf.identity(out, name=name) if name else out


def _query(what: str, process_set: ProcessSet, value: Callable[[], int],
           name: Optional[str]):
    if kernels():
        out = _async.query(what, process_set)
        return tf.identity(out, name=name) if name else out
    return _int_at_run(value, name)


def size_op(process_set: ProcessSet = global_process_set, name: Optional[str] = None):
    return _query("size", process_set, lambda: process_set.size(), name)


def rank_op(process_set: ProcessSet = global_process_set, name: Optional[str] = None):
    return _query("rank", process_set, lambda: process_set.rank(), name)


def process_set_included_op(process_set: ProcessSet = global_process_set,
                            name: Optional[str] = None):
    """Horovod's: 1 when this rank is a member of ``process_set``, else 0 (int32)."""
    return _query("included", process_set, lambda: 1 if process_set.included() else 0, name)


def local_size_op(name: Optional[str] = None):
    return _int_at_run(local_size, name)


def local_rank_op(name: Optional[str] = None):
    return _int_at_run(local_rank, name)

