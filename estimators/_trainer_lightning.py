"""What each rank runs for LightningEstimator.fit (through spark_hvd.spark.run).

One rank, in order:

1. ``hvd.init()``; the device (as TorchEstimator picks it); torch's threads limited to this
   process's share of the host's cores; torch seeded identically everywhere.
2. Unpickle the user's objects (the LightningModule, Lightning callbacks, trainer_args,
   ...). Unpickling imports the module's Lightning package, which the strategy then uses.
3. Rank 0 reads ``<run>/checkpoint/last.ckpt`` when the run has one (resume) and sends its
   bytes to every rank, which Lightning restores from (weights, optimizer and scheduler
   state, epoch and callback state).
4. The readers of this rank's shard (equal steps on every rank) become iterables of batches
   ``{column: tensor}`` (features reshaped by ``input_shapes``, labels by ``label_shapes``,
   floats in the model's dtype), read for the Trainer's current epoch.
5. ``Trainer(strategy=HorovodStrategy(...), max_epochs=epochs, ...).fit``: after each
   epoch (validation included) every rank writes the Lightning checkpoint and rank 0 puts it
   in the Store (atomically), with the epoch's logged metrics in ``<run>/logs/history.json``
   and the checkpoint's ``spark_hvd`` entry.
"""

from __future__ import annotations

import importlib
import io
import os
import shutil
import tempfile
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional

import numpy as np

from ._trainer_common import (LossWatch, Readers, TrainConfig, announce_start,
                              apply_transformation, checkpoint_file, load_objects, next_batch,
                              write_history)
from ._trainer_torch import model_float_dtype, start_rank, to_tensor

CHECKPOINT_FORMAT = 1
LAST_CHECKPOINT = "last.ckpt"
META_KEY = "spark_hvd"
# Trainer arguments the estimator sets itself: its own params say them.
RESERVED_TRAINER_ARGS = {
    "strategy": "spark_hvd's HorovodStrategy is the strategy",
    "accelerator": "use use_gpu",
    "devices": "one device per process (num_proc processes)",
    "num_nodes": "use num_proc",
    "max_epochs": "use epochs",
    "accumulate_grad_batches": "use backward_passes_per_step",
    "use_distributed_sampler": "each process reads its own shard of the data",
}


def read_checkpoint(store: Any, run_id: str) -> Optional[Dict[str, Any]]:
    """``run_id``'s last Lightning checkpoint (a dict), or None when there is none."""
    blob = read_checkpoint_bytes(store, run_id)
    return None if blob is None else _loaded(store, run_id, blob)


def read_checkpoint_bytes(store: Any, run_id: str) -> Optional[bytes]:
    path = checkpoint_file(store, run_id, LAST_CHECKPOINT)
    return store.read_bytes(path) if store.exists(path) else None


def _loaded(store: Any, run_id: str, blob: bytes) -> Dict[str, Any]:
    """The checkpoint ``blob`` of ``run_id``, checked to be one of ours."""
    import torch
    state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
    meta = state.get(META_KEY) if isinstance(state, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{checkpoint_file(store, run_id, LAST_CHECKPOINT)} is not a "
                         f"spark_hvd LightningEstimator checkpoint")
    return state


class _Batches:
    """One split of this rank's data as an iterable Lightning can loop over: ``steps``
    batches per pass, read for the Trainer's current epoch (the reader's shuffle seed)."""

    def __init__(self, reader: Any, steps: int, split: str, tensors: Any) -> None:
        self.reader, self.steps, self.split, self.tensors = reader, steps, split, tensors
        self.trainer: Any = None

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        batches = self.reader.epoch(epoch)
        try:
            for step in range(self.steps):
                yield self.tensors(next_batch(batches, step, self.steps, self.split))
        finally:
            batches.close()


def _batch_tensors(config: TrainConfig, float_dtype: Any, transformation_fn: Any):
    shapes = {}
    for cols, given in ((config.feature_cols, config.input_shapes),
                        (config.label_cols, config.label_shapes)):
        for i, c in enumerate(cols):
            shapes[c] = given[i] if given else None

    def tensors(batch: Mapping[str, np.ndarray]) -> Dict[str, Any]:
        if transformation_fn is not None:
            batch = apply_transformation(transformation_fn, batch)
        return {c: to_tensor(np.asarray(v), c, float_dtype, shapes.get(c)) for c, v in
                batch.items()}
    return tensors


def _scalars(metrics: Mapping[str, Any]) -> Dict[str, float]:
    out = {}
    for name, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):
            continue  # not a single number
        out[name] = number
    return out


def _callback_class(pl: Any) -> Any:
    class StoreCheckpoint(pl.Callback):
        """After every epoch: the Lightning checkpoint and the history into the Store."""

        def __init__(self, config: TrainConfig, history: Dict[str, List[float]],
                     local_dir: str, watch: LossWatch) -> None:
            self.c, self.history, self.local, self.watch = config, history, local_dir, watch
            self.saving = 0.0  # seconds rank 0 spent putting checkpoints into the Store

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            if loss is not None and hasattr(loss, "device"):
                self.watch.step(loss, trainer.current_epoch, batch_idx)

        def on_train_epoch_end(self, trainer, module) -> None:
            self.watch.flush()
            begin = time.perf_counter()
            self._save(trainer)
            self.saving += time.perf_counter() - begin

        def _save(self, trainer) -> None:
            epoch = trainer.current_epoch + 1
            logs = _scalars(trainer.callback_metrics)
            for name, value in logs.items():
                self.history.setdefault(name, []).append(value)
            path = os.path.join(self.local, LAST_CHECKPOINT)
            # every rank (a barrier); rank 0 writes
            trainer.save_checkpoint(path, weights_only=False)
            if trainer.global_rank != 0:
                return
            import torch
            state = torch.load(path, map_location="cpu", weights_only=False)
            state[META_KEY] = {"format": CHECKPOINT_FORMAT, "run_id": self.c.run_id,
                               "epoch": epoch, "history": self.history}
            buf = io.BytesIO()
            torch.save(state, buf)
            store, run_id = self.c.store, self.c.run_id
            store.write_bytes_atomic(checkpoint_file(store, run_id, LAST_CHECKPOINT),
                                     buf.getvalue())
            write_history(store, run_id, epoch, self.history)
            if self.c.verbose:
                from .progress import format_metrics
                print(f"epoch {epoch}/{self.c.epochs}  {format_metrics(logs)}", flush=True)

    return StoreCheckpoint


def train(config: TrainConfig) -> Dict[str, Any]:
    """Train on this rank (see the module docstring); returns a small summary."""
    started = time.perf_counter()
    hvd, device = start_rank(config)
    rank, size = hvd.rank(), hvd.size()

    objs = load_objects(config.objects)  # imports the module's Lightning package first
    from spark_hvd.torch.lightning import HorovodStrategy, lightning_package
    pl = importlib.import_module(lightning_package())
    module = objs["model"]

    # Rank 0 reads the checkpoint and its spark_hvd entry once; every rank gets both.
    blob, meta = None, None
    if rank == 0:
        blob = read_checkpoint_bytes(config.store, config.run_id)
        if blob is not None:
            meta = _loaded(config.store, config.run_id, blob)[META_KEY]
    blob, meta = hvd.broadcast_object((blob, meta), root_rank=0,
                                      name="estimator.lightning.resume")
    history: Dict[str, List[float]] = {}
    start = 0
    local_dir = tempfile.mkdtemp(prefix="shvd_lightning_")
    resume_path = None
    if blob is not None:
        resume_path = os.path.join(local_dir, "resume.ckpt")
        with open(resume_path, "wb") as f:
            f.write(blob)
        history = {k: list(v) for k, v in meta["history"].items()}
        start = int(meta["epoch"])

    readers = Readers(config, rank, size)
    tensors = _batch_tensors(config, model_float_dtype(module), objs.get("transformation_fn"))
    train_batches = _Batches(readers.train, readers.train_steps, "train", tensors)
    val_batches = (_Batches(readers.val, readers.val_steps, "val", tensors)
                   if readers.val is not None and readers.val_steps else None)
    announce_start(config, rank, start, started, readers.train_steps)

    store_checkpoint = _callback_class(pl)(
        config, history, local_dir,
        LossWatch(config.terminate_on_nan, rank, config.epochs, readers.train_steps))
    kwargs = dict(enable_progress_bar=False, enable_model_summary=False, logger=False,
                  enable_checkpointing=False, num_sanity_val_steps=0)
    kwargs.update(objs.get("trainer_args") or {})
    compression = objs.get("gradient_compression") or hvd.Compression.none
    trainer = pl.Trainer(
        strategy=HorovodStrategy(compression=compression),
        accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
        max_epochs=config.epochs, accumulate_grad_batches=config.backward_passes_per_step,
        use_distributed_sampler=False,
        callbacks=list(objs.get("callbacks") or []) + [store_checkpoint], **kwargs)
    train_batches.trainer = trainer
    if val_batches is not None:
        val_batches.trainer = trainer
    ready = time.perf_counter()
    try:
        trainer.fit(module, train_dataloaders=train_batches, val_dataloaders=val_batches,
                    ckpt_path=resume_path)
    finally:
        readers.close()
        shutil.rmtree(local_dir, ignore_errors=True)
    if rank != 0:
        return {"rank": rank}
    trained, saving = time.perf_counter() - ready, store_checkpoint.saving
    return {"rank": rank, "epochs": trainer.current_epoch, "start_epoch": start,
            "seconds": {"training": trained - saving, "checkpoints": saving}}
