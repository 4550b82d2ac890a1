"""TorchEstimator: a pyspark.ml Estimator that trains a torch model with spark_hvd.

``fit(df)``, in order (nothing is written to the Store before step 5):

1. Check the params (model, optimizer, loss, columns, shapes... consistent with each other).
2. Check the DataFrame's schema (``validate_dataframe``: columns exist, types usable) and
   that the cluster can run ``num_proc`` ranks at once (spark.run's own launch checks).
3. One small job: ``limit(num_proc)`` rows of the needed columns, which says whether the
   DataFrame is empty or too small and gives each column's per-row shape.
4. Dry run on the driver: the model on two zero rows of those shapes (``input_shapes``
   applied, ``transformation_fn`` too), the loss and metrics on its outputs and zero labels.
   A failure becomes an error naming the columns, the shapes and the fix.  When ``run_id``
   has a checkpoint, it is loaded into a copy of the model here (a checkpoint of another
   architecture is an error, not a crash on the workers).
5. ``prepare_data``: the columns as Parquet in the Store (reused when the plan is unchanged).
6. ``spark_hvd.spark.run(train, num_proc=...)``: see ``_trainer_torch``.  Rank 0 prints the
   progress (streamed to the driver as ``[0] ...``) and writes the checkpoints.
7. The trained weights come back through the Store (``<run>/checkpoint/last.pt``), are loaded
   into a copy of the model, and a TorchModel is returned.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable

from spark_hvd.exceptions import InvalidArgumentError

from . import _trainer_torch as trainer
from ._validate import validate_dataframe
from .params import ESTIMATOR_PARAMS, ParamsFromTable, declare_params
from .persistence import TableParamsReader, TableParamsWriter
from .torch_model import TorchModel, default_output_cols

logger = logging.getLogger(__name__)

_SPARK_NUMPY = {"double": np.float64, "float": np.float32, "decimal": np.float64,
                "bigint": np.int64, "int": np.int32, "smallint": np.int16, "tinyint": np.int8,
                "boolean": np.bool_}


class TorchEstimator(ParamsFromTable, Estimator, MLWritable, MLReadable):
    """Train a ``torch.nn.Module`` on a DataFrame with spark_hvd; ``fit`` returns a TorchModel.

    Example::

        est = TorchEstimator(num_proc=2, store=LocalStore("/tmp/runs"), model=net,
                             optimizer=torch.optim.Adam(net.parameters(), 1e-3),
                             loss=F.cross_entropy, metrics=[accuracy],
                             feature_cols=["features"], label_cols=["label"],
                             batch_size=64, epochs=5, validation=0.1)
        model = est.fit(train_df)
        model.transform(test_df)   # adds 'label__output'
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    # -- persistence -----------------------------------------------------------------------
    def write(self) -> TableParamsWriter:
        return TableParamsWriter(self)

    @classmethod
    def read(cls) -> TableParamsReader:
        return TableParamsReader(cls)

    # -- fit -------------------------------------------------------------------------------
    def _fit(self, dataset: Any) -> TorchModel:
        import torch

        p = self._values()
        phases = _Phases(p["verbose"])
        self._check_params(p)
        spark = dataset.sparkSession
        validate_dataframe(dataset, p["feature_cols"], p["label_cols"] or [],
                           p["sample_weight_col"], p["validation"], num_proc=1, check_rows=False)
        num_proc = _launch_plan(spark, p["num_proc"], p["use_gpu"])
        first = _first_rows(dataset, self._needed_columns(p), num_proc)
        zeros = _zero_batch(dataset, first, self._needed_columns(p))
        output_shapes = _dry_run(p, zeros)
        phases.done("checks and dry run")

        run_id = p["run_id"] or f"torch_{time.strftime('%Y%m%d_%H%M%S')}_{uuid.uuid4().hex[:6]}"
        seed = p["random_seed"] if p["random_seed"] is not None else _seed_of(run_id)
        store = p["store"]
        model_out = copy.deepcopy(p["model"]).cpu()
        previous = _compatible_checkpoint(store, run_id, model_out)
        epochs = p["epochs"]
        if previous is not None and previous["epoch"] >= epochs:
            if p["verbose"]:
                print(f"run '{run_id}' already trained {previous['epoch']} epoch(s) "
                      f"(epochs={epochs}): nothing to train, returning its checkpoint",
                      flush=True)
        else:
            from .materialize import prepare_data
            num_partitions = (num_proc * p["partitions_per_process"]
                              if p["partitions_per_process"] else None)
            meta = prepare_data(dataset, store, p["feature_cols"], p["label_cols"] or [],
                                p["sample_weight_col"], p["validation"], num_proc=num_proc,
                                seed=seed, num_partitions=num_partitions)
            phases.done("training data in the store")
            config = self._train_config(p, run_id, seed, meta)
            _run_training(config, num_proc, p["use_gpu"], p["verbose"])
            phases.done(f"training on {num_proc} processes")
        state = trainer.read_checkpoint(store, run_id)
        if state is None:
            raise InvalidArgumentError(  # pragma: no cover - training always writes one
                f"training finished but no checkpoint was found under "
                f"{store.get_checkpoint_path(run_id)}")
        model_out.load_state_dict(state["model"])
        model_out.eval()
        phases.done("model from the store")
        return self._make_model(p, model_out, state["history"], run_id, zeros, output_shapes)

    def _make_model(self, p: Dict[str, Any], model: Any, history: Dict[str, List[float]],
                    run_id: str, zeros: Dict[str, np.ndarray],
                    output_shapes: List[List[int]]) -> TorchModel:
        labels = p["label_cols"] or []
        output_cols = p["output_cols"] or default_output_cols(labels, len(output_shapes))
        feature_shapes = [list(zeros[c].shape[1:]) for c in p["feature_cols"]]
        m = TorchModel(model=model, history={k: list(v) for k, v in history.items()},
                       feature_cols=p["feature_cols"], label_cols=labels or None,
                       output_cols=output_cols, run_id=run_id, input_shapes=p["input_shapes"],
                       feature_shapes=feature_shapes, output_shapes=output_shapes,
                       inference_batch_size=p["inference_batch_size"], use_gpu=p["use_gpu"])
        return m

    def _needed_columns(self, p: Dict[str, Any]) -> List[str]:
        cols = list(p["feature_cols"]) + list(p["label_cols"] or [])
        if p["sample_weight_col"]:
            cols.append(p["sample_weight_col"])
        return list(dict.fromkeys(cols))

    def _train_config(self, p: Dict[str, Any], run_id: str, seed: int,
                      meta: Any) -> trainer.TrainConfig:
        import cloudpickle
        objects = {k: p[k] for k in ("model", "optimizer", "loss", "loss_constructors",
                                     "metrics", "callbacks", "transformation_fn",
                                     "gradient_compression", "lr_scheduler_fn")}
        if any(t.device.type != "cpu" for t in p["model"].parameters()):
            objects["model"], objects["optimizer"] = copy.deepcopy((p["model"], p["optimizer"]))
            objects["model"].cpu()
        return trainer.TrainConfig(
            run_id=run_id, store=p["store"], meta=meta, objects=cloudpickle.dumps(objects),
            feature_cols=list(p["feature_cols"]), label_cols=list(p["label_cols"] or []),
            sample_weight_col=p["sample_weight_col"], input_shapes=p["input_shapes"],
            label_shapes=p["label_shapes"], loss_weights=p["loss_weights"],
            batch_size=p["batch_size"], val_batch_size=p["val_batch_size"] or p["batch_size"],
            epochs=p["epochs"], train_steps_per_epoch=p["train_steps_per_epoch"],
            validation_steps_per_epoch=p["validation_steps_per_epoch"], shuffle=p["shuffle"],
            shuffle_buffer_size=p["shuffle_buffer_size"], seed=seed,
            backward_passes_per_step=p["backward_passes_per_step"], use_gpu=p["use_gpu"],
            verbose=p["verbose"], terminate_on_nan=p["terminate_on_nan"], reader=p["reader"])

    # -- parameter checks (no Spark) -------------------------------------------------------
    def _check_params(self, p: Dict[str, Any]) -> None:
        import torch

        def need(name: str, what: str) -> None:
            if p[name] is None:
                raise InvalidArgumentError(f"TorchEstimator needs {name}: {what}")

        need("model", "the torch.nn.Module to train, e.g. model=MyNet()")
        if not isinstance(p["model"], torch.nn.Module):
            raise InvalidArgumentError(
                f"model must be a torch.nn.Module, got {type(p['model']).__name__}")
        need("optimizer", "e.g. optimizer=torch.optim.Adam(model.parameters(), lr=1e-3)")
        opt = p["optimizer"]
        if isinstance(opt, torch.optim.Optimizer):
            mine = {id(t) for t in p["model"].parameters()}
            theirs = [t for g in opt.param_groups for t in g["params"]]
            if not theirs or any(id(t) not in mine for t in theirs):
                raise InvalidArgumentError(
                    "optimizer was not built on this model's parameters: create it with "
                    "torch.optim.X(model.parameters(), ...) for the same model object, or pass "
                    "a function params -> optimizer")
        elif not callable(opt):
            raise InvalidArgumentError(
                f"optimizer must be a torch.optim.Optimizer or a callable params -> Optimizer, "
                f"got {type(opt).__name__}")
        if p["loss"] is None and p["loss_constructors"] is None:
            raise InvalidArgumentError(
                "TorchEstimator needs loss, e.g. loss=torch.nn.functional.cross_entropy")
        need("feature_cols", "the feature column names, e.g. feature_cols=['features']")
        need("store", "where to put data and checkpoints, e.g. store=LocalStore('/tmp/runs') "
                      "(on Databricks: Store.create('/dbfs/tmp/runs'))")
        labels = p["label_cols"] or []
        losses = p["loss_constructors"] if p["loss_constructors"] is not None else p["loss"]
        n_losses = len(losses) if isinstance(losses, (list, tuple)) else 1
        if labels and n_losses not in (1, len(labels)):
            raise InvalidArgumentError(
                f"{n_losses} loss functions for {len(labels)} label_cols {labels}: give one "
                f"loss, or one per label column")
        if not labels:
            raise InvalidArgumentError(
                "TorchEstimator needs label_cols, e.g. label_cols=['label'] (the loss compares "
                "the model's outputs with them)")
        n_out = max(n_losses, len(labels))
        if p["loss_weights"] is not None and len(p["loss_weights"]) != n_out:
            raise InvalidArgumentError(
                f"loss_weights has {len(p['loss_weights'])} value(s) for {n_out} loss(es); give "
                f"one weight per label column")
        for name, cols in (("input_shapes", p["feature_cols"]), ("label_shapes", labels)):
            if p[name] is not None and len(p[name]) != len(cols):
                raise InvalidArgumentError(
                    f"{name} has {len(p[name])} shape(s) for {len(cols)} column(s) {cols}; give "
                    f"one shape per column")
        if p["output_cols"] is not None and labels and len(p["output_cols"]) != len(labels):
            raise InvalidArgumentError(
                f"output_cols {p['output_cols']} has {len(p['output_cols'])} name(s) for "
                f"{len(labels)} label column(s); give one per model output")
        if p["sample_weight_col"] and p["sample_weight_col"] in p["feature_cols"] + labels:
            raise InvalidArgumentError(
                f"sample_weight_col '{p['sample_weight_col']}' is also a feature or label column")
        overlap = set(p["feature_cols"]) & set(labels)
        if overlap:
            raise InvalidArgumentError(f"columns {sorted(overlap)} are both features and labels")
        if p["reader"] == "petastorm" and (p["train_steps_per_epoch"] is None or (
                p["validation"] and p["validation_steps_per_epoch"] is None)):
            raise InvalidArgumentError(
                "reader='petastorm' shards by row group, so processes may get different numbers "
                "of batches: set train_steps_per_epoch (and validation_steps_per_epoch with "
                "validation) to at most the batches of the smallest shard, or use "
                "reader='arrow' (equal steps on every process)")
        comp = p["gradient_compression"]
        if comp is not None and not (hasattr(comp, "compress") and hasattr(comp, "decompress")):
            raise InvalidArgumentError(
                "gradient_compression must be spark_hvd.torch.Compression.none, .fp16 or .bf16")
        for cb in p["callbacks"] or []:
            hooks = ("on_train_begin", "on_epoch_begin", "on_batch_end", "on_epoch_end",
                     "on_train_end")
            if not any(hasattr(cb, h) for h in hooks):
                raise InvalidArgumentError(
                    f"callback {cb!r} has none of the methods {', '.join(hooks)}")


declare_params(TorchEstimator, ESTIMATOR_PARAMS)


# -- fit helpers ------------------------------------------------------------------------------

class _Phases:
    """How long each step of fit took: logged, and printed with verbose >= 2."""

    def __init__(self, verbose: int) -> None:
        self.verbose, self.last = verbose, time.perf_counter()

    def done(self, what: str) -> None:
        now = time.perf_counter()
        logger.info("fit: %s in %.1f s", what, now - self.last)
        if self.verbose >= 2:
            print(f"fit: {what} in {now - self.last:.1f}s", flush=True)
        self.last = now


def _launch_plan(spark: Any, num_proc: Optional[int], use_gpu: Optional[bool]) -> int:
    """spark.run's own launch checks, made before any data is written; the num_proc to use."""
    from spark_hvd.spark import _checks
    plan = _checks.plan(_checks.read_conf(spark), num_proc, use_gpu,
                        registered=lambda: _checks.registered_slots(spark))
    return plan.num_proc


def _seed_of(run_id: str) -> int:
    return int(hashlib.sha256(run_id.encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def _first_rows(df: Any, columns: Sequence[str], num_proc: int) -> Any:
    """One ``limit(num_proc)`` job: at least num_proc rows, and the first one."""
    from .materialize import _col
    rows = df.select(*[_col(c) for c in columns]).limit(num_proc).collect()
    if not rows:
        raise InvalidArgumentError(
            "the DataFrame is empty: there is nothing to train on. Check the filters and joins "
            "that produce it (df.count() should be > 0).")
    if len(rows) < num_proc:
        raise InvalidArgumentError(
            f"the DataFrame has {len(rows)} row(s), fewer than num_proc={num_proc}: every "
            f"process needs at least one row. Use num_proc <= {len(rows)} or more data.")
    return rows[0]


def _zero_batch(df: Any, first: Any, columns: Sequence[str], rows: int = 2
                ) -> Dict[str, np.ndarray]:
    """Zeros shaped like ``rows`` rows of each column as the reader will deliver them."""
    from pyspark.ml.linalg import Vector
    from pyspark.sql import types as T
    fields = {f.name: f.dataType for f in df.schema.fields}
    out = {}
    for c in columns:
        value, dt = first[c], fields[c]
        if isinstance(value, Vector):
            shape, dtype = (value.size,), np.float64
        elif value is None:
            raise InvalidArgumentError(
                f"column '{c}' is null in the first row; training data must not contain nulls. "
                f"Drop or fill them first, e.g. df.na.drop(subset=['{c}']).")
        else:
            try:
                shape = np.asarray(value).shape
            except ValueError:
                shape = ()
            while isinstance(dt, T.ArrayType):
                dt = dt.elementType
            dtype = _SPARK_NUMPY.get(dt.simpleString().split("(")[0], np.float64)
        out[c] = np.zeros((rows,) + tuple(shape), dtype=dtype)
    return out


def _describe(arrays: Dict[str, np.ndarray], cols: Sequence[str]) -> str:
    return ", ".join(f"'{c}' {tuple(arrays[c].shape)} {arrays[c].dtype}" for c in cols)


def _dry_run(p: Dict[str, Any], zeros: Dict[str, np.ndarray]) -> List[List[int]]:
    """Run the model, loss and metrics on zero rows; returns each output's per-row shape."""
    import torch
    model = p["model"]
    features, labels = p["feature_cols"], p["label_cols"] or []
    batch = dict(zeros)
    if p["transformation_fn"] is not None:
        try:
            batch = p["transformation_fn"](dict(batch))
        except Exception as exc:
            raise InvalidArgumentError(
                f"transformation_fn fails on a batch of zeros ({_describe(zeros, list(zeros))}): "
                f"{type(exc).__name__}: {exc}") from exc
    float_dtype = trainer.model_float_dtype(model)
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    shapes = p["input_shapes"]
    inputs = [trainer.to_tensor(batch[c], c, float_dtype, shapes[i] if shapes else None, device)
              for i, c in enumerate(features)]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = trainer.as_outputs(model(*inputs))
    except Exception as exc:
        given = ", ".join(f"'{c}' as {tuple(t.shape)} {t.dtype}" for c, t in zip(features, inputs))
        raise InvalidArgumentError(
            f"the model cannot run on the feature columns: a batch of 2 rows gives {given}, and "
            f"model(*features) fails with {type(exc).__name__}: {exc}. Fix: make the model's "
            f"input layer match these shapes, or set input_shapes (e.g. input_shapes=[[-1, 1, "
            f"8, 8]]) to reshape each feature column") from exc
    finally:
        model.train(was_training)
    if len(outputs) < len(labels):
        raise InvalidArgumentError(
            f"the model returns {len(outputs)} output(s) but label_cols has {len(labels)} "
            f"columns {labels}: return one output per label column")
    bad = [i for i, o in enumerate(outputs) if not torch.is_tensor(o) or o.dim() == 0
           or o.shape[0] != 2]
    if bad:
        raise InvalidArgumentError(
            f"model output {bad[0]} is not a tensor with the batch as its first dimension "
            f"(for 2 rows it is {getattr(outputs[bad[0]], 'shape', type(outputs[bad[0]]))})")
    lshapes = p["label_shapes"]
    label_t = [trainer.to_tensor(batch[c], c, float_dtype, lshapes[i] if lshapes else None,
                                 device) for i, c in enumerate(labels)]
    label_t = trainer.align_labels(outputs, label_t, lshapes is not None)
    weight = (trainer.to_tensor(np.ones(2, np.float32), "w", float_dtype, None, device)
              if p["sample_weight_col"] else None)
    loss = p["loss"] if p["loss_constructors"] is None else [c() for c in p["loss_constructors"]]
    spec = trainer.LossSpec.build(loss, len(labels), p["loss_weights"], weight is not None)
    pairs = ", ".join(f"output {tuple(o.shape)} {o.dtype} vs label '{c}' {tuple(y.shape)} "
                      f"{y.dtype}" for c, o, y in zip(labels, outputs, label_t))
    try:
        with torch.no_grad():
            value = spec(outputs, label_t, weight)
    except Exception as exc:
        raise InvalidArgumentError(
            f"the loss fails on the model's outputs and the labels ({pairs}): "
            f"{type(exc).__name__}: {exc}. Fix: for class indices cast the label column to an "
            f"integer type (df.withColumn('label', F.col('label').cast('long'))), make the "
            f"model's output match the label's shape, or set label_shapes") from exc
    if not torch.is_tensor(value) or value.numel() != 1:
        raise InvalidArgumentError(
            f"the loss must return a single number (a scalar tensor), got "
            f"{getattr(value, 'shape', type(value).__name__)} for {pairs}")
    for name, fn in trainer.metric_names(p["metrics"]):
        try:
            with torch.no_grad():
                fn(outputs[0], label_t[0])
        except Exception as exc:
            raise InvalidArgumentError(
                f"metric '{name}' fails on the model's output and label ({pairs}): "
                f"{type(exc).__name__}: {exc}") from exc
    return [list(o.shape[1:]) for o in outputs]


def _compatible_checkpoint(store: Any, run_id: str, model: Any) -> Optional[Dict[str, Any]]:
    """The last checkpoint of ``run_id`` if any; an error if it does not fit ``model``."""
    try:
        state = trainer.read_checkpoint(store, run_id)
    except Exception as exc:
        raise InvalidArgumentError(
            f"cannot read the checkpoint of run_id '{run_id}' in {store}: {exc}. Use another "
            f"run_id, or delete {store.get_checkpoint_path(run_id)}") from exc
    if state is None:
        return None
    try:
        copy.deepcopy(model).load_state_dict(state["model"])
    except Exception as exc:
        raise InvalidArgumentError(
            f"run_id '{run_id}' has a checkpoint (epoch {state['epoch']}) of a different model: "
            f"{exc}. Use a new run_id to train this model from scratch") from exc
    return state


def _run_training(config: trainer.TrainConfig, num_proc: int, use_gpu: Optional[bool],
                  verbose: int) -> None:
    from spark_hvd import spark as hvd_spark
    hvd_spark.run(trainer.train, args=(config,), num_proc=num_proc, use_gpu=use_gpu,
                  verbose=1 if verbose else 0)
