"""What the per-rank trainers of TorchEstimator and KerasEstimator share: the config a rank
gets, the user's objects, the readers with their steps per epoch, and the run's record
(history, best epoch) that goes into the checkpoints and ``<run>/logs/history.json``.
"""

from __future__ import annotations

import json
import os
import posixpath
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from spark_hvd.exceptions import InvalidArgumentError

HISTORY_FILE = "history.json"


class TrainingInputError(InvalidArgumentError):
    """Bad input a rank finds while training (a NaN loss, labels the loss refuses): the
    driver's ``fit`` raises it as an InvalidArgumentError with the rank's message (see
    ``_estimator_base.DistributedEstimator._train``)."""


@dataclass
class TrainConfig:
    """Everything a rank needs, picklable (the user's objects are in ``objects``, cloudpickled)."""

    run_id: str
    store: Any
    meta: Any  # DataMeta
    objects: bytes
    feature_cols: List[str]
    label_cols: List[str]
    sample_weight_col: Optional[str]
    input_shapes: Optional[List[List[int]]]
    label_shapes: Optional[List[List[int]]]
    loss_weights: Optional[List[float]]
    batch_size: int
    val_batch_size: int
    epochs: int
    train_steps_per_epoch: Optional[int]
    validation_steps_per_epoch: Optional[int]
    shuffle: bool
    shuffle_buffer_size: Optional[int]
    seed: int
    backward_passes_per_step: int
    use_gpu: Optional[bool]
    verbose: int
    terminate_on_nan: bool
    reader: str = "arrow"
    extra: Dict[str, Any] = field(default_factory=dict)


def checkpoint_dir(store: Any, run_id: str) -> str:
    return store.get_checkpoint_path(run_id)


def checkpoint_file(store: Any, run_id: str, which: str) -> str:
    return posixpath.join(checkpoint_dir(store, run_id), which)


def remove_run_temporaries(store: Any, run_id: str) -> None:
    """Remove what interrupted writes left in the run's checkpoint and logs directories."""
    for directory in (checkpoint_dir(store, run_id), store.get_logs_path(run_id)):
        store.remove_temporaries(directory)


def write_history(store: Any, run_id: str, epochs: int, history: Mapping[str, List[float]]
                  ) -> None:
    """``<run>/logs/history.json``: the epochs trained so far and their metrics."""
    store.write_bytes_atomic(posixpath.join(store.get_logs_path(run_id), HISTORY_FILE),
                             json.dumps({"epochs": epochs, "history": history},
                                        indent=1).encode())


def load_objects(blob: bytes) -> Dict[str, Any]:
    """The user's objects; a module the executors cannot import gets an error with the fix."""
    import cloudpickle
    try:
        return cloudpickle.loads(blob)
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"{exc}: the model, loss, metrics or callbacks refer to module '{exc.name}', which "
            f"this executor cannot import. Install it on the executors (or "
            f"spark.sparkContext.addPyFile), or ship it with the objects by calling "
            f"cloudpickle.register_pickle_by_value({exc.name}) on the driver before fit",
            name=exc.name) from exc


def cpu_share(local_size: int) -> int:
    """This process's share of the host's cores (at least 1)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) // max(1, local_size))


def as_outputs(out: Any) -> List[Any]:
    """A model's return value as a list of tensors/arrays."""
    if isinstance(out, (list, tuple)):
        return list(out)
    if isinstance(out, dict):
        return list(out.values())
    return [out]


def reshape_to(t: Any, shape: Optional[Sequence[int]]) -> Any:
    """``[-1, 1, 8, 8]`` is a full shape (batch first); ``[1, 8, 8]`` a per-row shape (numpy
    arrays and torch tensors alike)."""
    if shape is None:
        return t
    shape = list(shape)
    return t.reshape(shape) if shape and shape[0] == -1 else t.reshape([-1] + shape)


def next_batch(batches: Iterator[Any], step: int, steps: int, split: str) -> Any:
    try:
        return next(batches)
    except StopIteration:
        raise ValueError(f"the {split} reader ended after {step} of {steps} batches on this "
                         f"process; lower train_steps_per_epoch/validation_steps_per_epoch") \
            from None


def nonfinite_loss_error(value: float, epoch: int, epochs: int, step: int, steps: int,
                         rank: int) -> TrainingInputError:
    """The error when the training loss is NaN or infinite at ``step`` (1-based) of epoch
    ``epoch`` (0-based)."""
    return TrainingInputError(
        f"the training loss is {value} at epoch {epoch + 1}/{epochs}, step {step}/{steps} "
        f"(rank {rank}); training stopped there (terminate_on_nan=True). Fix: lower the "
        f"learning rate, check the data for NaN or infinite values (the training data holds "
        f"none unless allow_nonfinite=True), or pass terminate_on_nan=False to train on")


def nonfinite_weights_error(names: Sequence[str], epoch: int, epochs: int, step: int,
                            steps: int, checked: Tuple[int, int], rank: int
                            ) -> TrainingInputError:
    """The error when the model's weights are NaN or infinite after ``step`` (1-based) of
    epoch ``epoch`` (0-based) though the loss was finite; ``checked`` is the (epoch, step)
    after which they were last found finite."""
    since = (f"finite after step {checked[1]}" if checked[0] == epoch and checked[1]
             else "finite at the epoch's start")
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (f" and {len(names) - 3} more"
                                                       if len(names) > 3 else "")
    return TrainingInputError(
        f"the model's weights are non-finite at epoch {epoch + 1}/{epochs}, step "
        f"{step}/{steps} (rank {rank}; {since}): {shown}, though the training loss stayed "
        f"finite (its gradients were not: a finite loss can have an infinite gradient, and a "
        f"layer such as ReLU can turn NaN inputs into finite outputs while their gradients "
        f"are NaN); training stopped there (terminate_on_nan=True). Fix: check the "
        f"data for NaN or infinite values (the training data holds none unless "
        f"allow_nonfinite=True), lower the learning rate, or pass terminate_on_nan=False to "
        f"train on")


def label_error(exc: BaseException, label_cols: Sequence[str], labels: Sequence[np.ndarray],
                output_shapes: Sequence[Tuple[int, ...]], epoch: int, step: int, split: str,
                rank: int) -> TrainingInputError:
    """The error when the loss refuses a batch's labels on a rank (a class index out of
    range: ``exc``), naming the label columns and, when given, the values the batch holds
    and the model's output shapes."""
    held = []
    for y in labels:
        y = np.asarray(y)
        held.append(f"from {y.min()} to {y.max()}" if y.size and y.dtype.kind in "iu"
                    else f"{y.dtype} {tuple(y.shape)}")
    evidence = "; ".join(
        [f"'{c}' {h}" for c, h in zip(label_cols, held)]
        + [f"the model's output(s) {', '.join(str(s) for s in output_shapes)}"] * bool(
            output_shapes))
    return TrainingInputError(
        f"the loss fails on the labels of {', '.join(repr(c) for c in label_cols)} in a "
        f"{split} batch at epoch {epoch + 1}, step {step + 1} (rank {rank})"
        + (f" ({evidence})" if evidence else "") + f": {type(exc).__name__}: {exc}. Fix: the "
        f"label column must hold what the loss takes (class indices from 0 to the model's "
        f"number of outputs - 1 for a cross-entropy): re-index it (e.g. "
        f"pyspark.ml.feature.StringIndexer) or filter out the other rows")


class LossWatch:
    """``terminate_on_nan``: a non-finite training loss stops this rank with an error naming
    the epoch and step, without a device sync per step.

    On the CPU each step's loss is looked at as it comes.  On a GPU the losses go into a
    device buffer of :data:`CHECK_EVERY` slots (an in-place copy: no allocation, no sync),
    which is looked at once it is full and at the end of the epoch (``flush``); the first
    bad slot gives the step.
    """

    CHECK_EVERY = 64

    def __init__(self, enabled: bool, rank: int, epochs: int, steps: int,
                 buffered: Optional[bool] = None) -> None:
        self.enabled, self.rank, self.epochs, self.steps = enabled, rank, epochs, steps
        self.buffered = buffered  # None: buffer on any device but the CPU
        self.buffer: Any = None
        self.slots: List[Tuple[int, int]] = []  # (epoch, step) of each filled slot

    def step(self, loss: Any, epoch: int, step: int) -> None:
        """The loss (a scalar tensor) of ``step`` (0-based) of ``epoch``."""
        if not self.enabled:
            return
        if not (self.buffered if self.buffered is not None else loss.device.type != "cpu"):
            value = float(loss.detach())
            if not np.isfinite(value):
                raise nonfinite_loss_error(value, epoch, self.epochs, step + 1, self.steps,
                                           self.rank)
            return
        import torch
        if self.buffer is None:
            self.buffer = torch.zeros(self.CHECK_EVERY, dtype=torch.float32,
                                      device=loss.device)
        self.buffer[len(self.slots)].copy_(loss.detach().reshape(()))
        self.slots.append((epoch, step))
        if len(self.slots) == self.CHECK_EVERY:
            self.flush()

    def flush(self) -> None:
        """Look at the losses not looked at yet (one device sync)."""
        if not self.slots:
            return
        import torch
        slots, self.slots = self.slots, []
        seen = self.buffer[:len(slots)]
        bad = (~torch.isfinite(seen)).nonzero()
        if len(bad):
            slot = int(bad[0, 0])
            epoch, step = slots[slot]
            raise nonfinite_loss_error(float(seen[slot]), epoch, self.epochs, step + 1,
                                       self.steps, self.rank)

    def check_weights(self, named_parameters: Iterable[Tuple[str, Any]], epoch: int) -> None:
        """At the end of ``epoch``, before its checkpoint: an error naming the parameters
        that are NaN or infinite though every step's loss was finite.  A finite loss can
        have an infinite gradient (``sqrt`` at 0): the optimizer's step then makes the
        weights NaN, which the next step's loss shows, but after the epoch's last step
        nothing would, and the checkpoint and the returned model would hold them.  One
        device sync per epoch."""
        if not self.enabled:
            return
        import torch
        params = [(n, p.detach()) for n, p in named_parameters if p.is_floating_point()]
        if not params:
            return
        finite = torch.stack([torch.isfinite(p).all() for _, p in params])
        if bool(finite.all()):
            return
        names = [n for (n, _), ok in zip(params, finite.tolist()) if not ok]
        raise nonfinite_weights_error(names, epoch, self.epochs, self.steps, self.steps,
                                      (epoch, 0), self.rank)


def announce_start(config: TrainConfig, rank: int, start_epoch: int, started: float,
                   steps: int) -> None:
    """Rank 0's lines before the first epoch: resuming, and (verbose >= 2) the set-up time."""
    if rank != 0:
        return
    if config.verbose and start_epoch:
        print(f"resuming run '{config.run_id}' at epoch {start_epoch + 1}/{config.epochs} "
              f"(checkpoint of epoch {start_epoch})", flush=True)
    if config.verbose >= 2:
        print(f"rank 0 ready to train in {time.perf_counter() - started:.1f}s (init, model, "
              f"readers: {steps} steps per epoch)", flush=True)


class RunRecord:
    """The run's history and best epoch, carried from checkpoint to checkpoint.

    The monitored value is ``val_loss`` when the epoch has one, else ``loss``.
    """

    KEYS = ("epoch", "history", "best", "best_epoch")

    def __init__(self, state: Optional[Mapping[str, Any]] = None) -> None:
        state = state or {}
        self.epoch = int(state.get("epoch", 0))
        self.history: Dict[str, List[float]] = {
            k: list(v) for k, v in (state.get("history") or {}).items()}
        self.best = state.get("best")
        self.best_epoch = state.get("best_epoch")
        self.monitor = state.get("monitor", "loss")

    def add_epoch(self, epoch: int, logs: Mapping[str, float]) -> bool:
        """Record epoch ``epoch`` (0-based); True when its monitored value is the best yet."""
        for k, v in logs.items():
            self.history.setdefault(k, []).append(v)
        self.epoch = epoch + 1
        self.monitor = "val_loss" if "val_loss" in logs else "loss"
        improved = self.best is None or logs[self.monitor] < self.best
        if improved:
            self.best, self.best_epoch = logs[self.monitor], epoch + 1
        return improved

    def state(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "history": self.history, "best": self.best,
                "best_epoch": self.best_epoch, "monitor": self.monitor}


def apply_transformation(fn: Any, batch: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """``transformation_fn`` on a batch, as Horovod calls it: a pandas DataFrame in (an array
    column holds one numpy array per row) and a DataFrame out, turned back into arrays."""
    import pandas as pd

    frame = pd.DataFrame({k: list(v) if v.ndim > 1 else v for k, v in batch.items()})
    out = fn(frame)
    if not isinstance(out, pd.DataFrame):
        raise TypeError(f"transformation_fn must return a pandas DataFrame (as Horovod's), "
                        f"got {type(out).__name__}")
    arrays = {}
    for col in out.columns:
        values = out[col].to_numpy()
        arrays[col] = np.stack([np.asarray(v) for v in values]) \
            if values.dtype == object and len(values) else values
    return arrays


class CachedReader:
    """``inmemory_cache_all``: the first epoch reads through ``reader`` and keeps this rank's
    rows; later epochs re-cut them into the same batch sizes from memory, in a new order
    each epoch when ``shuffle`` (seeded by ``seed`` and the epoch, as the reader's own)."""

    def __init__(self, reader: Any, shuffle: bool, seed: int) -> None:
        self.reader, self.shuffle, self.seed = reader, shuffle, seed
        self.rows: Optional[Dict[str, np.ndarray]] = None
        self.sizes: List[int] = []

    def __len__(self) -> int:
        return len(self.reader)

    def epoch(self, epoch: int) -> Iterator[Dict[str, np.ndarray]]:
        if self.rows is None:
            return self._first(epoch)
        return self._again(epoch)

    def _first(self, epoch: int) -> Iterator[Dict[str, np.ndarray]]:
        kept: List[Dict[str, np.ndarray]] = []
        for batch in self.reader.epoch(epoch):
            kept.append({k: np.array(v, copy=True) for k, v in batch.items()})
            yield batch
        if kept:  # a whole pass was read: from now on, from memory
            self.sizes = [len(next(iter(b.values()))) for b in kept]
            self.rows = {k: np.concatenate([b[k] for b in kept]) for k in kept[0]}

    def _again(self, epoch: int) -> Iterator[Dict[str, np.ndarray]]:
        total = sum(self.sizes)
        order = np.random.default_rng([self.seed, epoch]).permutation(total) \
            if self.shuffle else np.arange(total)
        start = 0
        for n in self.sizes:
            idx = order[start:start + n]
            start += n
            yield {k: v[idx] for k, v in self.rows.items()}

    def close(self) -> None:
        self.reader.close()


class Readers:
    """This rank's training and validation readers and their steps per epoch (equal on every
    rank), trimmed to a multiple of ``backward_passes_per_step``."""

    def __init__(self, config: TrainConfig, rank: int, size: int) -> None:
        self.c, self.rank = config, rank
        columns = list(config.feature_cols) + list(config.label_cols)
        if config.sample_weight_col:
            columns.append(config.sample_weight_col)
        common = dict(rank=rank, size=size, columns=columns, reader=config.reader)
        extra = config.extra or {}

        def workers(which: str) -> Dict[str, Any]:  # Horovod's reader knobs: petastorm's
            n = extra.get(f"{which}_reader_num_workers")
            return {"workers_count": n} if n and config.reader == "petastorm" else {}

        self.train = config.meta.make_reader(
            "train", batch_size=config.batch_size, shuffle=config.shuffle, seed=config.seed,
            shuffle_buffer_rows=config.shuffle_buffer_size, **common, **workers("train"))
        if extra.get("inmemory_cache_all"):
            self.train = CachedReader(self.train, config.shuffle, config.seed)
        self.val = (config.meta.make_reader("val", batch_size=config.val_batch_size,
                                            shuffle=False, seed=config.seed, **common,
                                            **workers("val"))
                    if config.meta.val_path else None)
        self.train_steps = self._steps(self.train, config.train_steps_per_epoch,
                                       "train_steps_per_epoch")
        passes = config.backward_passes_per_step
        usable = self.train_steps - self.train_steps % passes
        if usable == 0:
            raise ValueError(
                f"backward_passes_per_step={passes} is more than the {self.train_steps} "
                f"training step(s) per epoch; use a smaller backward_passes_per_step or "
                f"batch_size")
        if usable != self.train_steps and rank == 0 and config.verbose:
            print(f"training {usable} of {self.train_steps} steps per epoch: a multiple of "
                  f"backward_passes_per_step={passes}", flush=True)
        self.train_steps = usable
        self.val_steps = (self._steps(self.val, config.validation_steps_per_epoch,
                                      "validation_steps_per_epoch")
                          if self.val is not None else 0)

    def _steps(self, reader: Any, wanted: Optional[int], what: str) -> int:
        try:
            available = len(reader)
        except TypeError:  # a reader without len(): the user says how many steps
            if wanted is None:
                raise ValueError(f"reader={self.c.reader!r} cannot tell the steps per epoch "
                                 f"(ranks may get different row counts): set {what}") from None
            return wanted
        if wanted is None or wanted >= available:
            if wanted is not None and wanted > available and self.rank == 0 and self.c.verbose:
                print(f"{what}={wanted} is more than the {available} batches each process has "
                      f"per epoch; using {available}", flush=True)
            return available
        return wanted

    def close(self) -> None:
        self.train.close()
        if self.val is not None:
            self.val.close()
