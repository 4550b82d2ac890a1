"""Elastic training with Keras 3: Horovod's ``hvd.elastic`` of ``horovod.tensorflow.keras``.

::

    import spark_hvd.tensorflow.keras as hvd

    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(opt), loss=...)
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    state.register_reset_callbacks([lambda: model.optimizer.learning_rate.assign(lr * hvd.size())])
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state)]  # last: it saves what they set

    @hvd.elastic.run
    def train(state):
        state.model.fit(data, steps_per_epoch=..., epochs=epochs - state.epoch,
                        callbacks=callbacks)

    train(state)

After a reset ``fit`` starts again, for the epochs not yet done (``epochs -
state.epoch``, Horovod's pattern: UpdateEpochStateCallback counts from ``state.epoch``,
so do not pass ``initial_epoch`` as well). Keras 3, like tf.keras 2, runs a whole epoch
whatever UpdateBatchStateCallback sets ``params["steps"]`` to: the epoch a failure
interrupted is trained again from its start.
"""

from __future__ import annotations

from typing import Optional

import keras

from spark_hvd.tensorflow.elastic import ObjectState, State, TensorFlowKerasState, run

__all__ = ["run", "State", "ObjectState", "KerasState", "CommitStateCallback",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback"]


class KerasState(TensorFlowKerasState):
    """Horovod's KerasState: ``KerasState(model, optimizer=None, **kwargs)``, the state of a
    Keras 3 model and its optimizer (see TensorFlowKerasState)."""


class CommitStateCallback(keras.callbacks.Callback):
    """Commits ``state`` after every ``batches_per_commit`` batches and at the end of each
    epoch. Put it after the callbacks that update the state."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit  # the same on every rank after a reset

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` at the number of the last finished batch of the epoch (0 when
    an epoch ends); a resumed first epoch reports ``steps - state.batch`` steps in
    ``params``."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: Optional[int] = None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params["steps"]
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Sets ``state.epoch`` to the number of epochs finished, counted across resets: the
    value ``state.epoch`` had when ``fit`` began, plus the epochs of this ``fit``."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1
