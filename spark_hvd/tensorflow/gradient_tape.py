"""DistributedGradientTape: a tf.GradientTape whose gradient() averages across ranks."""

from __future__ import annotations

import tensorflow as tf

from spark_hvd._basics import ProcessSet, global_process_set
from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.tensorflow import mpi_ops
from spark_hvd.tensorflow._reducer import GradientReducer, variable_key
from spark_hvd.tensorflow.compression import Compression


class _DistributedTapeMixin:
    """Put in front of the wrapped tape's class; ``_hvd_reducer`` is set per instance."""

    _hvd_reducer: GradientReducer
    _hvd_local: set
    _hvd_scale_local: bool

    def register_local_source(self, source) -> None:
        """Horovod's: the gradient of ``source`` (a variable) stays this rank's own (divided
        by the size when ``scale_local_gradients``), not reduced across ranks."""
        self._hvd_local.add(variable_key(source))

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE,
                 use_generic_names: bool = False):
        grads = super().gradient(target, sources, output_gradients=output_gradients,
                                 unconnected_gradients=unconnected_gradients)
        flat = tf.nest.flatten(grads)
        reduced = self._hvd_reducer(flat, variables=tf.nest.flatten(sources),
                                    local=frozenset(self._hvd_local),
                                    scale_local_gradients=self._hvd_scale_local)
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
    ``register_local_source(v)`` keeps ``v``'s gradient local (see
    :func:`PartialDistributedGradientTape`).
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
    tape._hvd_local = set(getattr(gradtape, "_hvd_local", ()))
    tape._hvd_scale_local = bool(scale_local_gradients)
    return tape


def local_variables_of(local_layers) -> list:
    """The trainable weights of Horovod's ``local_layers`` argument (a layer or a list)."""
    if local_layers is None:
        return []
    layers = [local_layers] if hasattr(local_layers, "trainable_weights") else list(local_layers)
    for layer in layers:
        if not hasattr(layer, "trainable_weights"):
            raise InvalidArgumentError(f"local_layers must hold Keras layers, got "
                                       f"{type(layer).__name__}")
    return [w for layer in layers for w in layer.trainable_weights]


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                                   device_sparse: str = "", compression=Compression.none,
                                   sparse_as_dense: bool = False, op=mpi_ops.Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups=None, process_set: ProcessSet = global_process_set,
                                   local_layers=None,
                                   scale_local_gradients: bool = True) -> tf.GradientTape:
    """A DistributedGradientTape whose ``local_layers``' gradients are not reduced: each
    rank keeps its own (divided by the size when ``scale_local_gradients``, as Horovod)."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for var in local_variables_of(local_layers):
        tape.register_local_source(var)
    return tape
