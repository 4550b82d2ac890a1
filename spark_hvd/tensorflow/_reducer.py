"""Reducing a list of gradients across ranks: shared by DistributedGradientTape and the
Keras DistributedOptimizer.

Dense gradients go as one group (one host call, one negotiation, fused by the core);
``tf.IndexedSlices`` are allgathered unless ``sparse_as_dense``; ``None`` stays ``None``.
Gradients of variables registered as local (Horovod's ``PartialDistributed*``) are not
reduced; with ``scale_local_gradients`` they are divided by the size, as Horovod does.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import tensorflow as tf

from spark_hvd._basics import ProcessSet, global_process_set
from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.tensorflow import mpi_ops
from spark_hvd.tensorflow._collective import (_grouped_allreduce_raw, _per_size, _reduce_op,
                                              _scaled_at_run)
from spark_hvd.tensorflow._reduce_ops import _allreduce_sparse
from spark_hvd.tensorflow._host import in_order, stable_name
from spark_hvd.tensorflow.compression import Compression


def variable_key(var):
    """A hashable identity of a variable: ``ref()`` for TensorFlow's, the object's id for
    Keras 3's (which have no ``ref``; a model keeps its variables alive)."""
    ref = getattr(var, "ref", None)
    return ref() if ref is not None else id(var)


class GradientReducer:
    """Callable: ``reducer(grads, name=None) -> reduced grads`` (same length, same Nones).

    Parameters
    ----------
    compression : how dense gradients travel (``Compression.none/fp16/bf16``).
    op : ``Average`` (default), ``Sum``, ``Adasum`` (float gradients, power-of-two ranks), ...
    gradient_predivide_factor : with op=Average, divide by this before the sum and by
        ``size / factor`` after it (same result, different rounding).
    sparse_as_dense : convert ``tf.IndexedSlices`` to dense tensors before reducing.
    process_set : the ranks to reduce over.
    prefix : base of the names of the collectives.
    """

    def __init__(self, compression=Compression.none, op=mpi_ops.Average,
                 gradient_predivide_factor: float = 1.0, sparse_as_dense: bool = False,
                 process_set: ProcessSet = global_process_set,
                 prefix: str = "gradients") -> None:
        op = _reduce_op(op, None)
        if gradient_predivide_factor != 1.0 and op != mpi_ops.Average:
            raise InvalidArgumentError("gradient_predivide_factor is only supported with "
                                       f"op=Average, got op={op.name}")
        if gradient_predivide_factor <= 0:
            raise InvalidArgumentError("gradient_predivide_factor must be positive, got "
                                       f"{gradient_predivide_factor}")
        self.compression = compression
        self.op = op
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.prefix = prefix

    def _op_and_scales(self):
        if self.gradient_predivide_factor == 1.0:
            return self.op, 1.0, 1.0
        f = self.gradient_predivide_factor
        return mpi_ops.Sum, 1.0 / f, _per_size(f, self.process_set)

    def __call__(self, grads: Sequence, name: Optional[str] = None,
                 variables: Optional[Sequence] = None, local=frozenset(),
                 scale_local_gradients: bool = True) -> List:
        """``local``: the :func:`variable_key` of each of the ``variables`` whose gradients
        stay local."""
        with in_order():  # in a TF1 graph too: the dense group, then each sparse gradient
            return self._reduce(grads, name, variables, local, scale_local_gradients)

    def _reduce(self, grads, name, variables, local, scale_local_gradients) -> List:
        grads = list(grads)
        out: list = [None] * len(grads)
        op, prescale, postscale = self._op_and_scales()
        dense_idx, dense = [], []
        for i, g in enumerate(grads):
            if g is None:
                continue
            if local and variables is not None and variable_key(variables[i]) in local:
                out[i] = self._local(g) if scale_local_gradients else g
                continue
            if isinstance(g, tf.IndexedSlices) and not self.sparse_as_dense:
                out[i] = ("sparse", g)
                continue
            dense_idx.append(i)
            dense.append(tf.convert_to_tensor(g))
        base = name or stable_name(self.prefix, dense)
        compressed = [self.compression.compress(g) for g in dense]
        reduced = _grouped_allreduce_raw([c for c, _ in compressed], op, prescale,
                                                 postscale, base, self.process_set)
        for i, r, (_, ctx) in zip(dense_idx, reduced, compressed):
            out[i] = self.compression.decompress(r, ctx)
        for i, g in enumerate(out):
            if isinstance(g, tuple) and g[0] == "sparse":
                out[i] = _allreduce_sparse(g[1], op, prescale, postscale,
                                                   f"{base}.sparse{i}", self.process_set)
        return out

    def _local(self, g):
        scale = _per_size(1.0, self.process_set)
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(_scaled_at_run(g.values, scale), g.indices,
                                    g.dense_shape)
        return _scaled_at_run(g, scale)
