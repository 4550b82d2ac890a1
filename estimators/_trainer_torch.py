"""What each rank runs for TorchEstimator.fit (through spark_hvd.spark.run), and the tensor
conventions shared with the driver's dry run and TorchModel.transform.

One rank, in order:

1. ``hvd.init()``; pick the device (the GPU of this local rank when training on GPUs); limit
   torch's threads to this process's share of the host's cores.
2. Unpickle the user's objects (model, optimizer or its factory, losses, metrics, callbacks,
   ...); seed torch identically everywhere.
3. Rank 0 loads ``<run>/checkpoint/last.pt`` when it exists (resume); then parameters,
   optimizer state and the resume point (epoch, history, best value) are broadcast from
   rank 0, so every rank starts from the same state whether resuming or not.
4. Wrap the optimizer in ``hvd.DistributedOptimizer``; build the train/validation readers
   on this rank's shard (equal steps on every rank, see spark_hvd.data).
5. Each epoch: train ``steps`` batches (``backward_passes_per_step`` backward passes per
   optimizer step, the loss divided by that count so accumulated gradients are a mean),
   validate, allreduce the sums of loss/metrics and row counts (so the epoch's numbers are
   averages over every row of every rank), call the callbacks, and on rank 0 print the
   epoch line and write ``last.pt`` (and ``best.pt`` when the monitored loss improved)
   atomically to the Store, plus ``<run>/logs/history.json``.
6. Return a small summary; the model itself goes back through the Store.
"""

from __future__ import annotations

import copy
import io
import json
import os
import posixpath
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

CHECKPOINT_FORMAT = 1
LAST_CHECKPOINT = "last.pt"
BEST_CHECKPOINT = "best.pt"
HISTORY_FILE = "history.json"


# -- tensor conventions (driver dry run, ranks, transform) ---------------------------------------

def model_float_dtype(model: Any) -> Any:
    """The dtype floating-point inputs are cast to: the model's first floating parameter's."""
    import torch
    for p in list(model.parameters()) + list(model.buffers()):
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def reshape_to(t: Any, shape: Optional[Sequence[int]]) -> Any:
    """``[-1, 1, 8, 8]`` is a full shape (batch first); ``[1, 8, 8]`` a per-row shape."""
    if shape is None:
        return t
    shape = list(shape)
    return t.reshape(shape) if shape and shape[0] == -1 else t.reshape([-1] + shape)


def to_tensor(arr: np.ndarray, name: str, float_dtype: Any, shape: Optional[Sequence[int]] = None,
              device: Any = None) -> Any:
    """One numpy column as the model sees it: floats cast to the model's dtype, integers to
    int64, reshaped by ``shape``, on ``device``."""
    import torch
    from spark_hvd.data.torch import array_to_tensor
    t = array_to_tensor(name, arr)
    if t.is_floating_point():
        t = t.to(float_dtype)
    elif t.dtype != torch.bool:
        t = t.to(torch.int64)
    t = reshape_to(t, shape)
    return t.to(device, non_blocking=True) if device is not None else t


def as_outputs(out: Any) -> List[Any]:
    """A model's return value as a list of tensors."""
    if isinstance(out, (list, tuple)):
        return list(out)
    if isinstance(out, dict):
        return list(out.values())
    return [out]


def align_labels(outputs: Sequence[Any], labels: Sequence[Any], shapes_given: bool) -> List[Any]:
    """Without ``label_shapes``, a floating-point label with as many elements as its output
    takes the output's shape (``(B,)`` labels against ``(B, 1)`` outputs)."""
    if shapes_given:
        return list(labels)
    out = []
    for o, y in zip(outputs, labels):
        if y.is_floating_point() and y.shape != o.shape and y.numel() == o.numel():
            y = y.reshape(o.shape)
        out.append(y)
    return out + list(labels[len(out):])


def metric_names(metrics: Any) -> List[Tuple[str, Callable]]:
    """``[(name, fn)]`` from a callable, a list or a dict of metric functions."""
    if metrics is None:
        return []
    if isinstance(metrics, dict):
        return list(metrics.items())
    if callable(metrics):
        metrics = [metrics]
    out, seen = [], set()
    for i, fn in enumerate(metrics):
        name = getattr(fn, "__name__", None) or type(fn).__name__
        if name == "<lambda>" or not name.isidentifier():
            name = f"metric_{i}"
        while name in seen:
            name += "_"
        seen.add(name)
        out.append((name, fn))
    return out


def unreduced(loss_fn: Callable) -> Callable:
    """``loss_fn`` giving one value per row: an ``nn.Module`` with ``reduction`` is copied with
    ``reduction='none'``; a function is called with ``reduction='none'``."""
    if hasattr(loss_fn, "reduction") and hasattr(loss_fn, "forward"):
        per_row = copy.copy(loss_fn)
        per_row.reduction = "none"
        return per_row

    def call(output: Any, label: Any) -> Any:
        return loss_fn(output, label, reduction="none")
    return call


@dataclass
class LossSpec:
    """How a batch's loss is computed from the outputs and labels."""

    fns: List[Callable]
    weights: List[float]
    per_row: Optional[List[Callable]] = None

    @classmethod
    def build(cls, loss: Any, n_labels: int, loss_weights: Optional[Sequence[float]],
              weighted_rows: bool) -> "LossSpec":
        fns = list(loss) if isinstance(loss, (list, tuple)) else [loss]
        if len(fns) == 1 and n_labels > 1:
            fns = fns * n_labels
        weights = list(loss_weights) if loss_weights else [1.0] * len(fns)
        return cls(fns, weights, [unreduced(f) for f in fns] if weighted_rows else None)

    def __call__(self, outputs: List[Any], labels: List[Any], sample_weight: Any = None) -> Any:
        total = None
        for i, (out, label) in enumerate(zip(outputs, labels)):
            if sample_weight is None:
                value = self.fns[i](out, label)
            else:
                rows = self.per_row[i](out, label)
                rows = rows.reshape(rows.shape[0], -1).mean(dim=1) if rows.dim() > 1 else rows
                w = sample_weight.to(rows.dtype)
                value = (rows * w).sum() / w.sum().clamp_min(1e-12)
            value = value * self.weights[i] if self.weights[i] != 1.0 else value
            total = value if total is None else total + value
        return total


# -- the rank's job ------------------------------------------------------------------------------

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


def read_checkpoint(store: Any, run_id: str, which: str = LAST_CHECKPOINT,
                    map_location: Any = "cpu") -> Optional[Dict[str, Any]]:
    """The checkpoint ``which`` of ``run_id`` (a dict), or None when there is none."""
    import torch
    path = posixpath.join(checkpoint_dir(store, run_id), which)
    if not store.exists(path):
        return None
    state = torch.load(io.BytesIO(store.read_bytes(path)), map_location=map_location,
                       weights_only=False)
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a spark_hvd TorchEstimator checkpoint")
    return state


def _write_checkpoint(store: Any, run_id: str, which: str, state: Dict[str, Any]) -> None:
    import torch
    buf = io.BytesIO()
    torch.save(state, buf)
    store.write_bytes_atomic(posixpath.join(checkpoint_dir(store, run_id), which),
                             buf.getvalue())


def _pick_device(use_gpu: Optional[bool], hvd: Any) -> Any:
    import torch
    has_cuda = torch.cuda.is_available()
    if use_gpu is False or (use_gpu is None and not (has_cuda and hvd.nccl_built())):
        return torch.device("cpu")
    if not has_cuda:
        raise RuntimeError("use_gpu=True but torch sees no CUDA device on this executor; "
                           "use use_gpu=None or False, or give the executors GPUs "
                           "(spark.executor.resource.gpu.amount)")
    if not hvd.nccl_built():
        raise RuntimeError("use_gpu=True but this spark_hvd build has no NCCL, so gradients "
                           "on the GPU cannot be allreduced; use use_gpu=False")
    count = torch.cuda.device_count()
    device = torch.device("cuda", hvd.local_rank() % count if count > 1 else 0)
    torch.cuda.set_device(device)
    return device


def _limit_threads(hvd: Any) -> None:
    import torch
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cpus or 1) // max(1, hvd.local_size())))


class _Callbacks:
    def __init__(self, callbacks: Optional[Sequence[Any]]) -> None:
        self.items = list(callbacks or [])
        self.wants_batches = any(hasattr(c, "on_batch_end") for c in self.items)

    def call(self, method: str, *args: Any) -> None:
        for c in self.items:
            fn = getattr(c, method, None)
            if fn is not None:
                fn(*args)


def _optimizer_for(model: Any, optimizer: Any) -> Any:
    import torch
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    return optimizer(model.parameters())


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


def train(config: TrainConfig) -> Dict[str, Any]:
    """Train on this rank (see the module docstring); returns a small summary."""
    started = time.perf_counter()
    import torch

    import spark_hvd.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    _limit_threads(hvd)
    device = _pick_device(config.use_gpu, hvd)
    torch.manual_seed(config.seed)
    np.random.seed(config.seed % (2 ** 32))

    objs = load_objects(config.objects)
    model = objs["model"].to(device)
    optimizer = _optimizer_for(model, objs["optimizer"])
    loss = ([c() for c in objs["loss_constructors"]] if objs.get("loss_constructors")
            else objs["loss"])
    loss_spec = LossSpec.build(loss, len(config.label_cols), config.loss_weights,
                               config.sample_weight_col is not None)
    metrics = metric_names(objs.get("metrics"))
    callbacks = _Callbacks(objs.get("callbacks"))
    transformation_fn = objs.get("transformation_fn")

    # Resume: rank 0 reads the checkpoint, everything is broadcast from rank 0.
    resume = {"epoch": 0, "history": {}, "best": None, "best_epoch": None}
    if rank == 0:
        state = read_checkpoint(config.store, config.run_id, map_location=device)
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            resume = {k: state[k] for k in resume}
            resume["scheduler"] = state.get("scheduler")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    resume = hvd.broadcast_object(resume, root_rank=0, name="estimator.resume")

    compression = objs.get("gradient_compression") or hvd.Compression.none
    passes = config.backward_passes_per_step
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         backward_passes_per_step=passes)
    # After wrapping: a scheduler patches its optimizer's step() to count calls, and that
    # must be the distributed step.
    scheduler = objs["lr_scheduler_fn"](optimizer) if objs.get("lr_scheduler_fn") else None
    if scheduler is not None and resume.get("scheduler"):
        scheduler.load_state_dict(resume["scheduler"])

    runner = _EpochRunner(config, model, optimizer, loss_spec, metrics, callbacks,
                          transformation_fn, device, rank, size, hvd)
    history: Dict[str, List[float]] = {k: list(v) for k, v in resume["history"].items()}
    best, best_epoch = resume["best"], resume["best_epoch"]
    start = int(resume["epoch"])
    if rank == 0 and config.verbose and start:
        print(f"resuming run '{config.run_id}' at epoch {start + 1}/{config.epochs} "
              f"(checkpoint of epoch {start})", flush=True)
    if rank == 0 and config.verbose >= 2:
        print(f"rank 0 ready to train in {time.perf_counter() - started:.1f}s (init, model, "
              f"readers: {runner.train_steps} steps per epoch)", flush=True)
    callbacks.call("on_train_begin", {"rank": rank, "size": size, "start_epoch": start})
    epoch = start
    try:
        for epoch in range(start, config.epochs):
            logs = runner.run_epoch(epoch)
            for k, v in logs.items():
                history.setdefault(k, []).append(v)
            monitor = "val_loss" if "val_loss" in logs else "loss"
            improved = best is None or logs[monitor] < best
            if improved:
                best, best_epoch = logs[monitor], epoch + 1
            if scheduler is not None:
                scheduler.step()
            if rank == 0:
                state = {"format": CHECKPOINT_FORMAT, "epoch": epoch + 1,
                         "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                         "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict() if scheduler is not None else None,
                         "history": history, "best": best, "best_epoch": best_epoch,
                         "monitor": monitor, "run_id": config.run_id}
                _write_checkpoint(config.store, config.run_id, LAST_CHECKPOINT, state)
                if improved:
                    _write_checkpoint(config.store, config.run_id, BEST_CHECKPOINT, state)
                config.store.write_bytes_atomic(
                    posixpath.join(config.store.get_logs_path(config.run_id), HISTORY_FILE),
                    json.dumps({"epochs": epoch + 1, "history": history}, indent=1).encode())
            cb_logs = dict(logs, rank=rank, stop_training=False)
            callbacks.call("on_epoch_end", epoch, cb_logs)
            stop = hvd.allreduce(torch.tensor([1.0 if cb_logs.get("stop_training") else 0.0]),
                                 op=hvd.Max, name="estimator.stop_training")
            if stop.item() > 0:
                if rank == 0 and config.verbose:
                    print(f"a callback stopped training after epoch {epoch + 1}", flush=True)
                epoch += 1
                break
        else:
            epoch = config.epochs
    finally:
        runner.close()
    callbacks.call("on_train_end", {"rank": rank, "history": history})
    return {"rank": rank, "epochs": epoch, "start_epoch": start} if rank == 0 else {"rank": rank}


def _next(batches: Iterator[Any], step: int, steps: int, split: str) -> Any:
    try:
        return next(batches)
    except StopIteration:
        raise ValueError(f"the {split} reader ended after {step} of {steps} batches on this "
                         f"process; lower train_steps_per_epoch/validation_steps_per_epoch") \
            from None


class _EpochRunner:
    """Runs training and validation epochs on one rank."""

    def __init__(self, config: TrainConfig, model: Any, optimizer: Any, loss_spec: LossSpec,
                 metrics: List[Tuple[str, Callable]], callbacks: _Callbacks,
                 transformation_fn: Optional[Callable], device: Any, rank: int, size: int,
                 hvd: Any) -> None:
        self.c, self.model, self.optimizer, self.loss_spec = config, model, optimizer, loss_spec
        self.metrics, self.callbacks, self.transformation_fn = metrics, callbacks, \
            transformation_fn
        self.device, self.rank, self.size, self.hvd = device, rank, size, hvd
        self.float_dtype = model_float_dtype(model)
        columns = list(config.feature_cols) + list(config.label_cols)
        if config.sample_weight_col:
            columns.append(config.sample_weight_col)
        common = dict(rank=rank, size=size, columns=columns, reader=config.reader)
        self.train_reader = config.meta.make_reader(
            "train", batch_size=config.batch_size, shuffle=config.shuffle, seed=config.seed,
            shuffle_buffer_rows=config.shuffle_buffer_size, **common)
        self.val_reader = (config.meta.make_reader("val", batch_size=config.val_batch_size,
                                                   shuffle=False, seed=config.seed, **common)
                           if config.meta.val_path else None)
        self.train_steps = self._steps(self.train_reader, config.train_steps_per_epoch,
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
        self.val_steps = (self._steps(self.val_reader, config.validation_steps_per_epoch,
                                      "validation_steps_per_epoch")
                          if self.val_reader is not None else 0)

    def _steps(self, reader: Any, wanted: Optional[int], what: str) -> int:
        try:
            available = len(reader)
        except TypeError:  # petastorm: no equal-steps guarantee, the user says how many
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

    def _align(self, outputs: List[Any], labels: List[Any]) -> List[Any]:
        return align_labels(outputs, labels, self.c.label_shapes is not None)

    def _tensors(self, batch: Mapping[str, np.ndarray]) -> Tuple[List[Any], List[Any], Any]:
        c = self.c
        if self.transformation_fn is not None:
            batch = self.transformation_fn(dict(batch))
        inputs = [to_tensor(batch[n], n, self.float_dtype,
                            c.input_shapes[i] if c.input_shapes else None, self.device)
                  for i, n in enumerate(c.feature_cols)]
        labels = [to_tensor(batch[n], n, self.float_dtype,
                            c.label_shapes[i] if c.label_shapes else None, self.device)
                  for i, n in enumerate(c.label_cols)]
        weight = (to_tensor(batch[c.sample_weight_col], c.sample_weight_col, self.float_dtype,
                            None, self.device) if c.sample_weight_col else None)
        return inputs, labels, weight

    def _measure(self, outputs: List[Any], labels: List[Any], loss: Any, rows: int,
                 sums: Dict[str, Any]) -> None:
        import torch
        sums["loss"] = sums.get("loss", 0.0) + loss.detach().double() * rows
        for name, fn in self.metrics:
            if len(self.c.label_cols) > 1:
                pairs = [(f"{name}__{col}", o, y)
                         for col, o, y in zip(self.c.label_cols, outputs, labels)]
            else:
                pairs = [(name, outputs[0], labels[0] if labels else None)]
            for key, o, y in pairs:
                value = fn(o.detach(), y)
                value = value.detach().double() if torch.is_tensor(value) else float(value)
                sums[key] = sums.get(key, 0.0) + value * rows

    def run_epoch(self, epoch: int) -> Dict[str, float]:
        import torch
        from .progress import EpochProgress

        c, model, optimizer = self.c, self.model, self.optimizer
        passes = c.backward_passes_per_step
        progress = EpochProgress(epoch, c.epochs, self.train_steps,
                                 c.verbose if self.rank == 0 else 0)
        self.callbacks.call("on_epoch_begin", epoch, {"rank": self.rank})
        model.train()
        sums: Dict[str, Any] = {}
        rows_seen = 0
        batches = self.train_reader.epoch(epoch)
        try:
            for step in range(self.train_steps):
                batch = _next(batches, step, self.train_steps, "train")
                if step % passes == 0:
                    optimizer.zero_grad()
                inputs, labels, weight = self._tensors(batch)
                rows = int(inputs[0].shape[0]) if inputs else 0
                if rows:
                    outputs = as_outputs(model(*inputs))
                    labels = self._align(outputs, labels)
                    loss = self.loss_spec(outputs, labels, weight)
                    if c.terminate_on_nan and not torch.isfinite(loss).all():
                        raise FloatingPointError(
                            f"rank {self.rank}: the training loss is {loss.item()} at epoch "
                            f"{epoch + 1} step {step + 1} (terminate_on_nan=True); lower the "
                            f"learning rate or check the data for NaN/inf")
                    (loss / passes if passes > 1 else loss).backward()
                    self._measure(outputs, labels, loss, rows, sums)
                    rows_seen += rows
                if (step + 1) % passes == 0:
                    optimizer.step()
                if self.callbacks.wants_batches:
                    self.callbacks.call("on_batch_end", step,
                                        {"rank": self.rank, "loss": float(loss.item())
                                         if rows else float("nan")})
                progress.update(step + 1, lambda: float(sums["loss"]) / max(rows_seen, 1)
                                if rows_seen else float("nan"))
        finally:
            batches.close()
        val_sums: Dict[str, Any] = {}
        val_rows = 0
        if self.val_reader is not None:
            model.eval()
            batches = self.val_reader.epoch(epoch)
            try:
                with torch.no_grad():
                    for step in range(self.val_steps):
                        inputs, labels, weight = self._tensors(
                            _next(batches, step, self.val_steps, "val"))
                        rows = int(inputs[0].shape[0]) if inputs else 0
                        if not rows:
                            continue
                        outputs = as_outputs(model(*inputs))
                        labels = self._align(outputs, labels)
                        self._measure(outputs, labels, self.loss_spec(outputs, labels, weight),
                                      rows, val_sums)
                        val_rows += rows
            finally:
                batches.close()
        logs = self._average(sums, rows_seen, val_sums, val_rows)
        progress.finish(logs)
        return logs

    def _average(self, sums: Dict[str, Any], rows: int, val_sums: Dict[str, Any],
                 val_rows: int) -> Dict[str, float]:
        """Sums over every rank, divided by the rows of every rank."""
        import torch
        names = ["loss"] + self._metric_keys()
        val_names = names if self.val_reader is not None else []
        values = [float(sums.get(n, 0.0)) for n in names] + [float(rows)]
        values += [float(val_sums.get(n, 0.0)) for n in val_names] + [float(val_rows)]
        total = self.hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=self.hvd.Sum,
                                   name="estimator.epoch_metrics").tolist()
        train_rows = total[len(names)]
        logs = {n: total[i] / max(train_rows, 1) for i, n in enumerate(names)}
        if val_names:
            off = len(names) + 1
            v_rows = total[off + len(val_names)]
            logs.update({"val_" + n: total[off + i] / max(v_rows, 1)
                         for i, n in enumerate(val_names)})
        return logs

    def _metric_keys(self) -> List[str]:
        keys = []
        for name, _ in self.metrics:
            if len(self.c.label_cols) > 1:
                keys += [f"{name}__{col}" for col in self.c.label_cols]
            else:
                keys.append(name)
        return keys

    def close(self) -> None:
        self.train_reader.close()
        if self.val_reader is not None:
            self.val_reader.close()


