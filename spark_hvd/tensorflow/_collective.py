"""The building blocks of spark_hvd.tensorflow's collectives (``mpi_ops``): scale factors read
at run time, the numpy side of grouped submission, and the raw and dense-differentiable
allreduce and allgather the public ops and their gradients are made of."""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

import numpy as np
import tensorflow as tf

from spark_hvd import _ops
from spark_hvd._basics import ProcessSet
from spark_hvd._types import ReduceOp
from spark_hvd.tensorflow import _async
from spark_hvd.tensorflow._async import RunTimeScale
from spark_hvd.tensorflow._host import (_BITCAST, _differentiable,
                                        _first_dim_unknown, _set_shape,
                                        grad_name, host_call, in_order,
                                        kernels, records_gradient)

from spark_hvd._ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401 - re-exported


def _reduce_op(op, average) -> ReduceOp:
    return _ops._reduce_op(op, average)


def _scaled(tensor: tf.Tensor, factor: float) -> tf.Tensor:
    if factor == 1.0:
        return tensor
    return tensor * tf.cast(factor, tensor.dtype)


# A scale factor is a float, or a RunTimeScale: factors that depend on a process set's
# size (averaging, gradient_predivide_factor) are computed at each run, since an elastic
# job's size changes between runs of a traced graph (Horovod's TensorFlow ops read the
# size at run time in elastic mode too).


def _resolve(scale) -> float:
    return float(scale()) if callable(scale) else scale


def _scalar_at_run(value: Callable[[], Any], dtype: tf.DType, kind: str) -> tf.Tensor:
    """A ``dtype`` scalar that is ``value()`` when the op runs, not when it is traced (in an
    elastic job rank and size change between runs of a traced graph)."""
    (out,) = host_call(lambda: [np.asarray(value(), dtype.as_numpy_dtype)], [], [dtype], kind)
    return _set_shape(out, [])


def _scaled_at_run(tensor: tf.Tensor, scale: Callable[[], float]) -> tf.Tensor:
    """``tensor`` times ``scale()``, evaluated each time the op runs (a RunTimeScale through
    the kernels' process-set query, any other function as a host function)."""
    if isinstance(scale, RunTimeScale) and kernels():
        return tensor * tf.cast(scale.tensor(), tensor.dtype)
    return tensor * tf.cast(_scalar_at_run(scale, tf.float64, "scale_factor"), tensor.dtype)


def _per_size(numerator: float, process_set: ProcessSet) -> RunTimeScale:
    """``numerator / process_set.size()``, as a scale factor read at run time."""
    return RunTimeScale(numerator, process_set, -1)


def _size_at_run(process_set: ProcessSet) -> tf.Tensor:
    """The set's size (int32) when the op runs."""
    if kernels():
        return _async.query("size", process_set)
    return _scalar_at_run(lambda: process_set.size(), tf.int32, "query")


# -- numpy-side grouped submission ---------------------------------------------------------

def _np_grouped_allreduce(arrays: Sequence[np.ndarray], name: str, op: ReduceOp,
                          prescale: float, postscale: float,
                          process_set: ProcessSet) -> List[np.ndarray]:
    """Submits every array as one negotiated, fused group, then waits for all of them."""
    return _np_group(_ops.grouped_allreduce_async, arrays, name=name, op=op,
                     prescale_factor=_resolve(prescale), postscale_factor=_resolve(postscale),
                     process_set=process_set)


def _np_group(submit_async: Callable, arrays: Sequence[np.ndarray], bitcast: bool = False,
              **kwargs) -> List[np.ndarray]:
    """Runs a grouped numpy collective (``_ops.grouped_*_async``) on every array, bit-exact
    ones through same-width int views; waits for every member."""
    arrays = [np.asarray(a, order="C") for a in arrays]  # 0-d stays 0-d
    wires = [a.view(_BITCAST[a.dtype]) if bitcast and a.dtype in _BITCAST else a
             for a in arrays]
    outs = _ops.synchronize(submit_async(wires, **kwargs))
    return [o.view(a.dtype) for o, a in zip(outs, arrays)]


def _np_bitcast(fn: Callable, x: np.ndarray, *args, **kwargs):
    """Runs a bit-exact numpy collective on x, through a same-width int view if needed."""
    wire = _BITCAST.get(x.dtype)
    if wire is None:
        return fn(x, *args, **kwargs)
    out = fn(np.ascontiguousarray(x).view(wire), *args, **kwargs)
    if isinstance(out, tuple):
        return (out[0].view(x.dtype),) + tuple(out[1:])
    return out.view(x.dtype)


# -- allreduce ---------------------------------------------------------------------------

def _allreduce_raw(tensor, op, prescale, postscale, name, process_set):
    if kernels("allreduce"):
        (out,) = _async.allreduce([tensor], op, prescale, postscale, name, process_set, False)
        return out

    def fn(x):
        out = _ops.allreduce(x, op=op, name=name, prescale_factor=_resolve(prescale),
                             postscale_factor=_resolve(postscale), process_set=process_set)
        return [out.reshape(x.shape)]  # numpy's layer returns 0-d arrays as shape (1,)
    (out,) = host_call(fn, [tensor], [tensor.dtype], "allreduce")
    return _set_shape(out, tensor.shape)


def _allreduce_dense(tensor, op, prescale, postscale, name, process_set):
    if not _differentiable(tensor.dtype) or not records_gradient():
        return _allreduce_raw(tensor, op, prescale, postscale, name, process_set)

    @tf.custom_gradient
    def forward(x):
        y = _allreduce_raw(x, op, prescale, postscale, name, process_set)

        def grad(dy):  # Horovod's: the same allreduce (op and factors) of the gradient
            with in_order(after=y):
                return _allreduce_dense(dy, op, prescale, postscale, grad_name(name),
                                        process_set)
        return y, grad

    return forward(tensor)



def _grouped_allreduce_raw(tensors, op, prescale, postscale, name, process_set):
    if not tensors:
        return []
    if kernels("grouped_allreduce"):
        return _async.allreduce(tensors, op, prescale, postscale, name, process_set, True)

    def fn(*arrays):
        return _np_grouped_allreduce(arrays, name, op, prescale, postscale, process_set)
    outs = host_call(fn, tensors, [t.dtype for t in tensors], "grouped_allreduce")
    return [_set_shape(o, t.shape) for o, t in zip(outs, tensors)]


def _grouped_allreduce_dense(tensors, op, prescale, postscale, name, process_set):
    if not any(_differentiable(t.dtype) for t in tensors) or not records_gradient():
        return _grouped_allreduce_raw(tensors, op, prescale, postscale, name, process_set)

    @tf.custom_gradient
    def forward(*xs):
        ys = _grouped_allreduce_raw(list(xs), op, prescale, postscale, name, process_set)

        def grad(*dys):
            idx = [i for i, (x, dy) in enumerate(zip(xs, dys))
                   if dy is not None and _differentiable(x.dtype)]
            with in_order(after=ys[0]):
                reduced = _grouped_allreduce_dense([dys[i] for i in idx], op, prescale,
                                                   postscale, grad_name(name), process_set)
            out = [None] * len(xs)
            for i, r in zip(idx, reduced):
                out[i] = r
            return out
        return ys, grad

    return list(forward(*tensors))



def _allgather_raw(tensor, name, process_set):
    if kernels("allgather"):
        (out,) = _async.allgather([tensor], name, process_set, False)
        return out

    def fn(x):
        return [_np_bitcast(_ops.allgather, x, name=name, process_set=process_set)]
    (out,) = host_call(fn, [tensor], [tensor.dtype], "allgather")
    shape = tensor.shape
    return _set_shape(out, [None] if shape.rank == 0 else _first_dim_unknown(shape))


def _own_rows(full, x, name, process_set):
    """The rows of an allgather result that came from this rank."""
    rows = tf.reshape(tf.shape(tf.reshape(x, [-1]) if x.shape.rank == 0 else x,
                               out_type=tf.int64)[0], [1])
    sizes = _allgather_raw(rows, name, process_set)
    me = process_set.rank()
    offset = tf.reduce_sum(sizes[:me])
    mine = full[offset:offset + sizes[me]]
    return tf.reshape(mine, tf.shape(x))

