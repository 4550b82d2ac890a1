"""How a collective runs from TensorFlow: a host function on numpy arrays, called
eagerly or as one stateful ``tf.numpy_function`` node, and how its op is named.

The plumbing under ``mpi_ops`` (the collectives) and ``functions`` (variables and
objects); see ``mpi_ops`` for why names are what they are.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
import zlib
from typing import Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from spark_hvd._runtime import RUNTIME
from spark_hvd._types import numpy_code
from spark_hvd.exceptions import (InvalidArgumentError, NotInitializedError, SparkHvdError,
                                  TensorMismatchError)

# Bit-exact ops (broadcast, allgather, alltoall) move these as same-width signed ints.
_BITCAST = {np.dtype(np.uint16): np.dtype(np.int16), np.dtype(np.uint32): np.dtype(np.int32),
            np.dtype(np.uint64): np.dtype(np.int64)}

try:  # private, but the only way to see that a graph is being compiled by XLA
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext as _in_xla
except ImportError:  # pragma: no cover - depends on the TensorFlow version
    def _in_xla(graph) -> bool:
        return False


# AutoGraph would otherwise rewrite these functions (their control flow is on Python
# values only) every time a tf.function that calls them is traced.
_not_autograph = tf.autograph.experimental.do_not_convert


try:  # TensorFlow's own test of "is any tape active" (tf.custom_gradient's eager path)
    from tensorflow.python.eager.record import could_possibly_record as _tape_active
except ImportError:  # pragma: no cover - depends on the TensorFlow version
    _tape_active = None


def records_gradient() -> bool:
    """Whether a collective's gradient may be asked for: always in a graph; eagerly only
    while a GradientTape (or forward accumulator) is active. When not, the differentiable
    forms skip tf.custom_gradient, which costs ~115 us a call eagerly."""
    if _tape_active is None or not tf.executing_eagerly():
        return True
    return _tape_active()


def _numpy_dtype(dtype: tf.DType) -> np.dtype:
    return np.dtype(dtype.as_numpy_dtype)


def _check_dtype(dtype: tf.DType, bitcast: bool = False) -> None:
    np_dtype = _numpy_dtype(dtype)
    if bitcast and np_dtype in _BITCAST:
        return
    try:
        numpy_code(np_dtype)
    except InvalidArgumentError:
        raise InvalidArgumentError(
            f"spark_hvd.tensorflow: dtype {dtype.name} is not supported; use one of uint8, int8, "
            "int16, int32, int64, float16, bfloat16, float32, float64, bool") from None


def _differentiable(dtype: tf.DType) -> bool:
    return dtype.is_floating or dtype.is_complex


def _to_numpy(value) -> np.ndarray:
    if hasattr(value, "numpy"):
        return np.asarray(value.numpy())
    return np.asarray(value)


def _check_not_xla(kind: str) -> None:
    if _in_xla(tf.compat.v1.get_default_graph()):
        raise InvalidArgumentError(
            f"spark_hvd.tensorflow.{kind} cannot run inside an XLA-compiled function: XLA cannot "
            "compile spark_hvd's collectives (TensorFlow kernels of their own, or host "
            "functions). "
            "Use tf.function(jit_compile=False) for the function that calls it (Keras: "
            "model.compile(..., jit_compile=False), which DistributedOptimizer does for fit)")


def kernels(kind: Optional[str] = None) -> bool:
    """Whether collectives run as spark_hvd's asynchronous kernels (``_async``) rather than
    as host functions; with a collective's ``kind``, an XLA-compiled graph is refused."""
    from spark_hvd.tensorflow import _kernels

    on = _kernels.ops() is not None
    if on and kind and not tf.executing_eagerly():
        _check_not_xla(kind)
    return on


class _Chain(threading.local):
    active = False
    last: Optional[tf.Operation] = None


_CHAIN = _Chain()


@contextlib.contextmanager
def in_order(after=None):
    """Host calls made in this block run in the order they were made, in a TF1 graph too.

    A ``tf.function`` orders stateful nodes by itself; a ``tf.compat.v1.Session`` runs
    independent nodes in any order, and each host call holds an executor thread until its
    collective is done, so ranks that started one call's collectives in different orders
    could wait on each other. Inside this block each new node gets a control dependency on
    the previous one of the same graph (the first on ``after``, a tensor, if given: a
    collective's gradient runs after the collective); a nested block continues the chain.
    """
    seed = None if after is None or tf.executing_eagerly() else after.op
    if _CHAIN.active:
        if _CHAIN.last is None:
            _CHAIN.last = seed
        yield
        return
    _CHAIN.active, _CHAIN.last = True, seed
    try:
        yield
    finally:
        _CHAIN.active, _CHAIN.last = False, None


def host_call(fn: Callable[..., Sequence[np.ndarray]], inputs: Sequence, out_dtypes: Sequence,
              kind: str) -> List[tf.Tensor]:
    """Runs ``fn`` (numpy arrays in, a list of numpy arrays out) now when eager, else as one
    stateful ``tf.numpy_function`` node of the current graph."""
    if tf.executing_eagerly():
        try:
            outs = fn(*[_to_numpy(t) for t in inputs])
        except SparkHvdError as exc:
            raise tf_error(exc) from exc
        return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(outs, out_dtypes)]
    _check_not_xla(kind)
    last = _CHAIN.last
    after = [last] if last is not None and last.graph is tf.compat.v1.get_default_graph() else []
    with tf.control_dependencies(after):
        outs = tf.numpy_function(fn, list(inputs), list(out_dtypes), stateful=True,
                                 name=_op_name(kind))
    outs = list(outs)
    if _CHAIN.active and outs:
        _CHAIN.last = outs[0].op
    return outs


def tf_error(exc: SparkHvdError) -> tf.errors.OpError:
    """A collective's failure as TensorFlow's error of the class Horovod's ops raise (the
    kernels' mapping, kernels/core.h): FailedPrecondition for a mismatch between ranks,
    InvalidArgument for a bad argument, Unknown for a failed collective."""
    if isinstance(exc, (TensorMismatchError, NotInitializedError)):
        cls = tf.errors.FailedPreconditionError
    elif isinstance(exc, InvalidArgumentError):
        cls = tf.errors.InvalidArgumentError
    else:
        cls = tf.errors.UnknownError
    return cls(None, None, f"{type(exc).__module__}.{type(exc).__name__}: {exc}")


def _op_name(kind: str) -> str:
    return "SparkHvd" + "".join(p[:1].upper() + p[1:] for p in kind.split("_"))


def collective_name(name: Optional[str], kind: str, process_set=None) -> str:
    """``name`` if given, else a deterministic name (see the module docstring), counted
    per process set: an unnamed op on a set the other ranks are not in leaves the names
    of the next global ops alike on every rank."""
    if name:
        return name
    set_id = 0 if process_set is None else process_set.process_set_id
    if tf.executing_eagerly():
        return RUNTIME.auto_name(f"tf.{kind}", set_id)
    # Not the nodes' own names (SparkHvdAllreduce...): a node that only some ranks build
    # (an op on a process set) must not shift the names of the others.
    graph = tf.compat.v1.get_default_graph()
    unique = graph.unique_name(f"tf.{kind}" + (f".ps{set_id}" if set_id else ""),
                               mark_as_used=True)
    return f"{getattr(graph, 'name', 'graph')}/{unique}"


# name -> how many gradient ops of it the graph has, per graph (a weak key: a graph's
# counts go with it, and a retraced function's new graph counts from zero again).
_GRAD_NAMES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def grad_name(name: str) -> str:
    """The name of the collective that computes the gradient of the collective ``name``.
    Eagerly ``<name>.grad`` (an eager gradient runs at once, one at a time). In a graph each
    gradient op of one collective gets a name of its own, ``<name>.grad``, then
    ``<name>.grad_1``...: two ``tf.gradients`` calls (or tapes) over the outputs of one op
    build two gradient collectives, and one step may run both. The same on every rank as
    long as the ranks build the same graph, as every graph-mode name is."""
    if tf.executing_eagerly():
        return name + ".grad"
    graph = tf.compat.v1.get_default_graph()
    counts = _GRAD_NAMES.setdefault(graph, {})
    k = counts.get(name, 0)
    counts[name] = k + 1
    return f"{name}.grad" + (f"_{k}" if k else "")


def stable_name(prefix: str, tensors: Sequence) -> str:
    """For the reduction issued once per training step: the tensors' dtypes and shapes
    are part of the name, so each model's gradients keep their own entry in the core's
    response cache. Eagerly the name is the same every step; in a graph it is also
    unique within the function."""
    signature = ";".join(f"{t.dtype.name}{t.shape}" for t in tensors)
    suffix = f"{len(tensors)}.{zlib.crc32(signature.encode()):08x}"
    if tf.executing_eagerly():
        return f"{prefix}.{suffix}"
    return f"{collective_name(None, prefix)}.{suffix}"


def _set_shape(tensor: tf.Tensor, shape) -> tf.Tensor:
    if not tf.executing_eagerly():
        tensor.set_shape(shape)
    return tensor


def _rest(shape: tf.TensorShape) -> list:
    return [] if shape.rank is None else shape.as_list()[1:]


def _first_dim_unknown(shape: tf.TensorShape) -> tf.TensorShape:
    if shape.rank is None:
        return tf.TensorShape(None)
    return tf.TensorShape([None] + _rest(shape))
