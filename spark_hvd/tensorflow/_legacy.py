"""TensorFlow 1 graph mode (``tf.compat.v1``): DistributedOptimizer for
tf.compat.v1.train optimizers, broadcast_global_variables and BroadcastGlobalVariablesHook.

In a TF1 graph every collective is a ``tf.numpy_function`` node run by a
``tf.compat.v1.Session`` (or MonitoredTrainingSession) like any other op. Unlike in a
``tf.function``, nothing orders stateful nodes in a v1 graph, and each collective node holds
an executor thread until every rank has joined it; so a library call that makes several
collective nodes chains them (``_host.in_order``), and the gradients of one optimizer step go
as one fused group.
"""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow as tf

from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.tensorflow._host import in_order, stable_name
from spark_hvd.tensorflow._reducer import GradientReducer, variable_key
from spark_hvd.tensorflow.functions import broadcast_variables

_v1 = tf.compat.v1


def _in_tf1_graph() -> bool:
    return not tf.executing_eagerly() and not _v1.get_default_graph().building_function


class _Accumulation:
    """``backward_passes_per_step=k`` in a TF1 graph, with Horovod's semantics.

    Every ``compute_gradients`` pass adds its gradients to local variables (not saved, not
    broadcast); every k-th pass reduces their sum across the ranks (divided by k with
    ``average_aggregated_gradients``) and ``apply_gradients`` applies it; on the other
    passes ``apply_gradients`` only advances ``global_step``, so a StopAtStepHook counts
    passes. The other passes return this rank's running sums, which nothing applies.
    """

    def __init__(self, passes: int, average: bool, sparse_as_dense: bool, scope: str) -> None:
        self.passes = passes
        self.average = average
        self.sparse_as_dense = sparse_as_dense
        self.scope = scope
        self.counter = None

    def _dense(self, grad):
        if isinstance(grad, tf.IndexedSlices):
            if not self.sparse_as_dense:
                raise InvalidArgumentError(
                    "backward_passes_per_step > 1 accumulates dense gradients: a gradient is "
                    "tf.IndexedSlices; pass sparse_as_dense=True")
            return tf.convert_to_tensor(grad)
        return grad

    def compute(self, grads: list, variables: list, reduce: Callable[..., list]) -> list:
        idx = [i for i, g in enumerate(grads) if g is not None]
        if not idx:
            return grads
        dense = [self._dense(grads[i]) for i in idx]
        local = [_v1.GraphKeys.LOCAL_VARIABLES]
        with _v1.variable_scope(self.scope, reuse=_v1.AUTO_REUSE):
            self.counter = _v1.get_variable("passes", shape=(), dtype=tf.int32, trainable=False,
                                            initializer=_v1.zeros_initializer(),
                                            collections=local, use_resource=True)
            sums = [_v1.get_variable(f"sum{i}", shape=variables[i].shape, dtype=g.dtype,
                                     trainable=False, initializer=_v1.zeros_initializer(),
                                     collections=local, use_resource=True)
                    for i, g in zip(idx, dense)]
        count = self.counter.read_value()  # passes since the last reduction
        first = tf.equal(count, 0)
        summed = [s.assign(tf.where(first, g, s.read_value() + g)) for s, g in zip(sums, dense)]
        name = stable_name(self.scope, summed)  # outside the cond: the same on every rank
        reduce_now = tf.equal(count + 1, self.passes)

        def reduced():
            out = reduce(summed, [variables[i] for i in idx], name)
            return [o / self.passes for o in out] if self.average else out

        out = tf.cond(reduce_now, reduced, lambda: [tf.identity(s) for s in summed])
        out = out if isinstance(out, (list, tuple)) else [out]
        with tf.control_dependencies(out):
            advance = self.counter.assign(tf.math.floormod(count + 1, self.passes))
        with tf.control_dependencies([advance]):
            out = [tf.identity(o) for o in out]
        result: list = [None] * len(grads)
        for i, o in zip(idx, out):
            result[i] = o
        return result

    def apply(self, apply_fn: Callable, grads_and_vars: list, global_step):
        if self.counter is None:
            raise InvalidArgumentError("apply_gradients with backward_passes_per_step > 1 "
                                       "needs the gradients of this optimizer's "
                                       "compute_gradients (or use minimize)")
        deps = [g for g, _ in grads_and_vars if g is not None]
        deps = [g.values if isinstance(g, tf.IndexedSlices) else g for g in deps]
        with tf.control_dependencies(deps):
            applying = tf.equal(self.counter.read_value(), 0)

        def apply():
            with tf.control_dependencies([apply_fn()]):
                return tf.constant(True)

        def skip():
            if global_step is None:
                return tf.constant(False)
            with tf.control_dependencies([_v1.assign_add(global_step, 1)]):
                return tf.constant(False)

        return tf.cond(applying, apply, skip).op


class _DistributedV1Mixin:
    """Goes in front of a tf.compat.v1.train.Optimizer class (see :func:`wrap_v1`)."""

    _hvd_reducer: GradientReducer
    _hvd_local: set
    _hvd_scale_local: bool
    _hvd_accumulation: Optional[_Accumulation]

    def register_local_var(self, var) -> None:
        """Horovod's: ``var``'s gradient stays this rank's own (divided by the size with
        ``scale_local_gradients``), not reduced across ranks."""
        self._hvd_local.add(variable_key(var))

    def _hvd_reduce(self, grads: list, variables: list, name: Optional[str] = None) -> list:
        return self._hvd_reducer(grads, name=name, variables=variables,
                                 local=frozenset(self._hvd_local),
                                 scale_local_gradients=self._hvd_scale_local)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's gradients, reduced across the ranks."""
        if self._hvd_accumulation is not None and not _in_tf1_graph():
            raise InvalidArgumentError("backward_passes_per_step > 1 with a tf.compat.v1 "
                                       "optimizer needs graph mode, as in Horovod")
        with in_order():  # the collectives of the backward pass, then the reduction
            grads_and_vars = list(super().compute_gradients(*args, **kwargs))
            if not grads_and_vars:
                return grads_and_vars
            grads = [g for g, _ in grads_and_vars]
            variables = [v for _, v in grads_and_vars]
            if self._hvd_accumulation is None:
                grads = self._hvd_reduce(grads, variables)
            else:
                grads = self._hvd_accumulation.compute(grads, variables, self._hvd_reduce)
        return list(zip(grads, variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The wrapped optimizer's; with backward_passes_per_step > 1 only on the passes
        that reduced (the others advance ``global_step``)."""
        apply = super().apply_gradients
        if self._hvd_accumulation is None:
            return apply(grads_and_vars, global_step=global_step, name=name)
        grads_and_vars = list(grads_and_vars)
        return self._hvd_accumulation.apply(
            lambda: apply(grads_and_vars, global_step=global_step, name=name),
            grads_and_vars, global_step)


def wrap_v1(optimizer, reducer: GradientReducer, backward_passes_per_step: int = 1,
            average_aggregated_gradients: bool = False, scale_local_gradients: bool = True,
            name: Optional[str] = None):
    """A copy of ``optimizer`` (sharing its state and slots) whose compute_gradients reduces.

    The copy is an instance of a subclass of the optimizer's class, so ``isinstance``,
    ``get_slot`` and ``variables`` work as on the original, and ``minimize`` reduces.
    """
    if backward_passes_per_step < 1:
        raise InvalidArgumentError(f"backward_passes_per_step must be >= 1, got "
                                   f"{backward_passes_per_step}")
    if backward_passes_per_step > 1 and tf.executing_eagerly():
        raise InvalidArgumentError("backward_passes_per_step > 1 with a tf.compat.v1 optimizer "
                                   "needs graph mode (tf.compat.v1.disable_eager_execution() "
                                   "or a tf.Graph), as in Horovod")
    base = type(optimizer)
    while issubclass(base, _DistributedV1Mixin):
        base = base.__mro__[2]
    cls = type(base.__name__, (_DistributedV1Mixin, base),
               {"__module__": base.__module__, "__qualname__": base.__qualname__})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._hvd_reducer = reducer
    wrapped._hvd_local = set(getattr(optimizer, "_hvd_local", ()))
    wrapped._hvd_scale_local = bool(scale_local_gradients)
    wrapped._hvd_accumulation = None
    if backward_passes_per_step > 1:
        scope = f"{name or 'Distributed' + base.__name__}_aggregation"
        wrapped._hvd_accumulation = _Accumulation(
            backward_passes_per_step, average_aggregated_gradients, reducer.sparse_as_dense,
            scope)
    return wrapped


# -- broadcasting the global variables ------------------------------------------------------

def broadcast_global_variables(root_rank: int):
    """Returns an op that assigns root_rank's values to ``tf.compat.v1.global_variables()``
    on every rank (TF1 graph mode; run it in the session after initialization).

    Every rank must have built the same global variables in the same order.
    """
    if not _in_tf1_graph():
        raise InvalidArgumentError(
            "broadcast_global_variables() needs a TF1 graph (tf.compat.v1.disable_eager_"
            "execution(), or inside `with tf.Graph().as_default():`); in TensorFlow 2 use "
            "broadcast_variables(model.variables, root_rank) after the first step (or, with "
            "Keras, spark_hvd.tensorflow.keras.callbacks.BroadcastGlobalVariablesCallback)")
    op = broadcast_variables(_v1.global_variables(), root_rank)
    return tf.no_op(name="broadcast_global_variables") if op is None else op


class BroadcastGlobalVariablesHook(_v1.train.SessionRunHook):
    """A SessionRunHook that broadcasts root_rank's global variables right after the
    session is created (and initialized or restored from a checkpoint), so that every rank
    starts from the same values. For ``tf.compat.v1.train.MonitoredTrainingSession``.

    ``device`` is accepted for Horovod compatibility: the broadcast runs on the host.
    """

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.bcast_op = None

    def begin(self) -> None:
        if self.bcast_op is None or self.bcast_op.graph is not _v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord) -> None:
        session.run(self.bcast_op)
