"""DistributedGradientTape: a tf.GradientTape whose gradient() averages across ranks."""

from __future__ import annotations

import tensorflow as tf

from spark_hvd._basics import ProcessSet, global_process_set
from spark_hvd.tensorflow import mpi_ops
from spark_hvd.tensorflow._reducer import GradientReducer
from spark_hvd.tensorflow.compression import Compression


class _DistributedTapeMixin:
    """Put in front of the wrapped tape's class; ``_hvd_reducer`` is set per instance."""

    _hvd_reducer: GradientReducer

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE,
                 use_generic_names: bool = False):
        grads = super().gradient(target, sources, output_gradients=output_gradients,
                                 unconnected_gradients=unconnected_gradients)
        flat = tf.nest.flatten(grads)
        reduced = self._hvd_reducer(flat)
        return tf.nest.pack_sequence_as(grads, reduced)


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                            device_sparse: str = "", compression=Compression.none,
                            sparse_as_dense: bool = False, op=mpi_ops.Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups=None, process_set: ProcessSet = global_process_set,
                            scale_local_gradients: bool = True) -> tf.GradientTape:
    """Wraps ``gradtape`` so that ``gradient()`` returns gradients reduced over the ranks.

    Use it on a tape that has recorded the forward pass (or as the tape of a ``with``
    block)::

        with tf.GradientTape() as tape:
            loss = loss_fn(model(x), y)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)

    The result is an instance of a subclass of the tape's own class sharing its recorded
    state. All dense gradients are reduced as one group (the core fuses them; ``num_groups``
    and ``groups`` are accepted for Horovod compatibility and not needed);
    ``tf.IndexedSlices`` are allgathered unless ``sparse_as_dense=True``.
    ``gradient_predivide_factor`` splits the averaging around the sum (op=Average only).
    """
    reducer = GradientReducer(compression=compression, op=op,
                              gradient_predivide_factor=gradient_predivide_factor,
                              sparse_as_dense=sparse_as_dense, process_set=process_set,
                              prefix="DistributedGradientTape")
    base = type(gradtape)
    if isinstance(gradtape, _DistributedTapeMixin):
        base = base.__mro__[2]  # re-wrapping: start again from the original class
    cls = type(base.__name__, (_DistributedTapeMixin, base),
               {"__module__": base.__module__, "__qualname__": base.__qualname__})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._hvd_reducer = reducer
    return tape
