"""allreduce (dense and tf.IndexedSlices), grouped_allreduce, broadcast and broadcast_ on
TensorFlow tensors, with Horovod's gradients; re-exported by ``mpi_ops``."""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from spark_hvd import _ops
from spark_hvd._basics import ProcessSet, global_process_set, rank
from spark_hvd._types import ReduceOp
from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.tensorflow import _async
from spark_hvd.tensorflow._async import RunTimeScale
from spark_hvd.tensorflow._collective import (_allreduce_dense, _grouped_allreduce_dense,
                                              _np_bitcast, _reduce_op, _scaled, _scaled_at_run,
                                              _size_at_run)
from spark_hvd.tensorflow._gather_ops import allgather
from spark_hvd.tensorflow._host import (_check_dtype, _differentiable,
                                        _not_autograph, _set_shape,
                                        collective_name, grad_name, host_call, in_order,
                                        kernels, records_gradient)
from spark_hvd.tensorflow.compression import Compression
from spark_hvd.tensorflow.functions import broadcast_variables

from spark_hvd._ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401 - re-exported


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

