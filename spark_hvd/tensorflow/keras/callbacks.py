"""Keras 3 callbacks for distributed training (Horovod's set, Keras 3 semantics)."""

from __future__ import annotations

from typing import Callable, Optional, Union

import keras
import numpy as np

from spark_hvd import _ops
from spark_hvd._basics import ProcessSet, global_process_set
from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.tensorflow.functions import broadcast_variables


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Makes every rank start from root_rank's state.

    At the start of training it broadcasts the model's variables (when the model is
    already built); after the first batch, when the optimizer's variables exist, it
    broadcasts the model's and the optimizer's variables again. Once per callback object.
    """

    def __init__(self, root_rank: int = 0, device: str = "",
                 process_set: ProcessSet = global_process_set) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.process_set = process_set
        self.broadcast_done = False

    def _broadcast(self, variables, tag: str) -> None:
        if variables:
            broadcast_variables(variables, self.root_rank, process_set=self.process_set,
                                name=f"BroadcastGlobalVariablesCallback.{tag}")

    def on_train_begin(self, logs=None):
        if not self.broadcast_done and self.model.built:
            self._broadcast(list(self.model.variables), "model")

    def on_train_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        optimizer = getattr(self.model, "optimizer", None)
        variables = list(self.model.variables)
        if optimizer is not None:
            variables += list(optimizer.variables)
        self._broadcast(variables, "all")
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces each scalar value in the epoch logs by its average over the ranks.

    Put it before callbacks that read the logs (ModelCheckpoint, ReduceLROnPlateau, ...);
    ``History`` comes last and records the averages. The progress bar prints before it.
    """

    def __init__(self, device: str = "", process_set: ProcessSet = global_process_set) -> None:
        super().__init__()
        self.process_set = process_set

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        if not keys:
            return
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        averaged = _ops.allreduce(values, op=_ops.Average,
                                  name=f"MetricAverageCallback.{epoch}",
                                  process_set=self.process_set)
        logs.update(zip(keys, averaged.tolist()))


def _set_learning_rate(optimizer, value: float) -> None:
    lr = optimizer.learning_rate
    if not isinstance(lr, keras.Variable):
        raise InvalidArgumentError(
            "learning-rate callbacks need an optimizer with a constant learning rate (a "
            f"variable), but {type(optimizer).__name__} has {type(lr).__name__}; pass a float "
            "learning_rate instead of a LearningRateSchedule")
    lr.assign(value)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets ``learning_rate = initial_lr * multiplier(epoch)`` for epochs in
    [start_epoch, end_epoch).

    multiplier : a constant, or a function of the epoch. With ``staircase=True`` the
        rate is set at the first batch of each epoch from the integer epoch; with
        ``staircase=False`` at every batch from the fractional epoch
        ``epoch + batch / steps_per_epoch`` (steps_per_epoch defaults to what ``fit``
        reports). A constant multiplier implies staircase.
    momentum_correction : accepted for Horovod compatibility. Keras 3 optimizers compile
        their momentum into the training step as a Python float, so it is not rescaled.
    """

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None,
                 staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise InvalidArgumentError(f"{type(self).__name__} needs initial_lr")
        self.initial_lr = float(initial_lr)
        if callable(multiplier):
            self.multiplier = multiplier
            self.staircase = staircase
        else:
            self.multiplier = lambda epoch, m=float(multiplier): m
            self.staircase = True
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def _active(self, epoch: int) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise InvalidArgumentError(
                    f"{type(self).__name__}: fit() did not report the number of steps per "
                    "epoch; pass steps_per_epoch=")
            self.steps_per_epoch = steps

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def learning_rate_at(self, epoch: float) -> float:
        return self.initial_lr * self.multiplier(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if not self._active(self.current_epoch):
            return
        if self.staircase:
            if batch == 0:
                _set_learning_rate(self.model.optimizer, self.learning_rate_at(self.current_epoch))
        else:
            epoch = self.current_epoch + batch / self.steps_per_epoch
            _set_learning_rate(self.model.optimizer, self.learning_rate_at(epoch))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = float(np.asarray(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from ``initial_lr / size`` to ``initial_lr`` over
    ``warmup_epochs``, at every batch (Goyal et al., 2017: "Accurate, Large Minibatch SGD").

    ``initial_lr`` is the target rate, usually the single-process rate times ``size()``.
    The rate after batch b of epoch e is ``initial_lr / size * (1 + t * (size - 1) /
    warmup_epochs)`` with ``t = e + (b + 1) / steps_per_epoch``: it reaches initial_lr at
    the last batch of the warm-up.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0, process_set: ProcessSet = global_process_set) -> None:
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose
        self.process_set = process_set
        super().__init__(initial_lr, self._warmup_multiplier, start_epoch=0,
                         end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)

    def _warmup_multiplier(self, epoch: float) -> float:
        n = self.process_set.size()
        t = epoch + 1.0 / self.steps_per_epoch
        return (1.0 + t * (n - 1) / self.warmup_epochs) / n

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if self.verbose and epoch == self.warmup_epochs - 1:
            lr = float(np.asarray(self.model.optimizer.learning_rate))
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Horovod's: a ``ModelCheckpoint`` that keeps only the best model (``save_best_only``,
    the whole model, not just weights) by ``monitor``. Give it to rank 0 only, or a path
    per rank, so ranks never write one file."""

    def __init__(self, filepath: str, monitor: str = "val_loss", verbose: int = 0,
                 mode: str = "auto", save_freq: Union[str, int] = "epoch") -> None:
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=False, mode=mode,
                         save_freq=save_freq)
