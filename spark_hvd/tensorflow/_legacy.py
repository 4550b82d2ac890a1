"""DistributedOptimizer for tf.compat.v1.train optimizers (``compute_gradients`` reduces)."""

from __future__ import annotations

from spark_hvd.tensorflow._reducer import GradientReducer


class _DistributedV1Mixin:
    """Goes in front of a tf.compat.v1.train.Optimizer class."""

    _hvd_reducer: GradientReducer

    def compute_gradients(self, *args, **kwargs):
        grads_and_vars = list(super().compute_gradients(*args, **kwargs))
        if not grads_and_vars:
            return grads_and_vars
        grads = self._hvd_reducer([g for g, _ in grads_and_vars])
        return [(g, v) for g, (_, v) in zip(grads, grads_and_vars)]


def wrap_v1(optimizer, reducer: GradientReducer):
    """A copy of ``optimizer`` (sharing its state) whose compute_gradients reduces."""
    base = type(optimizer)
    while issubclass(base, _DistributedV1Mixin):
        base = base.__mro__[2]
    cls = type(base.__name__, (_DistributedV1Mixin, base),
               {"__module__": base.__module__, "__qualname__": base.__qualname__})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._hvd_reducer = reducer
    return wrapped
