"""Elastic training with TensorFlow 2: Horovod's ``hvd.elastic`` of ``horovod.tensorflow``.

:class:`TensorFlowKerasState` keeps a Keras 3 model and its optimizer,
:class:`TensorFlowState` a list of ``tf.Variable`` s; both keep any other picklable
attribute as :class:`ObjectState` does. ``commit()`` copies the variables' values to
host memory, a failure puts them back, and each reset assigns rank 0's values to every
rank (``broadcast_variables``). How a reset works is in :mod:`spark_hvd.elastic`;
Keras' callbacks are in :mod:`spark_hvd.tensorflow.keras.elastic`.

Eager TensorFlow only: TF1 sessions (Horovod's ``session`` and ``backend`` arguments)
do not exist in TensorFlow 2.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from spark_hvd import elastic as _elastic
from spark_hvd._basics import rank
from spark_hvd.elastic import ObjectState, State
from spark_hvd.exceptions import HorovodInternalError, InvalidArgumentError
from spark_hvd.tensorflow._async import spark_error
from spark_hvd.tensorflow.functions import broadcast_object, broadcast_variables

__all__ = ["run", "State", "ObjectState", "TensorFlowKerasState", "TensorFlowState"]


def run(func: Callable) -> Callable:
    """Decorator: ``@hvd.elastic.run def train(state, ...)`` (see :mod:`spark_hvd.elastic`).

    A collective that fails inside a graph (``tf.function``, Keras ``fit``) reaches the
    caller as TensorFlow's ``OpError``; it is raised again as the spark_hvd error it
    was, so the job resets as for an eager failure.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as e:
            failure = collective_failure(e)
            if failure is None:
                raise
            raise failure from e

    return _elastic.run(wrapper)


def collective_failure(error: tf.errors.OpError) -> Optional[HorovodInternalError]:
    """The HorovodInternalError behind a TensorFlow error, or None: the error's cause
    (eagerly), the spark_hvd exception its payloads carry (a kernel's failure in a
    tf.function), else the ``Class: message`` line of its message (a TF1 session, or a
    host function's exception)."""
    for found in (error.__cause__, spark_error(error)):
        if isinstance(found, HorovodInternalError):
            return found
    kinds = {cls.__name__: cls for cls in _subclasses(HorovodInternalError)}
    for line in error.message.splitlines():
        name, sep, message = line.partition(": ")
        kind = kinds.get(name.strip().rpartition(".")[2]) if sep else None
        if kind is not None:
            return kind(message)
    return None


def _subclasses(cls: type) -> List[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_subclasses(sub))
    return out


class _VariablesState(ObjectState):
    """Keeps the values of :meth:`_variables` (fixed in number and order) in host memory."""

    def __init__(self, **kwargs: Any) -> None:
        self._save_variables()
        super().__init__(broadcast_object, rank, **kwargs)

    def _variables(self) -> Sequence:
        raise NotImplementedError

    def _save_variables(self) -> None:
        self._saved_values = [np.array(v.numpy(), copy=True) for v in self._variables()]

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        for variable, value in zip(self._variables(), self._saved_values, strict=True):
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        broadcast_variables(self._variables(), root_rank=0)
        self._save_variables()  # a failure before the next commit comes back to this
        super().sync()


class TensorFlowKerasState(_VariablesState):
    """Horovod's TensorFlowKerasState: a built Keras model's variables and its optimizer's
    (``optimizer``, else the compiled ``model.optimizer``), plus ``kwargs`` as attributes.

    An optimizer that has no variables yet is built here, on the model's trainable
    variables (as ``fit`` would), so that every rank, a newly joined one included, holds
    the same variables to sync from the start.
    """

    def __init__(self, model, optimizer=None, **kwargs: Any) -> None:
        if not getattr(model, "built", True):
            raise InvalidArgumentError(
                f"{type(self).__name__} needs a built model: call model.build(input_shape) "
                "or the model on a batch first")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                         None)
        if self.optimizer is not None and not self.optimizer.built:
            self.optimizer.build(model.trainable_variables)
        super().__init__(**kwargs)

    def _variables(self) -> Sequence:
        optimizer = list(self.optimizer.variables) if self.optimizer is not None else []
        return list(self.model.variables) + optimizer


class TensorFlowState(_VariablesState):
    """Horovod's TensorFlowState, for eager TensorFlow 2: the ``tf.Variable`` s given,
    plus ``kwargs`` as attributes."""

    def __init__(self, variables: Optional[Sequence[tf.Variable]] = None, **kwargs: Any) -> None:
        if variables is None:
            raise InvalidArgumentError(
                "TensorFlowState needs variables=[...]: TensorFlow 2 has no global-variable "
                "collection to take them from (for a Keras model use TensorFlowKerasState)")
        self.variables = list(variables)
        super().__init__(**kwargs)

    def _variables(self) -> Sequence:
        return self.variables
