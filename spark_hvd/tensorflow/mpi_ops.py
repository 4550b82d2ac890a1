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
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from spark_hvd import _ops
from spark_hvd._basics import ProcessSet, global_process_set, local_rank, local_size, rank
from spark_hvd._rules import check_splits_tensor, splits_values
from spark_hvd._types import ReduceOp
from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.tensorflow import _async
from spark_hvd.tensorflow._async import RunTimeScale
from spark_hvd.tensorflow._host import (_BITCAST, _check_dtype, _differentiable,
                                        _first_dim_unknown, _not_autograph, _rest, _set_shape,
                                        collective_name, grad_name, host_call, in_order,
                                        kernels, records_gradient)
from spark_hvd.tensorflow.compression import Compression
from spark_hvd.tensorflow.functions import broadcast_variables

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


def _check_sparse_op(op, prescale, postscale) -> None:
    """What Horovod refuses for tf.IndexedSlices, refused as Horovod does, at the call."""
    if op == Adasum:
        raise NotImplementedError(
            "The Adasum reduction does not support tf.IndexedSlices (sparse gradients); pass "
            "sparse_as_dense=True to DistributedOptimizer, or convert with tf.convert_to_tensor")
    if op not in (Sum, Average):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices, "
                                  f"got {ReduceOp(op).name}")
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices "
                                  f"(got {prescale}, {postscale})")


def _allreduce_sparse(slices: tf.IndexedSlices, op, prescale, postscale, name, process_set):
    """Horovod's reduction of tf.IndexedSlices: an allgather of the values and one of the
    indices; Average divides the values by the set's size (a true division, as Horovod's:
    integer values become floats). ``prescale`` and ``postscale`` come only from the
    gradient reducers (gradient_predivide_factor), on float gradients."""
    with in_order():
        values = allgather(slices.values, name=name + ".values", process_set=process_set)
        indices = allgather(slices.indices, name=name + ".indices", process_set=process_set)
    if op == Average:
        values = values / tf.cast(_size_at_run(process_set), values.dtype)
    for scale in (prescale, postscale):
        values = (_scaled_at_run(values, scale) if isinstance(scale, RunTimeScale)
                  else _scaled(values, scale))
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


@_not_autograph
def allreduce(tensor, average=None, device_dense: str = "", device_sparse: str = "",
              compression=Compression.none, op=None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False):
    """Reduces ``tensor`` over the ranks of ``process_set`` (default op: Average).

    ``tf.IndexedSlices`` are allgathered (values and indices) instead, and averaged by
    dividing the values. Differentiable as in Horovod: the gradient is the same allreduce
    (op, prescale and postscale) of the upstream gradient.
    ``device_*`` and ``ignore_name_scope`` are accepted for Horovod compatibility.
    """
    rop = _reduce_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse_op(rop, prescale_factor, postscale_factor)
    name = collective_name(name, "allreduce", process_set)
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_sparse(tensor, rop, 1.0, 1.0, name, process_set)
    tensor = tf.convert_to_tensor(tensor)
    _check_dtype(tensor.dtype)
    compressed, ctx = compression.compress(tensor)
    out = _allreduce_dense(compressed, rop, prescale_factor, postscale_factor, name, process_set)
    return compression.decompress(out, ctx)


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


@_not_autograph
def grouped_allreduce(tensors, average=None, device_dense: str = "", device_sparse: str = "",
                      compression=Compression.none, op=None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set, name: Optional[str] = None,
                      ignore_name_scope: bool = False):
    """Allreduces a list of tensors as one group: negotiated together and fused into as few
    collectives as the fusion threshold allows. Returns the list of results."""
    tensors = list(tensors)
    rop = _reduce_op(op, average)
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        _check_sparse_op(rop, prescale_factor, postscale_factor)
    with in_order():
        name = collective_name(name, "grouped_allreduce", process_set)
        return _grouped_allreduce(tensors, rop, compression, prescale_factor, postscale_factor,
                                  name, process_set)


def _grouped_allreduce(tensors, rop, compression, prescale_factor, postscale_factor, base,
                       process_set):
    out: list = [None] * len(tensors)
    dense_idx, dense, ctxs = [], [], []
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            out[i] = _allreduce_sparse(t, rop, prescale_factor, postscale_factor,
                                       f"{base}.sparse{i}", process_set)
            continue
        t = tf.convert_to_tensor(t)
        _check_dtype(t.dtype)
        c, ctx = compression.compress(t)
        dense_idx.append(i)
        dense.append(c)
        ctxs.append(ctx)
    reduced = _grouped_allreduce_dense(dense, rop, prescale_factor, postscale_factor, base,
                                       process_set)
    for i, r, ctx in zip(dense_idx, reduced, ctxs):
        out[i] = compression.decompress(r, ctx)
    return out


# -- allgather -----------------------------------------------------------------------------

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


# -- broadcast -----------------------------------------------------------------------------

def _broadcast_raw(tensor, root_rank, name, process_set):
    if kernels("broadcast"):
        (out,) = _async.broadcast([tensor], root_rank, name, process_set)
        return out

    def fn(x):
        out = _np_bitcast(_ops.broadcast, x, root_rank, name=name, process_set=process_set)
        return [out.reshape(x.shape)]
    (out,) = host_call(fn, [tensor], [tensor.dtype], "broadcast")
    return _set_shape(out, tensor.shape)


@_not_autograph
def broadcast(tensor, root_rank: int, name: Optional[str] = None,
              ignore_name_scope: bool = False, process_set: ProcessSet = global_process_set):
    """Returns root_rank's tensor on every rank. Differentiable as in Horovod: root_rank
    gets the Average-allreduce of every rank's upstream gradient, the other ranks zero."""
    name = collective_name(name, "broadcast", process_set)
    tensor = tf.convert_to_tensor(tensor)
    _check_dtype(tensor.dtype, bitcast=True)
    if not _differentiable(tensor.dtype) or not records_gradient():
        return _broadcast_raw(tensor, root_rank, name, process_set)

    @tf.custom_gradient
    def forward(x):
        y = _broadcast_raw(x, root_rank, name, process_set)

        def grad(dy):
            with in_order(after=y):
                total = _allreduce_dense(dy, Average, 1.0, 1.0, grad_name(name), process_set)
            if rank() == root_rank:  # a global rank
                return total
            # Zeros that depend on the allreduce's data, as Horovod's: a graph prunes an
            # unused op (the collectives are not stateful), and the other ranks would wait.
            return total * tf.cast(0, total.dtype)
        return y, grad

    return forward(tensor)


@_not_autograph
def broadcast_(variables, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set):
    """Horovod's in-place broadcast: assigns root_rank's values to ``variables`` (all
    resource variables, or all reference ones of a TF1 graph) and returns their values
    after it, as tensors (in a graph, running them runs the broadcast)."""
    from tensorflow.python.ops import resource_variable_ops

    variables = list(variables)
    if len({resource_variable_ops.is_resource_variable(v) for v in variables}) > 1:
        raise InvalidArgumentError("All variables passed to broadcast_() should be of the same "
                                   "kind, resource or reference")
    assign = broadcast_variables(variables, root_rank, process_set=process_set, name=name)
    with tf.control_dependencies([] if assign is None else [assign]):
        return [v.read_value() if hasattr(v, "read_value") else tf.convert_to_tensor(v)
                for v in variables]


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
