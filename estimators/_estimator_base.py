"""The ``fit`` both estimators run, with the framework's parts as hooks.

``fit(df)``, in order (nothing is written to the Store before step 5):

1. Check the params (``_check_params``: model, optimizer, loss, columns, shapes...
   consistent with each other), and that the Store is writable (``Store.check_writable``:
   a file written and deleted under its root; the error names the store and the fix).
2. Check the DataFrame's schema (``validate_dataframe``: columns exist, types usable) and
   that the cluster can run ``num_proc`` ranks at once (spark.run's own launch checks).
3. One small job: ``limit(num_proc)`` rows of the needed columns, which says whether the
   DataFrame is empty or too small and gives each column's per-row shape.
4. Dry run on the driver (``_dry_run``): the model on two zero rows of those shapes, the
   loss and metrics on its outputs and zero labels; a failure becomes an error naming the
   columns, the shapes and the fix.  When ``run_id`` has a checkpoint, it is checked
   against the model (``_checkpoint_epoch``): a checkpoint of another architecture is an
   error here, not a crash on the workers.  Temporaries of a checkpoint write that was
   interrupted (a killed rank 0) are removed first.
5. ``prepare_data``: the columns as Parquet in the Store (reused when the plan is unchanged);
   a row that is null or whose array length differs from the first row's fails this step,
   naming the column and both lengths.
6. ``spark_hvd.spark.run(_train_fn, num_proc=...)`` with a :class:`TrainConfig`.  Rank 0
   prints the progress (streamed to the driver as ``[0] ...``) and writes the checkpoints.
   When the run fails because a rank was lost or a collective failed (a RankFailedError
   whose ``cause`` is in :data:`RESTART_CAUSES`), the same run is launched again, up to
   ``max_restarts`` times: the ranks resume from the last epoch checkpoint, on the data
   already in the Store (``_train``).  An exception of the user's code is not retried.
7. The trained model comes back through the Store (``_trained_model``), and the fitted
   Spark Model (``_model_class``) is returned, after the fit is logged to MLflow when
   ``mlflow_log`` is True and mlflow imports (``_mlflow``: params, the history, the model
   through ``_log_mlflow_model``).

``p``, the dict of param values that ``fit`` passes to the hooks, is private to one call;
a hook may add entries to it (names starting with ``_``) for the hooks after it.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable

from spark_hvd.exceptions import InvalidArgumentError, RankFailedError

from ._data_checks import row_shape
from ._trainer_common import TrainConfig, apply_transformation, remove_run_temporaries
from ._validate import check_row_count, validate_dataframe
from .params import ParamsFromTable
from .persistence import TableParamsReader, TableParamsWriter

logger = logging.getLogger(__name__)

_SPARK_NUMPY = {"double": np.float64, "float": np.float32, "decimal": np.float64,
                "bigint": np.int64, "int": np.int32, "smallint": np.int16, "tinyint": np.int8,
                "boolean": np.bool_}

# The failures of a training run that a restart from the last checkpoint can get past (see
# RankFailedError.cause): a rank's process killed or crashed, a collective failed (a lost
# peer, a timeout), the Spark job failed (an executor lost).  Not "function" (the user's
# code raised: it would raise again) nor "task" (the task's set-up failed).
RESTART_CAUSES = ("process", "collective", "spark")


class DistributedEstimator(ParamsFromTable, Estimator, MLWritable, MLReadable):
    """Base of TorchEstimator and KerasEstimator (see the module docstring)."""

    _RUN_PREFIX = "run"
    _model_class: Any = None

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    # -- persistence -----------------------------------------------------------------------
    def write(self) -> TableParamsWriter:
        return TableParamsWriter(self)

    @classmethod
    def read(cls) -> TableParamsReader:
        return TableParamsReader(cls)

    # -- hooks -----------------------------------------------------------------------------
    def _check_params(self, p: Dict[str, Any]) -> None:
        raise NotImplementedError

    def _dry_run(self, p: Dict[str, Any], zeros: Dict[str, np.ndarray]) -> List[List[int]]:
        """Run the model, loss and metrics on zero rows; each output's per-row shape."""
        raise NotImplementedError

    def _checkpoint_epoch(self, p: Dict[str, Any], run_id: str) -> Optional[int]:
        """The epoch of ``run_id``'s last checkpoint (None: none); an error if it does not
        fit the model."""
        raise NotImplementedError

    def _objects(self, p: Dict[str, Any]) -> bytes:
        """The user's objects for the ranks, as bytes."""
        raise NotImplementedError

    # The module of the per-rank trainer (its ``train`` and ``read_checkpoint``), for the
    # estimators that can import it eagerly.
    _trainer_module: Any = None

    def _train_fn(self) -> Callable[[TrainConfig], Dict[str, Any]]:
        return self._trainer_module.train

    def _train_env(self) -> Dict[str, str]:
        return {}

    def _trained_model(self, p: Dict[str, Any], run_id: str
                       ) -> Tuple[Any, Dict[str, List[float]]]:
        """The trained model and its history, from the run's last checkpoint."""
        raise NotImplementedError

    def _model_extra(self, p: Dict[str, Any]) -> Dict[str, Any]:
        """Params of the fitted model beyond the shared ones."""
        return {}

    def _log_mlflow_model(self, p: Dict[str, Any], model: Any, zeros: Dict[str, np.ndarray],
                          signature: Callable[..., Any]) -> None:
        """Log the trained ``model`` into the active MLflow run with its flavor, its
        signature being ``signature(inputs, outputs)`` of the model on the zero batch (see
        ``_mlflow``)."""
        raise NotImplementedError

    # -- fit -------------------------------------------------------------------------------
    def _fit(self, dataset: Any) -> Any:
        p = self._values()
        phases = Phases(p["verbose"])
        self._check_params(p)
        p["store"].check_writable()
        validate_dataframe(dataset, p["feature_cols"], p["label_cols"] or [],
                           p["sample_weight_col"], p["validation"], num_proc=1, check_rows=False)
        wanted = p["num_proc"]
        if wanted is None and p["backend"] is not None:  # Horovod's SparkBackend(num_proc=...)
            wanted = int(p["backend"].num_processes())
        num_proc = launch_plan(dataset.sparkSession, wanted, p["use_gpu"])
        columns = needed_columns(p)
        first = first_rows(dataset, columns, num_proc)
        zeros = zero_batch(dataset, first, columns)
        output_shapes = self._dry_run(p, zeros)
        phases.done("checks and dry run")

        run_id = p["run_id"] or (f"{self._RUN_PREFIX}_{time.strftime('%Y%m%d_%H%M%S')}_"
                                 f"{uuid.uuid4().hex[:6]}")
        seed = p["random_seed"] if p["random_seed"] is not None else seed_of(run_id)
        remove_run_temporaries(p["store"], run_id)
        done = self._checkpoint_epoch(p, run_id)
        epochs = p["epochs"]
        if done is not None and done >= epochs:
            if p["verbose"]:
                print(f"run '{run_id}' already trained {done} epoch(s) (epochs={epochs}): "
                      f"nothing to train, returning its checkpoint", flush=True)
        else:
            from .materialize import prepare_data
            num_partitions = (num_proc * p["partitions_per_process"]
                              if p["partitions_per_process"] else None)
            meta = prepare_data(dataset, p["store"], p["feature_cols"], p["label_cols"] or [],
                                p["sample_weight_col"], p["validation"], num_proc=num_proc,
                                seed=seed, num_partitions=num_partitions, first_row=first)
            phases.done("training data in the store")
            from spark_hvd import spark as hvd_spark
            config = self._train_config(p, run_id, seed, meta)
            self._train(p, run_id, lambda: hvd_spark.run(
                self._train_fn(), args=(config,), num_proc=num_proc, use_gpu=p["use_gpu"],
                env={**self._train_env(), **(p["backend_env"] or {})},
                verbose=1 if p["verbose"] else 0))
            phases.done(f"training on {num_proc} processes")
        model, history = self._trained_model(p, run_id)
        phases.done("model from the store")
        fitted = self._make_model(p, model, history, run_id, zeros, output_shapes)
        if self._log_to_mlflow(p, fitted, zeros):
            phases.done("logged to MLflow")
        return fitted

    def _log_to_mlflow(self, p: Dict[str, Any], fitted: Any, zeros: Dict[str, np.ndarray]
                       ) -> Optional[str]:
        """Log the fit that made the Spark Model ``fitted`` to MLflow (see ``_mlflow``); the
        MLflow run's id, or None when nothing was logged."""
        if not p["mlflow_log"]:
            return None
        from ._mlflow import log_fit
        model = fitted.getModel()
        return log_fit(type(self).__name__, p, list(self._param_specs), fitted.getRunId(),
                       fitted.getHistory(), fitted.getFeatureCols(), fitted.getOutputCols(),
                       lambda signature: self._log_mlflow_model(p, model, zeros, signature))

    def _train(self, p: Dict[str, Any], run_id: str, launch: Callable[[], Any]) -> None:
        """``launch()`` (one training run), launched again after a failure a restart can get
        past, at most ``max_restarts`` times; each launch resumes from the run's last
        checkpoint.  Prints one line per restart; when restarts are exhausted, raises the
        last failure saying so."""
        name, max_restarts, epochs = type(self).__name__, p["max_restarts"], p["epochs"]
        attempts = max_restarts + 1
        for attempt in range(1, attempts + 1):
            try:
                launch()
                return
            except RankFailedError as exc:
                if exc.cause not in RESTART_CAUSES:
                    raise
                done = self._checkpoint_epoch(p, run_id) or 0
                if attempt == attempts:
                    raise restarts_exhausted(name, exc, attempts, max_restarts, run_id,
                                             done) from exc.__cause__
                line = restart_line(name, exc, done, epochs, attempt + 1, attempts)
                if p["verbose"]:
                    print(line, flush=True)
                else:
                    logger.warning("%s", line)

    def _make_model(self, p: Dict[str, Any], model: Any, history: Dict[str, List[float]],
                    run_id: str, zeros: Dict[str, np.ndarray],
                    output_shapes: List[List[int]]) -> Any:
        from ._model_base import default_output_cols
        labels = p["label_cols"] or []
        output_cols = p["output_cols"] or default_output_cols(labels, len(output_shapes))
        feature_shapes = [list(zeros[c].shape[1:]) for c in p["feature_cols"]]
        return self._model_class(
            model=model, history={k: list(v) for k, v in history.items()},
            feature_cols=p["feature_cols"], label_cols=labels or None, output_cols=output_cols,
            run_id=run_id, input_shapes=p["input_shapes"], feature_shapes=feature_shapes,
            output_shapes=output_shapes, inference_batch_size=p["inference_batch_size"],
            use_gpu=p["use_gpu"], **self._model_extra(p))

    def _train_config(self, p: Dict[str, Any], run_id: str, seed: int,
                      meta: Any) -> TrainConfig:
        return TrainConfig(
            run_id=run_id, store=p["store"], meta=meta, objects=self._objects(p),
            feature_cols=list(p["feature_cols"]), label_cols=list(p["label_cols"] or []),
            sample_weight_col=p["sample_weight_col"], input_shapes=p["input_shapes"],
            label_shapes=p["label_shapes"], loss_weights=p.get("loss_weights"),
            batch_size=p["batch_size"], val_batch_size=p["val_batch_size"] or p["batch_size"],
            epochs=p["epochs"], train_steps_per_epoch=p["train_steps_per_epoch"],
            validation_steps_per_epoch=p["validation_steps_per_epoch"], shuffle=p["shuffle"],
            shuffle_buffer_size=p["shuffle_buffer_size"], seed=seed,
            backward_passes_per_step=p["backward_passes_per_step"], use_gpu=p["use_gpu"],
            verbose=p["verbose"], terminate_on_nan=p["terminate_on_nan"], reader=p["reader"],
            extra={k: p[k] for k in ("train_reader_num_workers", "val_reader_num_workers",
                                     "inmemory_cache_all")})

    # -- parameter checks shared by the frameworks (no Spark) ------------------------------
    def _check_common(self, p: Dict[str, Any], n_losses: int) -> None:
        """Columns, store, shapes and counts; ``n_losses`` is how many losses were given."""
        name = type(self).__name__
        if p["feature_cols"] is None:
            raise InvalidArgumentError(
                f"{name} needs feature_cols: the feature column names, e.g. "
                f"feature_cols=['features']")
        if p["store"] is None:
            raise InvalidArgumentError(
                f"{name} needs store: where to put data and checkpoints, e.g. "
                f"store=LocalStore('/tmp/runs') (on Databricks: Store.create('/dbfs/tmp/runs'))")
        labels = p["label_cols"] or []
        if labels and n_losses not in (1, len(labels)):
            raise InvalidArgumentError(
                f"{n_losses} loss functions for {len(labels)} label_cols {labels}: give one "
                f"loss, or one per label column")
        if not labels:
            raise InvalidArgumentError(
                f"{name} needs label_cols, e.g. label_cols=['label'] (the loss compares "
                f"the model's outputs with them)")
        n_out = max(n_losses, len(labels))
        loss_weights = p.get("loss_weights")  # a table without losses has no such row
        if loss_weights is not None and len(loss_weights) != n_out:
            raise InvalidArgumentError(
                f"loss_weights has {len(loss_weights)} value(s) for {n_out} loss(es); give "
                f"one weight per label column")
        for what, cols in (("input_shapes", p["feature_cols"]), ("label_shapes", labels)):
            if p[what] is not None and len(p[what]) != len(cols):
                raise InvalidArgumentError(
                    f"{what} has {len(p[what])} shape(s) for {len(cols)} column(s) {cols}; give "
                    f"one shape per column")
        if p["output_cols"] is not None and len(p["output_cols"]) != len(labels):
            raise InvalidArgumentError(
                f"output_cols {p['output_cols']} has {len(p['output_cols'])} name(s) for "
                f"{len(labels)} label column(s); give one per model output")
        if p["sample_weight_col"] and p["sample_weight_col"] in p["feature_cols"] + labels:
            raise InvalidArgumentError(
                f"sample_weight_col '{p['sample_weight_col']}' is also a feature or label column")
        overlap = set(p["feature_cols"]) & set(labels)
        if overlap:
            raise InvalidArgumentError(f"columns {sorted(overlap)} are both features and labels")
        if p["reader"] == "petastorm":  # before any work: importable, and a local store
            from spark_hvd.data.petastorm_reader import import_make_batch_reader

            import_make_batch_reader()
            import pyarrow.fs as pafs

            if p["store"] is not None and not isinstance(p["store"].filesystem,
                                                         pafs.LocalFileSystem):
                raise InvalidArgumentError(
                    f"reader='petastorm' reads a local store here, and {p['store']} is on "
                    f"{type(p['store'].filesystem).__name__}: use reader='arrow'")
        comp = p["gradient_compression"]
        if comp is not None and not (hasattr(comp, "compress") and hasattr(comp, "decompress")):
            framework = "torch" if "Torch" in name else "tensorflow"
            raise InvalidArgumentError(
                f"gradient_compression must be spark_hvd.{framework}.Compression.none, .fp16 or "
                f".bf16")
        # Spark ML sets None without converting it: the table's checks, for None too.
        for flag in ("max_restarts", "mlflow_log"):
            self._param_specs[flag].convert(flag, p[flag])


# -- fit helpers ------------------------------------------------------------------------------

class Phases:
    """How long each step of fit took: logged, and printed with verbose >= 2."""

    def __init__(self, verbose: int) -> None:
        self.verbose, self.last = verbose, time.perf_counter()

    def done(self, what: str) -> None:
        now = time.perf_counter()
        logger.info("fit: %s in %.1f s", what, now - self.last)
        if self.verbose >= 2:
            print(f"fit: {what} in {now - self.last:.1f}s", flush=True)
        self.last = now


def restart_line(name: str, exc: RankFailedError, done: int, epochs: int, attempt: int,
                 attempts: int) -> str:
    """The driver's line when training restarts after ``exc``, ``done`` epochs being in the
    last checkpoint."""
    who = (f"rank {exc.ranks[0]}" if len(exc.ranks) == 1
           else f"ranks {','.join(map(str, exc.ranks))}" if exc.ranks else "")
    if exc.cause == "collective":
        what = f"a collective failed on {who}" if who else "a collective failed"
    else:
        what = f"{who} lost" if who else "the Spark job failed"
    when = f"during epoch {done + 1}/{epochs}" if done < epochs else "after the last epoch"
    since = f"the epoch {done} checkpoint" if done else "the start (no checkpoint yet)"
    return (f"{name}: {what} {when} ({exc.reason or exc.cause}); restarting from {since}, "
            f"attempt {attempt}/{attempts}")


def restarts_exhausted(name: str, exc: RankFailedError, attempts: int, max_restarts: int,
                       run_id: str, done: int) -> RankFailedError:
    """The error when the last of ``attempts`` training runs failed as ``exc`` did."""
    tries = "its only attempt" if attempts == 1 else f"all {attempts} attempts"
    kept = (f"the checkpoint of epoch {done} and the training data are kept in the store"
            if done else "the training data is kept in the store (no checkpoint yet)")
    text = (f"{name}: training failed on {tries} (max_restarts={max_restarts}), each time "
            f"with a lost rank or a failed collective; {kept}. Raise max_restarts (e.g. "
            f"max_restarts={max_restarts + 3}) to restart from the last epoch checkpoint "
            f"automatically, or fit again with run_id='{run_id}' to resume from it. The last "
            f"failure:\n{exc.message}")
    return RankFailedError(text, exc.failures, ranks=exc.ranks, tensor=exc.tensor,
                           cause=exc.cause, reason=exc.reason)


def launch_plan(spark: Any, num_proc: Optional[int], use_gpu: Optional[bool]) -> int:
    """spark.run's own launch checks, made before any data is written; the num_proc to use."""
    from spark_hvd.spark import check_launch
    return check_launch(num_proc, use_gpu, spark=spark)


def needed_columns(p: Dict[str, Any]) -> List[str]:
    cols = list(p["feature_cols"]) + list(p["label_cols"] or [])
    if p["sample_weight_col"]:
        cols.append(p["sample_weight_col"])
    return list(dict.fromkeys(cols))


def seed_of(run_id: str) -> int:
    return int(hashlib.sha256(run_id.encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def first_rows(df: Any, columns: Sequence[str], num_proc: int) -> Any:
    """One ``limit(num_proc)`` job: at least num_proc rows, and the first one."""
    from .materialize import _col
    rows = df.select(*[_col(c) for c in columns]).limit(num_proc).collect()
    check_row_count(len(rows), num_proc)
    return rows[0]


def zero_batch(df: Any, first: Any, columns: Sequence[str], rows: int = 2
               ) -> Dict[str, np.ndarray]:
    """Zeros shaped like ``rows`` rows of each column as the reader will deliver them."""
    from pyspark.ml.linalg import Vector
    from pyspark.sql import types as T
    fields = {f.name: f.dataType for f in df.schema.fields}
    out = {}
    for c in columns:
        value, dt = first[c], fields[c]
        shape = row_shape(c, value)  # a null is an error
        if isinstance(value, Vector):
            dtype = np.float64
        else:
            while isinstance(dt, T.ArrayType):
                dt = dt.elementType
            dtype = _SPARK_NUMPY.get(dt.simpleString().split("(")[0], np.float64)
        out[c] = np.zeros((rows,) + shape, dtype=dtype)
    return out


def describe_arrays(arrays: Dict[str, Any], cols: Sequence[str]) -> str:
    return ", ".join(f"'{c}' {tuple(arrays[c].shape)} {arrays[c].dtype}" for c in cols)


def transformed(p: Dict[str, Any], zeros: Dict[str, np.ndarray]) -> Dict[str, Any]:
    """The zero batch through ``transformation_fn`` (an error names the batch it got)."""
    if p["transformation_fn"] is None:
        return dict(zeros)
    try:
        return apply_transformation(p["transformation_fn"], zeros)
    except Exception as exc:
        raise InvalidArgumentError(
            f"transformation_fn fails on a batch of zeros ({describe_arrays(zeros, list(zeros))}"
            f"): {type(exc).__name__}: {exc}") from exc


def input_shape_error(given: str, exc: Exception) -> InvalidArgumentError:
    """The dry run's error when the model cannot run on the feature columns."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()  # Keras' terminal bold
    return InvalidArgumentError(
        f"the model cannot run on the feature columns: a batch of 2 rows gives {given}, and "
        f"calling the model on them fails with {type(exc).__name__}: {text}. Fix: make the "
        f"model's input layer match these shapes, or set input_shapes (e.g. input_shapes="
        f"[[-1, 1, 8, 8]]) to reshape each feature column")


def checkpoint_error(store: Any, run_id: str, exc: Exception) -> InvalidArgumentError:
    """The error when the checkpoint of ``run_id`` cannot be read."""
    return InvalidArgumentError(
        f"cannot read the checkpoint of run_id '{run_id}' in {store}: {exc}. Use another "
        f"run_id, or delete {store.get_checkpoint_path(run_id)}")


def no_checkpoint_error(store: Any, run_id: str) -> InvalidArgumentError:
    """The error when a finished training left no checkpoint (it always writes one)."""
    return InvalidArgumentError(f"training finished but no checkpoint was found under "
                                f"{store.get_checkpoint_path(run_id)}")


def loss_error(pairs: str, exc: Exception) -> InvalidArgumentError:
    """The dry run's error when the loss fails on the outputs and labels."""
    return InvalidArgumentError(
        f"the loss fails on the model's outputs and the labels ({pairs}): "
        f"{type(exc).__name__}: {exc}. Fix: for class indices cast the label column to an "
        f"integer type (df.withColumn('label', F.col('label').cast('long'))), make the "
        f"model's output match the label's shape, or set label_shapes")


def check_outputs(outputs: Sequence[Any], labels: Sequence[str], rows: int = 2) -> None:
    """The model returns one output per label, each with the batch as first dimension."""
    if len(outputs) < len(labels):
        raise InvalidArgumentError(
            f"the model returns {len(outputs)} output(s) but label_cols has {len(labels)} "
            f"columns {labels}: return one output per label column")
    bad = [i for i, o in enumerate(outputs)
           if len(getattr(o, "shape", ())) == 0 or o.shape[0] != rows]
    if bad:
        raise InvalidArgumentError(
            f"model output {bad[0]} is not a tensor with the batch as its first dimension "
            f"(for {rows} rows it is {getattr(outputs[bad[0]], 'shape', type(outputs[bad[0]]))})")
