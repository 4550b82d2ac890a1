"""allgather, grouped_allgather, alltoall, reducescatter and grouped_reducescatter on
TensorFlow tensors (the ops whose output size the core decides), with Horovod's gradients;
re-exported by ``mpi_ops``."""

from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf

from spark_hvd import _ops
from spark_hvd._basics import ProcessSet, global_process_set
from spark_hvd._rules import check_splits_tensor, splits_values
from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.tensorflow import _async
from spark_hvd.tensorflow._async import RunTimeScale
from spark_hvd.tensorflow._collective import (_allgather_raw, _allreduce_dense,
                                              _grouped_allreduce_dense, _np_bitcast, _np_group,
                                              _own_rows, _reduce_op, _resolve, _scaled,
                                              _scaled_at_run)
from spark_hvd.tensorflow._host import (_check_dtype, _differentiable,
                                        _first_dim_unknown, _not_autograph, _rest, _set_shape,
                                        collective_name, grad_name, host_call, in_order,
                                        kernels, records_gradient)
from spark_hvd.tensorflow.compression import Compression

from spark_hvd._ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401 - re-exported


@_not_autograph
def allgather(tensor, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set):
    """Concatenates every rank's tensor along the first dimension (its size may differ
    between ranks; a scalar counts as one row). Differentiable as in Horovod: the gradient
    is the Average-allreduce of the upstream gradient, sliced to this rank's rows."""
    name = collective_name(name, "allgather", process_set)
    tensor = tf.convert_to_tensor(tensor)
    _check_dtype(tensor.dtype, bitcast=True)
    if not _differentiable(tensor.dtype) or not records_gradient():
        return _allgather_raw(tensor, name, process_set)

    @tf.custom_gradient
    def forward(x):
        y = _allgather_raw(x, name, process_set)

        def grad(dy):
            with in_order(after=y):
                g = grad_name(name)
                total = _allreduce_dense(dy, Average, 1.0, 1.0, g, process_set)
                return _own_rows(total, x, g + ".rows", process_set)
        return y, grad

    return forward(tensor)



def _grouped_allgather_raw(tensors, name, process_set):
    if kernels("grouped_allgather"):
        outs = _async.allgather(tensors, name, process_set, True)
    else:
        def fn(*arrays):
            return _np_group(_ops.grouped_allgather_async, arrays, bitcast=True, name=name,
                             process_set=process_set)
        outs = host_call(fn, tensors, [t.dtype for t in tensors], "grouped_allgather")
    return [_set_shape(o, [None] if t.shape.rank == 0 else _first_dim_unknown(t.shape))
            for o, t in zip(outs, tensors)]


@_not_autograph
def grouped_allgather(tensors, name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set):
    """Allgathers a list of tensors as one group (Horovod's): negotiated together, and
    failing together. Differentiable: each tensor's gradient is ``allgather``'s."""
    base = collective_name(name, "grouped_allgather", process_set)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for t in tensors:
        _check_dtype(t.dtype, bitcast=True)
    if not tensors:
        return []
    if not any(_differentiable(t.dtype) for t in tensors):
        with in_order():
            return _grouped_allgather_raw(tensors, base, process_set)

    @tf.custom_gradient
    def forward(*xs):
        ys = _grouped_allgather_raw(list(xs), base, process_set)

        def grad(*dys):
            idx = [i for i, (x, dy) in enumerate(zip(xs, dys))
                   if dy is not None and _differentiable(x.dtype)]
            out = [None] * len(xs)
            g = grad_name(base)
            with in_order(after=ys[0]):
                totals = _grouped_allreduce_dense([dys[i] for i in idx], Average, 1.0, 1.0,
                                                  g, process_set)
                for i, total in zip(idx, totals):
                    out[i] = _own_rows(total, xs[i], f"{g}.rows{i}", process_set)
            return out
        return ys, grad

    with in_order():
        return list(forward(*tensors))



# -- alltoall ------------------------------------------------------------------------------

def _alltoall_raw(tensor, splits, name, process_set):
    if kernels("alltoall"):
        out, received = _async.alltoall(tensor, splits, name, process_set)
        return _set_shape(out, _first_dim_unknown(tensor.shape)), \
            _set_shape(received, [process_set.size()])
    inputs = [tensor] if splits is None else [tensor, splits]

    def fn(x, s=None):
        out, received = _np_bitcast(_ops.alltoall, x, splits=s, name=name,
                                    process_set=process_set)
        return [out, received.astype(np.int32)]
    out, received = host_call(fn, inputs, [tensor.dtype, tf.int32], "alltoall")
    return _set_shape(out, _first_dim_unknown(tensor.shape)), \
        _set_shape(received, [process_set.size()])


def _splits_tensor(splits) -> tf.Tensor:
    """``splits`` as the int32 vector the op takes, by the rule of every framework
    (``spark_hvd._rules``): a TensorFlow tensor must be int32 (Horovod's op takes nothing
    else), a numpy array any integer dtype, a list integers."""
    if isinstance(splits, (list, tuple)) and any(tf.is_tensor(v) for v in splits):
        splits = tf.stack(splits)  # a list of scalar tensors, as convert_to_tensor packs it
    if tf.is_tensor(splits) or isinstance(splits, tf.Variable):
        check_splits_tensor(splits.dtype.name, splits.shape.rank or 0,
                            "tf.cast(splits, tf.int32)")
        return tf.reshape(splits, [-1])
    values = splits_values(splits)
    return tf.constant(values, dtype=tf.int32, shape=[len(values)])


@_not_autograph
def alltoall(tensor, splits=None, name: Optional[str] = None, ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set):
    """Sends ``splits[i]`` rows to rank i (even split when None; as Horovod's, splits may
    cover fewer rows than the tensor has, and the rest are not sent). Returns the received
    rows, and, when ``splits`` was given, also the int32 rows received from each rank, as
    Horovod's: ``(rows, received_splits)``. Differentiable: the gradient goes back by an
    alltoall with the received splits."""
    name = collective_name(name, "alltoall", process_set)
    tensor = tf.convert_to_tensor(tensor)
    _check_dtype(tensor.dtype, bitcast=True)
    if tensor.shape.rank == 0:
        raise InvalidArgumentError("alltoall needs a tensor with at least one dimension")
    split_tensor = None if splits is None else _splits_tensor(splits)
    if not _differentiable(tensor.dtype):
        out, received = _alltoall_raw(tensor, split_tensor, name, process_set)
        return out if splits is None else (out, received)

    received_box = []

    @tf.custom_gradient
    def forward(x):
        y, received = _alltoall_raw(x, split_tensor, name, process_set)
        received_box.append(received)

        def grad(dy):
            with in_order(after=y):
                back, _ = _alltoall_raw(dy, received, grad_name(name), process_set)
            # rows after the splits' sum were not sent: their gradient is zero
            unsent = tf.shape(x)[0] - tf.shape(back)[0]
            back = tf.concat([back, tf.zeros(tf.concat([[unsent], tf.shape(x)[1:]], 0),
                                             back.dtype)], 0)
            return tf.reshape(back, tf.shape(x))
        return y, grad

    out = forward(tensor)
    return out if splits is None else (out, received_box[0])



# -- reducescatter -----------------------------------------------------------------------

def _reducescatter_rows(rows: Optional[int], process_set: ProcessSet) -> Optional[int]:
    if rows is None:
        return None
    n, me = process_set.size(), process_set.rank()
    return rows // n + (1 if me < rows % n else 0)


def _np_reducescatter(x: np.ndarray, name: str, op, prescale: float, postscale: float,
                      process_set: ProcessSet) -> np.ndarray:
    return _ops.reducescatter(x, name=name, op=op, process_set=process_set,
                              prescale_factor=prescale, postscale_factor=postscale)


def _reducescatter_raw(tensor, op, prescale, postscale, name, process_set):
    if kernels("reducescatter"):
        (out,) = _async.reducescatter([tensor], op, prescale, postscale, name, process_set,
                                      False)
    else:
        def fn(x):
            return [_np_reducescatter(x, name, op, _resolve(prescale), _resolve(postscale),
                                      process_set)]
        (out,) = host_call(fn, [tensor], [tensor.dtype], "reducescatter")
    shape = tensor.shape
    if shape.rank is not None:
        rows = _reducescatter_rows(shape.as_list()[0], process_set)
        _set_shape(out, [rows] + _rest(shape))
    return out


@_not_autograph
def reducescatter(tensor, device_dense: str = "", compression=Compression.none, op=Average,
                  name: Optional[str] = None, process_set: ProcessSet = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0):
    """Reduces over the ranks (default: Average), then gives rank i the i-th block of rows
    (the first ``rows % size`` ranks get one extra row). Differentiable as in Horovod: the
    gradient is the allgather of the upstream gradient, times the size for Sum (and the
    prescale and postscale)."""
    rop = _reduce_op(op, None)
    name = collective_name(name, "reducescatter", process_set)
    tensor = tf.convert_to_tensor(tensor)
    _check_dtype(tensor.dtype)
    if tensor.shape.rank == 0:
        raise InvalidArgumentError("reducescatter needs a tensor with at least one dimension")
    compressed, ctx = compression.compress(tensor)
    if not _differentiable(compressed.dtype) or rop not in (Sum, Average):
        out = _reducescatter_raw(compressed, rop, prescale_factor, postscale_factor, name,
                                 process_set)
        return compression.decompress(out, ctx)

    @tf.custom_gradient
    def forward(x):
        y = _reducescatter_raw(x, rop, prescale_factor, postscale_factor, name, process_set)

        def grad(dy):
            with in_order(after=y):
                full = allgather(dy, name=grad_name(name), process_set=process_set)
            factor = prescale_factor * postscale_factor
            if rop == Sum:  # the size when the gradient runs
                full = _scaled_at_run(full, RunTimeScale(factor, process_set, 1))
            else:
                full = _scaled(full, factor)
            return tf.reshape(full, tf.shape(x))
        return y, grad

    return compression.decompress(forward(compressed), ctx)


def _grouped_reducescatter_raw(tensors, op, prescale, postscale, name, process_set):
    if kernels("grouped_reducescatter"):
        outs = _async.reducescatter(tensors, op, prescale, postscale, name, process_set, True)
    else:
        def fn(*arrays):
            return _np_group(_ops.grouped_reducescatter_async, arrays, name=name, op=op,
                             process_set=process_set, prescale_factor=_resolve(prescale),
                             postscale_factor=_resolve(postscale))
        outs = host_call(fn, tensors, [t.dtype for t in tensors], "grouped_reducescatter")
    for o, t in zip(outs, tensors):
        if t.shape.rank is not None:
            _set_shape(o, [_reducescatter_rows(t.shape.as_list()[0], process_set)] + _rest(t.shape))
    return outs


@_not_autograph
def grouped_reducescatter(tensors, device_dense: str = "", compression=Compression.none,
                          op=Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: Optional[str] = None):
    """Reducescatters a list of tensors as one group (Horovod's): negotiated together, and
    failing together. Differentiable as ``reducescatter``, each tensor on its own."""
    rop = _reduce_op(op, None)
    base = collective_name(name, "grouped_reducescatter", process_set)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for t in tensors:
        _check_dtype(t.dtype)
        if t.shape.rank == 0:
            raise InvalidArgumentError("reducescatter needs a tensor with at least one dimension")
    compressed = [compression.compress(t) for t in tensors]
    xs = [c for c, _ in compressed]
    if not xs:
        return []
    args = (rop, prescale_factor, postscale_factor, base, process_set)
    if rop not in (Sum, Average) or not any(_differentiable(x.dtype) for x in xs):
        with in_order():
            outs = _grouped_reducescatter_raw(xs, *args)
        return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, compressed)]

    @tf.custom_gradient
    def forward(*xs):
        ys = _grouped_reducescatter_raw(list(xs), *args)

        def grad(*dys):
            idx = [i for i, (x, dy) in enumerate(zip(xs, dys))
                   if dy is not None and _differentiable(x.dtype)]
            out = [None] * len(xs)
            with in_order(after=ys[0]):
                fulls = grouped_allgather([dys[i] for i in idx], name=grad_name(base),
                                          process_set=process_set)
            factor = prescale_factor * postscale_factor
            for i, full in zip(idx, fulls):
                if rop == Sum:  # the size when the gradient runs
                    full = _scaled_at_run(full, RunTimeScale(factor, process_set, 1))
                else:
                    full = _scaled(full, factor)
                out[i] = tf.reshape(full, tf.shape(xs[i]))
            return out
        return ys, grad

    with in_order():
        outs = list(forward(*xs))
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, compressed)]

