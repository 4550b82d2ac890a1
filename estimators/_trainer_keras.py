"""What each rank runs for KerasEstimator.fit (through spark_hvd.spark.run), and the
checkpoint format.

One rank, in order:

1. ``hvd.init()`` (``spark_hvd.tensorflow.keras``); TensorFlow's intra- and inter-op threads
   set to this process's share of the host's cores; the GPU of this local rank when there
   are GPUs (memory growth on), none with ``use_gpu=False``.
2. The model from its ``.keras`` bytes (with ``custom_objects``), the optimizer from its
   config wrapped in ``hvd.DistributedOptimizer`` (``gradient_compression``,
   ``backward_passes_per_step``; the learning rate as given), compiled with the loss,
   ``loss_weights`` and metrics; the optimizer is built at once so that its state exists.
3. Rank 0 loads weights and optimizer state from ``<run>/checkpoint/last.keras`` when it
   exists (resume); then every model and optimizer variable and the resume point (epoch,
   history, best value) are broadcast from rank 0.
4. Readers on this rank's shard (equal steps on every rank, see spark_hvd.data);
   ``model.fit`` on generators that run the reader's epochs one after the other, with
   ``steps_per_epoch`` the readers' steps and ``initial_epoch`` the resume point.
5. Callbacks, in this order: ``BroadcastGlobalVariablesCallback(0)``,
   ``MetricAverageCallback()`` (the epoch's logs averaged over the ranks), the user's,
   :class:`_Coordinator` (``model.stop_training`` agreed by every rank at the epoch's end;
   ``terminate_on_nan``) and :class:`_Recorder` (history; on rank 0 the progress lines and,
   each epoch, ``last.keras`` (and ``best.keras`` when the monitored loss improved) written
   atomically to the Store, plus ``<run>/logs/history.json`` and the epoch's TensorBoard
   event (``_tensorboard``)).
6. Return a small summary; the model itself goes back through the Store.

A checkpoint is a ``.keras`` file (``keras.models.load_model`` opens it) with one more
member, ``spark_hvd.json``: the epoch, history and best value (see ``_keras_io``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import keras
import numpy as np

from . import _keras_io as keras_io
from ._tensorboard import open_events
from ._trainer_common import (Readers, RunRecord, TrainConfig, announce_start,
                              apply_transformation, as_outputs, checkpoint_file, cpu_share,
                              label_error, load_objects, next_batch, nonfinite_loss_error,
                              nonfinite_weights_error, reshape_to, write_history)

CHECKPOINT_FORMAT = 1
LAST_CHECKPOINT = "last.keras"
BEST_CHECKPOINT = "best.keras"

__all__ = ["train", "read_checkpoint", "write_checkpoint", "batch_converter", "to_array",
           "as_outputs", "model_float_dtype", "CHECKPOINT_FORMAT", "LAST_CHECKPOINT",
           "BEST_CHECKPOINT"]


def read_checkpoint(store: Any, run_id: str, which: str = LAST_CHECKPOINT
                    ) -> Optional[Tuple[bytes, Dict[str, Any]]]:
    """The checkpoint ``which`` of ``run_id`` as (``.keras`` bytes, metadata), or None."""
    path = checkpoint_file(store, run_id, which)
    if not store.exists(path):
        return None
    data = store.read_bytes(path)
    meta = keras_io.metadata_of(data)
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a spark_hvd KerasEstimator checkpoint")
    return data, meta


def write_checkpoint(store: Any, run_id: str, which: str, data: bytes,
                     meta: Mapping[str, Any]) -> None:
    """``data`` (a .keras file) with ``meta`` in it, written atomically."""
    store.write_bytes_atomic(checkpoint_file(store, run_id, which),
                             keras_io.with_metadata(data, dict(meta, format=CHECKPOINT_FORMAT)))


# -- array conventions (driver dry run, ranks, transform) ----------------------------------------

def model_float_dtype(model: Any) -> Any:
    """The numpy type floating-point inputs are cast to: float64 for a float64 model, else
    float32 (mixed-precision models take float32 inputs)."""
    return np.float64 if getattr(model, "compute_dtype", "") == "float64" else np.float32


def to_array(a: Any, float_dtype: Any, shape: Optional[List[int]] = None) -> np.ndarray:
    """One column as the model sees it: floats cast to ``float_dtype``, reshaped by ``shape``
    (see ``reshape_to``)."""
    a = np.asarray(a)
    if a.dtype.kind == "f" and a.dtype != float_dtype:
        a = a.astype(float_dtype)
    return reshape_to(a, shape)


def as_group(arrays: List[Any]) -> Any:
    """One array for one column, a tuple of them for several (model inputs or targets)."""
    return arrays[0] if len(arrays) == 1 else tuple(arrays)


def batch_converter(feature_cols: List[str], label_cols: List[str],
                    input_shapes: Optional[List[List[int]]],
                    label_shapes: Optional[List[List[int]]], sample_weight_col: Optional[str],
                    float_dtype: Any, transformation_fn: Optional[Callable] = None
                    ) -> Callable[[Mapping[str, np.ndarray]], Tuple[Any, ...]]:
    """A reader batch -> ``(x, y)`` or ``(x, y, sample_weight)`` as Keras takes them."""
    def group(batch: Mapping[str, np.ndarray], names: List[str],
              shapes: Optional[List[List[int]]]) -> Any:
        return as_group([to_array(batch[n], float_dtype, shapes[i] if shapes else None)
                         for i, n in enumerate(names)])

    def convert(batch: Mapping[str, np.ndarray]) -> Tuple[Any, ...]:
        if transformation_fn is not None:
            batch = apply_transformation(transformation_fn, batch)
        out = (group(batch, feature_cols, input_shapes), group(batch, label_cols, label_shapes))
        if sample_weight_col:
            out += (to_array(batch[sample_weight_col], float_dtype),)
        return out
    return convert


# -- the rank's job ------------------------------------------------------------------------------

def _configure_tensorflow(tf: Any, use_gpu: Optional[bool], hvd: Any) -> None:
    """Threads and GPU, before TensorFlow starts its runtime."""
    threads = cpu_share(hvd.local_size())
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError:  # the runtime is already up (not in a fresh rank process)
        pass
    gpus = tf.config.list_physical_devices("GPU")
    if use_gpu is False:
        tf.config.set_visible_devices([], "GPU")
        return
    if not gpus:
        if use_gpu:
            raise RuntimeError("use_gpu=True but TensorFlow sees no GPU on this executor; use "
                               "use_gpu=None or False, or give the executors GPUs "
                               "(spark.executor.resource.gpu.amount)")
        return
    gpu = gpus[hvd.local_rank() % len(gpus)]
    tf.config.experimental.set_memory_growth(gpu, True)
    tf.config.set_visible_devices(gpu, "GPU")


def _compile(objs: Dict[str, Any], config: TrainConfig, hvd: Any) -> Any:
    """The model, compiled with the distributed optimizer, which is built."""
    custom = objs.get("custom_objects")
    model = keras_io.model_from_bytes(objs["model"], custom)
    optimizer = hvd.DistributedOptimizer(
        keras_io.optimizer_from_config(objs["optimizer"], custom),
        compression=objs.get("gradient_compression") or hvd.Compression.none,
        backward_passes_per_step=config.backward_passes_per_step,
        average_aggregated_gradients=True)
    model.compile(optimizer=optimizer, loss=objs["loss"], loss_weights=config.loss_weights,
                  metrics=objs.get("metrics"), jit_compile=False)
    model.optimizer.build(model.trainable_variables)
    return model


def train(config: TrainConfig) -> Dict[str, Any]:
    """Train on this rank (see the module docstring); returns a small summary."""
    started = time.perf_counter()
    import tensorflow as tf

    import spark_hvd.tensorflow.keras as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    _configure_tensorflow(tf, config.use_gpu, hvd)
    keras.utils.set_random_seed(config.seed % (2 ** 32))

    objs = load_objects(config.objects)
    model = _compile(objs, config, hvd)

    # Resume: rank 0 reads the checkpoint, everything is broadcast from rank 0.
    resume: Dict[str, Any] = {}
    if rank == 0:
        found = read_checkpoint(config.store, config.run_id)
        if found is not None:
            keras_io.load_state(model, found[0])
            resume = {k: found[1][k] for k in RunRecord.KEYS}
    hvd.broadcast_variables(list(model.variables) + list(model.optimizer.variables), 0,
                            name="estimator.initial_state")
    record = RunRecord(hvd.broadcast_object(resume, root_rank=0, name="estimator.resume"))
    start = record.epoch

    readers = Readers(config, rank, size)
    announce_start(config, rank, start, started, readers.train_steps)
    to_keras = batch_converter(config.feature_cols, config.label_cols, config.input_shapes,
                               config.label_shapes, config.sample_weight_col,
                               model_float_dtype(model), objs.get("transformation_fn"))
    coordinator = _Coordinator(hvd, config, rank, readers.train_steps)
    recorder = _Recorder(config, record, rank, readers.train_steps,
                         open_events(config.store, config.run_id, config.verbose)
                         if rank == 0 else None)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback(),
                 *(objs.get("callbacks") or []), coordinator, recorder]
    ready = time.perf_counter()
    try:
        model.fit(
            _feed(readers.train, start, readers.train_steps, "train", to_keras),
            steps_per_epoch=readers.train_steps, epochs=config.epochs, initial_epoch=start,
            validation_data=(_feed(readers.val, start, readers.val_steps, "val", to_keras)
                             if readers.val is not None else None),
            validation_steps=readers.val_steps or None, callbacks=callbacks, shuffle=False,
            verbose=0)
    except tf.errors.InvalidArgumentError as exc:
        if "label value" not in str(exc):
            raise
        # A class index out of range (TensorFlow names the value): the error names the
        # label columns; the batch's values are in TensorFlow's message.
        raise label_error(_first_line(exc), config.label_cols, [], [], coordinator.epoch,
                          coordinator.step, "training", rank) from exc
    finally:
        readers.close()
    if rank == 0 and config.verbose and record.epoch < config.epochs:
        print(f"a callback stopped training after epoch {record.epoch}", flush=True)
    if rank != 0:
        return {"rank": rank}
    trained = time.perf_counter() - ready
    return {"rank": rank, "epochs": record.epoch, "start_epoch": start,
            "seconds": {"training": trained - recorder.saving, "checkpoints": recorder.saving}}


def _first_line(exc: BaseException) -> BaseException:
    """TensorFlow's error without its graph trace: the line that says what failed."""
    lines = [ln for ln in str(exc).splitlines() if "label value" in ln]
    return type(exc)(None, None, lines[0].strip() if lines else str(exc))


def _feed(reader: Any, start_epoch: int, steps: int, split: str,
          convert: Callable[[Mapping[str, np.ndarray]], Tuple[Any, ...]]) -> Iterator[Any]:
    """``steps`` batches of each of the reader's epochs from ``start_epoch`` on, endlessly:
    Keras takes ``steps_per_epoch`` (``validation_steps``) of them per epoch."""
    epoch = start_epoch
    while True:
        batches = reader.epoch(epoch)
        try:
            for step in range(steps):
                yield convert(next_batch(batches, step, steps, split))
        finally:
            batches.close()
        epoch += 1


class _Coordinator(keras.callbacks.Callback):
    """Every rank stops together: ``model.stop_training`` set by any callback on any rank
    (mid-epoch too) stops all of them at the end of the epoch.

    With ``terminate_on_nan`` a non-finite training loss (Keras' running mean of the epoch:
    it turns non-finite at the first bad step and stays so) is an error naming the epoch and
    step.  The loss alone misses NaN inputs behind a ReLU (TensorFlow's CPU kernels give 0
    for ReLU(NaN): the loss stays finite while the gradients, hence the weights, turn NaN),
    so the trainable weights are looked at too, every :data:`CHECK_EVERY` steps and at the
    epoch's end, before its checkpoint (one pass over the weights, not one per step); every
    rank finds the same, as every rank applies the same averaged gradients."""

    CHECK_EVERY = 64

    def __init__(self, hvd: Any, config: TrainConfig, rank: int, steps: int) -> None:
        super().__init__()
        self.hvd, self.terminate_on_nan, self.rank = hvd, config.terminate_on_nan, rank
        self.epochs, self.steps = config.epochs, steps
        self.pending = False
        self.epoch = self.step = 0  # where training is, for errors
        self.checked = (0, 0)  # (epoch, step) after which the weights were last finite

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.epoch, self.step = epoch, 0
        self.checked = (epoch, 0)

    def on_train_batch_begin(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.step = batch

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.model.stop_training:  # not now: the other ranks are in this epoch's steps
            self.pending, self.model.stop_training = True, False
        if not self.terminate_on_nan:
            return
        if logs and "loss" in logs:
            loss = float(logs["loss"])
            if not np.isfinite(loss):
                raise nonfinite_loss_error(loss, self.epoch, self.epochs, batch + 1,
                                           self.steps, self.rank)
        if batch + 1 - self.checked[1] >= self.CHECK_EVERY:
            self._check_weights(batch + 1)

    def _check_weights(self, step: int) -> None:
        """An error when a trainable weight is NaN or infinite after ``step`` (1-based)."""
        weights = self.model.trainable_weights
        ops = keras.ops
        if weights and not bool(ops.all(ops.stack([ops.all(ops.isfinite(w))
                                                    for w in weights]))):
            names = [getattr(w, "path", w.name) for w in weights
                     if not bool(ops.all(ops.isfinite(w)))]
            raise nonfinite_weights_error(names, self.epoch, self.epochs, step, self.steps,
                                          self.checked, self.rank)
        self.checked = (self.epoch, step)

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.terminate_on_nan and self.checked[1] < self.steps:
            self._check_weights(self.steps)
        stop = self.pending or bool(self.model.stop_training)
        agreed = self.hvd.allreduce(np.array([1.0 if stop else 0.0]), op=self.hvd.Max,
                                    name="estimator.stop_training")
        self.model.stop_training = bool(agreed[0] > 0)
        self.pending = False


class _Recorder(keras.callbacks.Callback):
    """The run's record on every rank; on rank 0 the progress lines and the checkpoints."""

    def __init__(self, config: TrainConfig, record: RunRecord, rank: int, steps: int,
                 events: Any = None) -> None:
        super().__init__()
        self.c, self.record, self.rank, self.steps = config, record, rank, steps
        self.events = events  # rank 0's TensorBoard event file (None: none)
        self.progress: Any = None
        self.saving = 0.0  # seconds rank 0 spent writing checkpoints, history and events

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        from .progress import EpochProgress
        self.progress = EpochProgress(epoch, self.c.epochs, self.steps,
                                      self.c.verbose if self.rank == 0 else 0)

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.progress.verbose and logs and "loss" in logs:
            self.progress.update(batch + 1, lambda: float(logs["loss"]))

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        logs = {k: float(v) for k, v in (logs or {}).items() if np.ndim(v) == 0}
        improved = self.record.add_epoch(epoch, logs)
        if self.rank != 0:
            return
        self.progress.finish(logs)
        begin = time.perf_counter()
        self._save(epoch, logs, improved)
        self.saving += time.perf_counter() - begin

    def _save(self, epoch: int, logs: Dict[str, float], improved: bool) -> None:
        c = self.c
        data = keras_io.model_to_bytes(self.model)
        meta = dict(self.record.state(), run_id=c.run_id)
        write_checkpoint(c.store, c.run_id, LAST_CHECKPOINT, data, meta)
        if improved:
            write_checkpoint(c.store, c.run_id, BEST_CHECKPOINT, data, meta)
        write_history(c.store, c.run_id, epoch + 1, self.record.history)
        if self.events is not None:
            self.events.add_epoch(epoch, logs)
