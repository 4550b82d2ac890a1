"""How a collective runs as spark_hvd's asynchronous TensorFlow kernel (``_kernels``).

One op per collective (or per group), eagerly and in graphs alike: the kernel hands its
tensors to the core and returns, holding no TensorFlow thread while the ranks meet, so a
graph completes whatever number of independent collectives it has and whatever the
inter-op thread count, in whatever order each rank runs them. The ops are not stateful
(Horovod's are not): nothing orders them but their data.

A failure is TensorFlow's error of the class Horovod's ops raise (``kernels/core.h``:
FailedPrecondition for a mismatch between ranks, InvalidArgument for a bad argument,
Unknown for a failed collective); its payloads carry the spark_hvd exception, which
``spark_error`` rebuilds. Eagerly it is raised with that exception as its cause.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Sequence

import tensorflow as tf

from spark_hvd._runtime import ProcessSet, explain_failure
from spark_hvd.exceptions import SparkHvdError, from_code
from spark_hvd.tensorflow import _kernels

_PAYLOAD = "spark_hvd."


def spark_error(error: tf.errors.OpError) -> Optional[SparkHvdError]:
    """The spark_hvd exception a kernel's error carries, or None (payloads reach eager
    calls and ``tf.function`` calls; a TF1 session drops them)."""
    payloads = getattr(error, "experimental_payloads", None) or {}
    fields = {k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes)
              else v for k, v in payloads.items()}
    if _PAYLOAD + "code" not in fields:
        return None
    ranks = [int(r) for r in fields.get(_PAYLOAD + "ranks", "").split(",") if r]
    exc = from_code(int(fields[_PAYLOAD + "code"]), fields.get(_PAYLOAD + "message", ""),
                    ranks=ranks, tensor=fields.get(_PAYLOAD + "tensor", ""))
    return explain_failure(exc)


def _eager_errors(fn):
    """Eagerly, a kernel's error is raised with its spark_hvd exception as the cause."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except tf.errors.OpError as error:
            cause = spark_error(error) if tf.executing_eagerly() else None
            if cause is None:
                raise
            raise error from cause
    return wrapper


def _lib():
    return _kernels.ops()


def _name(name: str) -> tf.Tensor:
    return tf.constant(name, dtype=tf.string)


def _scale(value) -> tf.Tensor:
    """A scale factor: a float, or a run-time one (``RunTimeScale``)."""
    if isinstance(value, RunTimeScale):
        return value.tensor()
    return tf.constant(float(value), dtype=tf.float64)


class RunTimeScale:
    """``numerator * size(process_set) ** power``, read when the op runs (an elastic job's
    size changes between runs of a traced graph). Callable for the host functions."""

    def __init__(self, numerator: float, process_set: ProcessSet, power: int) -> None:
        self.numerator, self.process_set, self.power = float(numerator), process_set, power

    def __call__(self) -> float:
        return self.numerator * float(self.process_set.size()) ** self.power

    def tensor(self) -> tf.Tensor:
        size = tf.cast(query("size", self.process_set), tf.float64)
        return self.numerator * size ** self.power


@_eager_errors
def _reduction(kind: str, tensors: Sequence[tf.Tensor], op, prescale, postscale, name: str,
               process_set: ProcessSet, grouped: bool) -> List[tf.Tensor]:
    run = getattr(_lib(), f"spark_hvd_{kind}")
    return list(run(list(tensors), _scale(prescale), _scale(postscale), _name(name),
                    reduce_op=int(op), process_set_id=process_set._require(), grouped=grouped))


def allreduce(*args) -> List[tf.Tensor]:
    """(tensors, op, prescale, postscale, name, process_set, grouped)"""
    return _reduction("allreduce", *args)


def reducescatter(*args) -> List[tf.Tensor]:
    """(tensors, op, prescale, postscale, name, process_set, grouped)"""
    return _reduction("reducescatter", *args)


@_eager_errors
def allgather(tensors: Sequence[tf.Tensor], name: str, process_set: ProcessSet,
              grouped: bool) -> List[tf.Tensor]:
    return list(_lib().spark_hvd_allgather(list(tensors), _name(name),
                                           process_set_id=process_set._require(),
                                           grouped=grouped))


@_eager_errors
def broadcast(tensors: Sequence[tf.Tensor], root_rank: int, name: str,
              process_set: ProcessSet, grouped: bool = False) -> List[tf.Tensor]:
    """``root_rank`` is a global rank, as in Horovod."""
    set_id = process_set._require()
    return list(_lib().spark_hvd_broadcast(list(tensors), _name(name),
                                           root_rank=process_set._set_rank_of(int(root_rank)),
                                           process_set_id=set_id, grouped=grouped))


@_eager_errors
def alltoall(tensor: tf.Tensor, splits: Optional[tf.Tensor], name: str,
             process_set: ProcessSet):
    if splits is None:
        splits = tf.zeros([0], dtype=tf.int32)
    out, received = _lib().spark_hvd_alltoall(tensor, splits, _name(name),
                                              process_set_id=process_set._require())
    return out, received


@_eager_errors
def barrier(name: str, process_set: ProcessSet) -> tf.Tensor:
    return _lib().spark_hvd_barrier(_name(name), process_set_id=process_set._require())


@_eager_errors
def join() -> tf.Tensor:
    return _lib().spark_hvd_join()


def query(what: str, process_set: ProcessSet) -> tf.Tensor:
    """An int32 scalar read when the op runs: the set's ``size``, this rank's ``rank`` in
    it, or whether it is ``included`` (1 or 0)."""
    return _lib().spark_hvd_process_set_query(query=what,
                                              process_set_id=process_set._require())
