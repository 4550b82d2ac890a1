"""DistributedOptimizer for Keras 3 optimizers (TensorFlow backend).

``DistributedOptimizer(opt)`` returns a new optimizer of a subclass of ``type(opt)``
built from ``opt.get_config()``, so ``isinstance`` checks, ``get_config`` and saving
behave as for the original class (a saved model loads back with the plain optimizer;
:func:`spark_hvd.tensorflow.keras.load_model` loads it distributed). The subclass
overrides ``apply`` (which ``apply_gradients`` and ``model.fit`` call): gradients are
reduced across ranks in one fused group before the update, so loss scaling, clipping,
weight decay and constraints all see the reduced gradients.

``backward_passes_per_step=k`` adds the gradients of k calls in accumulators (optimizer
variables, so they are saved with it) and reduces and applies them on every k-th call
(the sum, or the mean with ``average_aggregated_gradients=True``); ``iterations`` counts
every call, as with Keras' own ``gradient_accumulation_steps``.

XLA: the reduction is a ``tf.numpy_function``, which XLA cannot compile. The first
``DistributedOptimizer`` installs a check into ``keras.Model.make_train_function``: a
model whose optimizer is distributed and whose ``jit_compile`` is on (explicitly, or
``"auto"`` resolved to True on a GPU machine) gets its train function built with
``jit_compile=False``, with one warning per process; ``model.jit_compile`` keeps its
value, and evaluation and prediction (no collectives) keep XLA. Models of other
optimizers are untouched.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import warnings
from typing import Any, Optional

import keras
import tensorflow as tf

from spark_hvd._basics import ProcessSet, global_process_set
from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.tensorflow import mpi_ops
from spark_hvd.tensorflow._collective import _reduce_op
from spark_hvd.tensorflow._reducer import GradientReducer, variable_key
from spark_hvd.tensorflow.gradient_tape import local_variables_of
from spark_hvd.tensorflow.compression import Compression


@dataclasses.dataclass(frozen=True)
class _Settings:
    compression: Any = Compression.none
    op: Any = mpi_ops.Average
    gradient_predivide_factor: float = 1.0
    sparse_as_dense: bool = False
    process_set: ProcessSet = global_process_set
    backward_passes_per_step: int = 1
    average_aggregated_gradients: bool = False
    scale_local_gradients: bool = True


class _DistributedOptimizerMixin:
    """Goes in front of a Keras optimizer class; ``_hvd_settings`` is set on the subclass."""

    _hvd_settings: _Settings = _Settings()
    _hvd_reducer_obj: Optional[GradientReducer] = None
    _hvd_accumulators: Optional[list] = None
    _hvd_counter: Any = None
    _hvd_local: frozenset = frozenset()

    # Instance attributes are set with object.__setattr__: Keras' __setattr__ would track
    # the accumulator list a second time (they are tracked when created).
    def _hvd_set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)

    def register_local_var(self, var) -> None:
        """Horovod's: ``var``'s gradient stays this rank's own (divided by the size when
        ``scale_local_gradients``), not reduced across ranks."""
        self._hvd_set("_hvd_local", self._hvd_local | {variable_key(var)})

    def _hvd_reduce(self, grads, variables=None):
        reducer = self._hvd_reducer_obj
        if reducer is None:
            s = self._hvd_settings
            reducer = GradientReducer(compression=s.compression, op=s.op,
                                      gradient_predivide_factor=s.gradient_predivide_factor,
                                      sparse_as_dense=s.sparse_as_dense,
                                      process_set=s.process_set, prefix="DistributedOptimizer")
            self._hvd_set("_hvd_reducer_obj", reducer)
        if self._hvd_local and variables is None:
            variables = self._trainable_variables
        return reducer(grads, variables=variables, local=self._hvd_local,
                       scale_local_gradients=self._hvd_settings.scale_local_gradients)

    def build(self, variables):
        super().build(variables)
        self._hvd_build_accumulators()

    def _hvd_build_accumulators(self) -> None:
        if self._hvd_settings.backward_passes_per_step == 1 or self._hvd_accumulators is not None:
            return
        accumulators = [self.add_variable_from_reference(v, name="hvd_accumulator")
                        for v in self._trainable_variables]
        counter = self.add_variable(shape=(), dtype="int64", initializer="zeros",
                                    name="hvd_backward_passes")
        self._hvd_set("_hvd_accumulators", accumulators)
        self._hvd_set("_hvd_counter", counter)

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if not grads:
            return super().apply(grads, trainable_variables)
        if self._hvd_settings.backward_passes_per_step == 1:
            return super().apply(self._hvd_reduce(grads, trainable_variables),
                                 trainable_variables)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
                self.built = True
        elif not self.built:
            return super().apply(grads, None)  # raises Keras' own "build first" error
        else:
            trainable_variables = self._trainable_variables
        self._hvd_build_accumulators()
        return self._hvd_accumulate(grads, trainable_variables)

    def _hvd_accumulate(self, grads, variables):
        k = self._hvd_settings.backward_passes_per_step
        accumulators = [self._hvd_accumulators[self._get_variable_index(v)] for v in variables]
        present = [i for i, g in enumerate(grads) if g is not None]
        for i in present:
            self.assign_add(accumulators[i], grads[i])
        self._hvd_counter.assign_add(1)
        base_apply = super(_DistributedOptimizerMixin, self).apply

        def update():
            summed = [None] * len(grads)
            for i in present:
                summed[i] = tf.convert_to_tensor(accumulators[i])
                if self._hvd_settings.average_aggregated_gradients:
                    summed[i] = summed[i] / tf.cast(k, summed[i].dtype)
            base_apply(self._hvd_reduce(summed, variables), variables)
            for i in present:
                accumulators[i].assign(tf.zeros_like(summed[i]))
            return tf.constant(True)

        def accumulate_only():
            self._iterations.assign_add(1)
            return tf.constant(False)

        counter = tf.convert_to_tensor(self._hvd_counter)
        if tf.executing_eagerly():
            return update() if int(counter) % k == 0 else accumulate_only()
        return tf.cond(tf.equal(counter % k, 0), update, accumulate_only)


def _original_class(cls: type) -> type:
    while issubclass(cls, _DistributedOptimizerMixin):
        cls = cls.__mro__[2]
    return cls


def _distributed_class(base: type, settings: _Settings) -> type:
    base = _original_class(base)
    return type(base.__name__, (_DistributedOptimizerMixin, base),
                {"__module__": base.__module__, "__qualname__": base.__qualname__,
                 "_hvd_settings": settings})


def _settings(compression, sparse_as_dense, gradient_predivide_factor, op,
              backward_passes_per_step, average_aggregated_gradients,
              process_set, scale_local_gradients: bool = True) -> _Settings:
    if int(backward_passes_per_step) < 1:
        raise InvalidArgumentError(
            f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    settings = _Settings(compression=compression, op=_reduce_op(op, None),
                         gradient_predivide_factor=float(gradient_predivide_factor),
                         sparse_as_dense=bool(sparse_as_dense), process_set=process_set,
                         backward_passes_per_step=int(backward_passes_per_step),
                         average_aggregated_gradients=bool(average_aggregated_gradients),
                         scale_local_gradients=bool(scale_local_gradients))
    GradientReducer(compression=compression, op=settings.op,  # validates the combination
                    gradient_predivide_factor=settings.gradient_predivide_factor)
    return settings


def DistributedOptimizer(optimizer, name: Optional[str] = None, device_dense: str = "",
                         device_sparse: str = "", compression=Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op=mpi_ops.Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups=None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True):
    """Returns a Keras optimizer like ``optimizer`` whose updates use gradients reduced
    across the ranks (see the module docstring).

    Parameters
    ----------
    optimizer : a ``keras.optimizers.Optimizer`` (Adam, SGD, ..., LossScaleOptimizer), or
        its name or config as ``keras.optimizers.get`` takes it.
    name : name of the new optimizer (default: the original's).
    compression : ``Compression.none`` / ``fp16`` / ``bf16`` for the gradients on the wire.
    sparse_as_dense : reduce ``tf.IndexedSlices`` gradients as dense tensors.
    gradient_predivide_factor : op=Average only: divide by this before the sum and by
        ``size / factor`` after it.
    op : ``Average`` (default), ``Sum`` or ``Adasum`` (the gradients combined with Adasum).
    backward_passes_per_step : reduce and apply every k-th call, accumulating in between.
    average_aggregated_gradients : divide the accumulated gradients by k.
    process_set : the ranks to reduce over.
    scale_local_gradients : divide the gradients of variables registered with
        ``register_local_var`` (see :func:`PartialDistributedOptimizer`) by the size.
    device_dense, device_sparse, num_groups, groups : accepted for Horovod compatibility;
        all gradients form one group that the core fuses.
    """
    if isinstance(optimizer, (str, dict)):
        optimizer = keras.optimizers.get(optimizer)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise InvalidArgumentError(
            f"DistributedOptimizer needs a keras.optimizers.Optimizer, got "
            f"{type(optimizer).__name__}; for a custom training loop use "
            "spark_hvd.tensorflow.DistributedGradientTape")
    settings = _settings(compression, sparse_as_dense, gradient_predivide_factor, op,
                         backward_passes_per_step, average_aggregated_gradients, process_set,
                         scale_local_gradients)
    cls = _distributed_class(type(optimizer), settings)
    config = optimizer.get_config()
    if name:
        config["name"] = name
    _XLA_GUARD.install()
    return cls.from_config(config)


def PartialDistributedOptimizer(optimizer, name: Optional[str] = None, device_dense: str = "",
                                device_sparse: str = "", compression=Compression.none,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op=mpi_ops.Average,
                                backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False,
                                groups=None, process_set: ProcessSet = global_process_set,
                                local_layers=None, scale_local_gradients: bool = True):
    """A DistributedOptimizer whose ``local_layers``' gradients are not reduced: each rank
    applies its own (divided by the size when ``scale_local_gradients``, as Horovod)."""
    opt = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression,
                               sparse_as_dense, gradient_predivide_factor, op,
                               backward_passes_per_step, average_aggregated_gradients,
                               groups=groups, process_set=process_set,
                               scale_local_gradients=scale_local_gradients)
    for var in local_variables_of(local_layers):
        opt.register_local_var(var)
    return opt


def make_distributed(optimizer, settings: _Settings):
    """Turns an existing optimizer (with its state) distributed, in place."""
    optimizer.__class__ = _distributed_class(type(optimizer), settings)
    _XLA_GUARD.install()
    return optimizer


def is_distributed(optimizer) -> bool:
    """True for a DistributedOptimizer, also when wrapped by a LossScaleOptimizer."""
    while optimizer is not None:
        if isinstance(optimizer, _DistributedOptimizerMixin):
            return True
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return False


class _XlaGuard:
    """Switches XLA off for training a model whose optimizer is distributed (one warning)."""

    MESSAGE = ("spark_hvd: the model was compiled with jit_compile enabled, but "
               "DistributedOptimizer reduces gradients through tf.numpy_function, which XLA "
               "cannot compile; training this model without XLA instead (evaluation and "
               "prediction keep it). Pass jit_compile=False to model.compile() to silence "
               "this warning.")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.installed = False
        self.warned = False

    def install(self) -> None:
        with self.lock:
            if self.installed:
                return
            original = keras.Model.make_train_function
            guard = self

            @functools.wraps(original)
            def make_train_function(model, force=False):
                if not guard.needs_fallback(model):
                    return original(model, force)
                # Build the train function without XLA, then give jit_compile back its
                # value: evaluate() and predict() have no collectives and keep XLA.
                model.jit_compile = False
                try:
                    return original(model, True)
                finally:
                    model.jit_compile = True

            keras.Model.make_train_function = make_train_function
            self.installed = True

    def needs_fallback(self, model) -> bool:
        """True (after one warning per process) for a model that would train under XLA
        with a distributed optimizer."""
        if model.run_eagerly or not is_distributed(getattr(model, "optimizer", None)):
            return False
        if not model.jit_compile:
            return False
        with self.lock:
            first, self.warned = not self.warned, True
        if first:
            warnings.warn(self.MESSAGE, UserWarning, stacklevel=4)
        return True


_XLA_GUARD = _XlaGuard()
