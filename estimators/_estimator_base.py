"""The ``fit`` both estimators run, with the framework's parts as hooks.

``fit(df)``, in order (nothing is written to the Store before step 5; each check runs once,
and what it found is passed on):

1. Check the params (``_check_params``: model, optimizer, loss, columns, shapes...
   consistent with each other), and that the Store is writable (``Store.check_writable``:
   a file written and deleted under its root; the error names the store and the fix).
   With ``mlflow_log``, mlflow starts importing in the background (``_mlflow.preload``).
2. Check the DataFrame's schema (``validate_dataframe``: columns exist, once each, types
   usable) and that the cluster can run ``num_proc`` ranks at once (spark.run's own launch
   checks, ``plan_launch``: step 6's first launch runs on that plan, ``run_planned``).
3. One small job: ``limit(num_proc)`` rows of the needed columns, which says whether the
   DataFrame is empty or too small and gives each column's per-row shape.
4. Dry run on the driver (``_dry_run``): ``input_shapes``/``label_shapes`` checked against
   those shapes (``check_shapes``), the model on two zero rows of them, the loss and metrics
   on its outputs and zero labels; a failure becomes an error naming the columns, the
   shapes and the fix.  When ``run_id`` has a checkpoint, it is checked against the model
   (``_checkpoint_epoch``): a checkpoint of another architecture is an error here, not a
   crash on the workers.  Temporaries of a checkpoint write that was interrupted (a killed
   rank 0) are removed first.
5. ``prepare_data``: the columns as Parquet in the Store (reused when the plan is unchanged),
   given step 2's column info, step 3's first row and step 1's store check; a row that is
   null, whose array length differs from the first row's, or (unless ``allow_nonfinite``)
   that holds NaN or an infinity fails this step, naming the column.  Then the loss runs
   on the smallest and largest value of each integer label column, from the Parquet
   statistics (``_check_label_values``): a class index the model has no output for is an
   error naming the column and its values, before any rank starts.
6. ``spark_hvd.spark.run(_train_fn, num_proc=...)`` with a :class:`TrainConfig`.  Rank 0
   prints the progress (streamed to the driver as ``[0] ...``) and writes the checkpoints.
   When the run fails because a rank was lost or a collective failed (a RankFailedError
   whose ``cause`` is in :data:`RESTART_CAUSES`), the same run is launched again, up to
   ``max_restarts`` times: the ranks resume from the last epoch checkpoint, on the data
   already in the Store (``_train``).  An exception of the user's code is not retried; bad
   input a rank found (a NaN loss with ``terminate_on_nan``, labels the loss refuses) is
   raised as an InvalidArgumentError with the rank's message.
7. The trained model comes back through the Store (``_trained_model``), and the fitted
   Spark Model (``_model_class``) is returned, after the fit is logged to MLflow when
   ``mlflow_log`` is True and mlflow imports (``_mlflow``: params, the history, the model
   through ``_log_mlflow_model``).

Where the time went (:class:`FitClock`: checks, data, launch, training, checkpoints,
MLflow; rank 0 measures its training and checkpoint writes) is logged, printed as one line
with ``verbose >= 1``, and kept as the fitted model's ``fit_seconds``.

``p``, the dict of param values that ``fit`` passes to the hooks, is private to one call;
a hook may add entries to it (names starting with ``_``) for the hooks after it.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable

from spark_hvd.exceptions import InvalidArgumentError, RankFailedError

from ._dry_run import label_range_error, zero_batch
from ._trainer_common import TrainConfig, TrainingInputError, remove_run_temporaries
from ._validate import check_row_count, validate_dataframe
from .params import ParamsFromTable
from .progress import FitClock
from .persistence import TableParamsReader, TableParamsWriter

logger = logging.getLogger(__name__)

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
        clock = FitClock()
        if p["mlflow_log"]:
            from ._mlflow import preload
            preload(self._mlflow_flavor)  # imports for seconds once per process: meanwhile...
        self._check_params(p)
        p["store"].check_writable()
        info = validate_dataframe(dataset, p["feature_cols"], p["label_cols"] or [],
                                  p["sample_weight_col"], p["validation"], num_proc=1,
                                  check_rows=False)
        wanted = p["num_proc"]
        if wanted is None and p["backend"] is not None:  # Horovod's SparkBackend(num_proc=...)
            wanted = int(p["backend"].num_processes())
        planned = launch_plan(dataset.sparkSession, wanted, p["use_gpu"])
        num_proc = planned.num_proc
        columns = needed_columns(p)
        first = first_rows(dataset, columns, num_proc)
        zeros = zero_batch(dataset, first, columns)
        output_shapes = self._dry_run(p, zeros)

        run_id = p["run_id"] or (f"{self._RUN_PREFIX}_{time.strftime('%Y%m%d_%H%M%S')}_"
                                 f"{uuid.uuid4().hex[:6]}")
        seed = p["random_seed"] if p["random_seed"] is not None else seed_of(run_id)
        remove_run_temporaries(p["store"], run_id)
        done = self._checkpoint_epoch(p, run_id)
        clock.done("checks")
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
                                seed=seed, num_partitions=num_partitions,
                                allow_nonfinite=p["allow_nonfinite"], first_row=first,
                                column_info=info, store_checked=True)
            clock.done("data")
            self._check_label_values(p, zeros, meta)
            clock.done("checks")
            from spark_hvd import spark as hvd_spark
            from spark_hvd.spark import run_planned
            config = self._train_config(p, run_id, seed, meta)
            env = {**self._train_env(), **(p["backend_env"] or {})}
            verbose = 1 if p["verbose"] else 0
            unused = [planned]  # the first launch's plan is step 2's; a restart checks again

            def launch() -> Any:
                if unused:
                    return run_planned(unused.pop(), self._train_fn(), args=(config,),
                                       env=env, verbose=verbose)
                return hvd_spark.run(self._train_fn(), args=(config,), num_proc=num_proc,
                                     use_gpu=p["use_gpu"], env=env, verbose=verbose)
            results = self._train(p, run_id, launch)
            clock.done("launch")
            ranks = (results[0] if results and isinstance(results[0], dict) else {})
            for phase, seconds in (ranks.get("seconds") or {}).items():
                clock.move("launch", phase, seconds)  # rank 0's own part of the launch
        model, history = self._trained_model(p, run_id)
        fitted = self._make_model(p, model, history, run_id, zeros, output_shapes)
        clock.done("checkpoints")
        if self._log_to_mlflow(p, fitted, zeros):
            clock.done("MLflow")
        fitted.fit_seconds = clock.report(type(self).__name__, p["verbose"])
        return fitted

    # The mlflow module of the estimator's flavor (see ``_log_mlflow_model``).
    _mlflow_flavor = "mlflow.pytorch"

    def _check_label_values(self, p: Dict[str, Any], zeros: Dict[str, np.ndarray],
                            meta: Any) -> None:
        """The loss on the smallest and the largest value of each integer label column
        (from the Parquet footers: every row, no Spark job), so that a class index the
        model has no output for is an error here, naming the column and its values, not an
        IndexError on a rank.  Not with ``transformation_fn`` (the ranks' labels are what
        it returns)."""
        loss_on = p.get("_loss_on")
        if loss_on is None or p["transformation_fn"] is not None:
            return
        spans = {c: meta.columns[c].value_range for c in p["label_cols"] or []
                 if c in meta.columns and meta.columns[c].value_range is not None}
        if not spans:
            return
        batch = dict(zeros)
        for c, (lo, hi) in spans.items():
            extremes = np.empty_like(zeros[c])
            extremes[:1], extremes[1:] = lo, hi
            batch[c] = extremes
        try:
            loss_on(batch)
        except Exception as exc:
            raise label_range_error(spans, p.get("_output_shapes") or [], exc) from exc

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

    def _train(self, p: Dict[str, Any], run_id: str, launch: Callable[[], Any]) -> Any:
        """``launch()`` (one training run), launched again after a failure a restart can get
        past, at most ``max_restarts`` times; each launch resumes from the run's last
        checkpoint.  Prints one line per restart; when restarts are exhausted, raises the
        last failure saying so.  Bad input a rank found while training (a NaN loss, labels
        the loss refuses: ``TrainingInputError``) is raised as an InvalidArgumentError with
        the rank's message.  Returns what the successful launch returned."""
        name, max_restarts, epochs = type(self).__name__, p["max_restarts"], p["epochs"]
        attempts = max_restarts + 1
        for attempt in range(1, attempts + 1):
            try:
                return launch()
            except RankFailedError as exc:
                found = training_input_error(name, exc)
                if found is not None:
                    raise found from exc
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

def training_input_error(name: str, exc: RankFailedError) -> Optional[InvalidArgumentError]:
    """The InvalidArgumentError for a run that failed because a rank found bad input while
    training (``TrainingInputError``: a NaN loss, labels the loss refuses), else None."""
    prefix = f"{TrainingInputError.__name__}: "
    if exc.cause != "function" or not exc.reason.startswith(prefix):
        return None
    return InvalidArgumentError(f"{name}: {exc.reason[len(prefix):]}", ranks=exc.ranks)


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


def launch_plan(spark: Any, num_proc: Optional[int], use_gpu: Optional[bool]) -> Any:
    """spark.run's own launch checks, made before any data is written: the LaunchPlan the
    first launch runs on (its ``num_proc`` the number of ranks)."""
    from spark_hvd.spark import plan_launch
    return plan_launch(num_proc, use_gpu, spark=spark)


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


