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
   on this rank's shard (equal steps on every rank, see spark_hvd.data). With
   ``torch_compile`` the training forward passes go through ``torch.compile(model)`` (the
   same parameters, so the optimizer's hooks and the checkpoints are the model's own).
5. Each epoch: train ``steps`` batches (``backward_passes_per_step`` backward passes per
   optimizer step, the loss divided by that count so accumulated gradients are a mean;
   with ``mixed_precision`` forward passes and losses under ``torch.autocast``, and for
   'fp16' a GradScaler in Horovod's order: synchronize, unscale_, step under
   skip_synchronize, update; with
   ``terminate_on_nan`` a NaN or infinite loss stops the rank at its step, and non-finite
   weights at the epoch's end, before its checkpoint),
   validate, allreduce the sums of loss/metrics and row counts (so the epoch's numbers are
   averages over every row of every rank), call the callbacks, and on rank 0 print the
   epoch line and write ``last.pt`` (and ``best.pt`` when the monitored loss improved:
   model, optimizer, scheduler and fp16 loss scale) atomically to the Store, plus
   ``<run>/logs/history.json`` and the epoch's TensorBoard event (``_tensorboard``).
6. Return a small summary; the model itself goes back through the Store.
"""

from __future__ import annotations

import contextlib
import copy
import io
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ._tensorboard import open_events
from ._trainer_common import (LossWatch, Readers, RunRecord, TrainConfig, announce_start,
                              apply_transformation, as_outputs, checkpoint_file, cpu_share,
                              label_error, load_objects, next_batch, reshape_to,
                              write_history)

CHECKPOINT_FORMAT = 1
LAST_CHECKPOINT = "last.pt"
BEST_CHECKPOINT = "best.pt"


# -- tensor conventions (driver dry run, ranks, transform) ---------------------------------------

def model_float_dtype(model: Any) -> Any:
    """The dtype floating-point inputs are cast to: the model's first floating parameter's."""
    import torch
    for p in list(model.parameters()) + list(model.buffers()):
        if p.is_floating_point():
            return p.dtype
    return torch.float32


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

def read_checkpoint(store: Any, run_id: str, which: str = LAST_CHECKPOINT,
                    map_location: Any = "cpu") -> Optional[Dict[str, Any]]:
    """The checkpoint ``which`` of ``run_id`` (a dict), or None when there is none."""
    import torch
    path = checkpoint_file(store, run_id, which)
    if not store.exists(path):
        return None
    state = torch.load(io.BytesIO(store.read_bytes(path)), map_location=map_location,
                       weights_only=False)
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a spark_hvd TorchEstimator checkpoint")
    return state


def _write_checkpoint(store: Any, run_id: str, which: Any, state: Dict[str, Any]) -> None:
    """``state`` serialized once and written atomically as each checkpoint of ``which``
    (a name, or several: ``last.pt`` and ``best.pt`` hold the same bytes)."""
    import torch
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    for name in ([which] if isinstance(which, str) else which):
        store.write_bytes_atomic(checkpoint_file(store, run_id, name), data)


def _pick_device(use_gpu: Optional[bool], hvd: Any) -> Any:
    """The GPU of this local rank when training on GPUs (use_gpu=True, or None where torch
    sees one and spark_hvd can allreduce on it: NCCL, or staged through host memory when
    only the CUDA runtime loads), else the CPU."""
    import torch
    has_cuda = torch.cuda.is_available()
    gpu_collectives = has_cuda and (hvd.nccl_built() or hvd.cuda_built())
    if use_gpu is False or (use_gpu is None and not gpu_collectives):
        return torch.device("cpu")
    if not has_cuda:
        raise RuntimeError("use_gpu=True but torch sees no CUDA device on this executor; "
                           "use use_gpu=None or False, or give the executors GPUs "
                           "(spark.executor.resource.gpu.amount)")
    if not gpu_collectives:
        from spark_hvd import _core
        raise RuntimeError("use_gpu=True but spark_hvd cannot load the CUDA runtime or NCCL "
                           f"({_core.nccl_unavailable_reason()}), so gradients on the GPU "
                           "cannot be allreduced; set SPARK_HVD_NCCL_LIBRARY / "
                           "SPARK_HVD_CUDA_LIBRARY, or use use_gpu=False")
    count = torch.cuda.device_count()
    device = torch.device("cuda", hvd.local_rank() % count if count > 1 else 0)
    torch.cuda.set_device(device)
    return device


def _limit_threads(hvd: Any) -> None:
    import torch
    torch.set_num_threads(cpu_share(hvd.local_size()))


class _Precision:
    """``mixed_precision`` on one rank: the autocast of forward passes and losses, and for
    'fp16' the GradScaler's loss scale, applied in Horovod's order (the scaler unscales and
    checks the averaged gradients, so every rank skips or takes the same steps). The loss
    scale and its growth count are part of the checkpoint: a resumed fit goes on from the
    scale it had reached, as the same ranks do (``scaler``: rank 0's checkpointed state,
    broadcast with the rest of what resumes)."""

    DTYPES = {"bf16": "bfloat16", "fp16": "float16"}

    def __init__(self, mode: Optional[str], device: Any,
                 scaler: Optional[Dict[str, Any]] = None) -> None:
        import torch
        self.dtype = getattr(torch, self.DTYPES[mode]) if mode else None
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(device.type) if mode == "fp16" else None
        if self.scaler is not None and scaler:
            self.scaler.load_state_dict(scaler)

    def state_dict(self) -> Optional[Dict[str, Any]]:
        return None if self.scaler is None else self.scaler.state_dict()

    def autocast(self) -> Any:
        import torch
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: Any) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, optimizer: Any) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        optimizer.synchronize()
        self.scaler.unscale_(optimizer)
        with optimizer.skip_synchronize():
            self.scaler.step(optimizer)
        self.scaler.update()


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


def start_rank(config: TrainConfig) -> Tuple[Any, Any]:
    """``hvd.init()``, this process's share of the cores, its device, the same seeds on
    every rank; returns (spark_hvd.torch, the device)."""
    import torch

    import spark_hvd.torch as hvd

    hvd.init()
    _limit_threads(hvd)
    device = _pick_device(config.use_gpu, hvd)
    torch.manual_seed(config.seed)
    np.random.seed(config.seed % (2 ** 32))
    return hvd, device


def on_cpu(model: Any) -> Any:
    """``model``, or a CPU copy of it when any parameter is elsewhere (executors may have no
    such device)."""
    if any(t.device.type != "cpu" for t in model.parameters()):
        return copy.deepcopy(model).cpu()
    return model


def loaded_copy(model: Any, state_dict: Mapping[str, Any]) -> Any:
    """A CPU copy of ``model`` with ``state_dict`` loaded, in eval mode."""
    model = copy.deepcopy(model).cpu()
    model.load_state_dict(state_dict)
    model.eval()
    return model


def train(config: TrainConfig) -> Dict[str, Any]:
    """Train on this rank (see the module docstring); returns a small summary."""
    started = time.perf_counter()
    import torch

    hvd, device = start_rank(config)
    rank, size = hvd.rank(), hvd.size()

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
    resume: Dict[str, Any] = {}
    if rank == 0:
        state = read_checkpoint(config.store, config.run_id, map_location=device)
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            resume = {k: state[k] for k in RunRecord.KEYS}
            resume["scheduler"] = state.get("scheduler")
            resume["scaler"] = state.get("scaler")
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

    compile_args = objs.get("torch_compile")
    forward = model if compile_args is None else torch.compile(model, **compile_args)
    precision = _Precision(objs.get("mixed_precision"), device, resume.get("scaler"))
    runner = _EpochRunner(config, model, optimizer, loss_spec, metrics, callbacks,
                          transformation_fn, device, rank, size, hvd, forward, precision)
    record = RunRecord(resume)
    start = record.epoch
    announce_start(config, rank, start, started, runner.train_steps)
    events = open_events(config.store, config.run_id, config.verbose) if rank == 0 else None
    callbacks.call("on_train_begin", {"rank": rank, "size": size, "start_epoch": start})
    epoch = start
    ready = time.perf_counter()
    saving = 0.0  # seconds rank 0 spent writing checkpoints, history and events
    try:
        for epoch in range(start, config.epochs):
            logs = runner.run_epoch(epoch)
            improved = record.add_epoch(epoch, logs)
            if scheduler is not None:
                scheduler.step()
            if rank == 0:
                begin = time.perf_counter()
                state = dict(record.state(), format=CHECKPOINT_FORMAT, run_id=config.run_id,
                             model={k: v.detach().cpu() for k, v in model.state_dict().items()},
                             optimizer=optimizer.state_dict(),
                             scheduler=scheduler.state_dict() if scheduler is not None else None,
                             scaler=precision.state_dict())
                _write_checkpoint(config.store, config.run_id,
                                  [LAST_CHECKPOINT] + [BEST_CHECKPOINT] * improved, state)
                write_history(config.store, config.run_id, epoch + 1, record.history)
                if events is not None:
                    events.add_epoch(epoch, logs)
                saving += time.perf_counter() - begin
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
    callbacks.call("on_train_end", {"rank": rank, "history": record.history})
    if rank != 0:
        return {"rank": rank}
    trained = time.perf_counter() - ready
    return {"rank": rank, "epochs": epoch, "start_epoch": start,
            "seconds": {"training": trained - saving, "checkpoints": saving}}


class _EpochRunner:
    """Runs training and validation epochs on one rank."""

    def __init__(self, config: TrainConfig, model: Any, optimizer: Any, loss_spec: LossSpec,
                 metrics: List[Tuple[str, Callable]], callbacks: _Callbacks,
                 transformation_fn: Optional[Callable], device: Any, rank: int, size: int,
                 hvd: Any, forward: Any, precision: _Precision) -> None:
        self.c, self.model, self.optimizer, self.loss_spec = config, model, optimizer, loss_spec
        self.forward, self.precision = forward, precision  # forward: model, or compiled
        self.metrics, self.callbacks, self.transformation_fn = metrics, callbacks, \
            transformation_fn
        self.device, self.rank, self.size, self.hvd = device, rank, size, hvd
        self.float_dtype = model_float_dtype(model)
        self.readers = Readers(config, rank, size)
        self.train_reader, self.val_reader = self.readers.train, self.readers.val
        self.train_steps, self.val_steps = self.readers.train_steps, self.readers.val_steps
        self.watch = LossWatch(config.terminate_on_nan, rank, config.epochs, self.train_steps)

    def _loss(self, outputs: List[Any], labels: List[Any], weight: Any, epoch: int,
              step: int, split: str) -> Any:
        """The batch's loss; a loss that refuses the labels (a class index out of range) is
        an error naming the label columns and the values in the batch."""
        try:
            return self.loss_spec(outputs, labels, weight)
        except (IndexError, ValueError) as exc:
            raise label_error(exc, self.c.label_cols, [y.detach().cpu().numpy() for y in labels],
                              [tuple(o.shape) for o in outputs], epoch, step, split,
                              self.rank) from exc

    def _align(self, outputs: List[Any], labels: List[Any]) -> List[Any]:
        return align_labels(outputs, labels, self.c.label_shapes is not None)

    def _tensors(self, batch: Mapping[str, np.ndarray]) -> Tuple[List[Any], List[Any], Any]:
        c = self.c
        if self.transformation_fn is not None:
            batch = apply_transformation(self.transformation_fn, batch)
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
                batch = next_batch(batches, step, self.train_steps, "train")
                if step % passes == 0:
                    optimizer.zero_grad()
                inputs, labels, weight = self._tensors(batch)
                rows = int(inputs[0].shape[0]) if inputs else 0
                if rows:
                    with self.precision.autocast():
                        outputs = as_outputs(self.forward(*inputs))
                        labels = self._align(outputs, labels)
                        loss = self._loss(outputs, labels, weight, epoch, step, "training")
                    self.watch.step(loss, epoch, step)
                    self.precision.backward(loss / passes if passes > 1 else loss)
                    self._measure(outputs, labels, loss, rows, sums)
                    rows_seen += rows
                if (step + 1) % passes == 0:
                    self.precision.step(optimizer)
                if self.callbacks.wants_batches:
                    self.callbacks.call("on_batch_end", step,
                                        {"rank": self.rank, "loss": float(loss.item())
                                         if rows else float("nan")})
                progress.update(step + 1, lambda: float(sums["loss"]) / max(rows_seen, 1)
                                if rows_seen else float("nan"))
            self.watch.flush()
            self.watch.check_weights(model.named_parameters(), epoch)
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
                            next_batch(batches, step, self.val_steps, "val"))
                        rows = int(inputs[0].shape[0]) if inputs else 0
                        if not rows:
                            continue
                        with self.precision.autocast():
                            outputs = as_outputs(model(*inputs))
                            labels = self._align(outputs, labels)
                            val_loss = self._loss(outputs, labels, weight, epoch, step,
                                                  "validation")
                        self._measure(outputs, labels, val_loss, rows, val_sums)
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
        self.readers.close()


