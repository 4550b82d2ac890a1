"""KerasEstimator: a pyspark.ml Estimator that trains a Keras 3 model (TensorFlow backend)
with spark_hvd.

``fit`` is the shared one of ``_estimator_base`` (checks, dry run, data in the Store,
``spark.run``, model from the Store); here are its Keras parts:

* optimizer, loss, metrics and loss_weights are the params, or, for a param left unset, what
  the model was compiled with;
* the model travels to the executors as the bytes of a ``.keras`` file (plus
  ``custom_objects``), the optimizer as ``keras.optimizers.serialize``'s config; loss,
  metrics and callbacks are cloudpickled;
* the dry run calls the model on two zero rows, then loads the ``.keras`` bytes into a trial
  copy (so a missing custom object fails here, not on the executors) and evaluates the
  loss, then the metrics, on its outputs and zero labels;
* a checkpoint of ``run_id`` is checked against the model's weight shapes on the driver;
* each rank runs ``_trainer_keras.train``;
* the trained model comes back from ``<run>/checkpoint/last.keras``, compiled on the driver
  with a plain (not distributed) optimizer of the same config, in a KerasModel;
* MLflow gets the model in the ``mlflow.keras`` flavor (MLflow's Keras 3 flavor, a
  ``.keras`` file; ``mlflow.tensorflow`` is for tf.keras 2).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from spark_hvd.exceptions import InvalidArgumentError

from . import _keras_io as keras_io
from ._dry_run import (check_outputs, checkpoint_error, input_shape_error, loss_error,
                       no_checkpoint_error, transformed)
from ._estimator_base import DistributedEstimator
from ._mlflow import MODEL_NAME, requirements
from .keras_model import KerasModel
from .params import KERAS_ESTIMATOR_PARAMS, declare_params

logger = logging.getLogger(__name__)


class KerasEstimator(keras_io.KerasParamsMixin, DistributedEstimator):
    """Train a ``keras.Model`` on a DataFrame with spark_hvd; ``fit`` returns a KerasModel.

    Example::

        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, "relu"),
                                  keras.layers.Dense(10)])
        est = KerasEstimator(num_proc=2, store=LocalStore("/tmp/runs"), model=model,
                             optimizer=keras.optimizers.Adam(1e-3),
                             loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                             metrics=["accuracy"], feature_cols=["features"],
                             label_cols=["label"], batch_size=64, epochs=5, validation=0.1)
        keras_model = est.fit(train_df)
        keras_model.transform(test_df)   # adds 'label__output'
    """

    _RUN_PREFIX = "keras"
    _model_class = KerasModel
    _mlflow_flavor = "mlflow.keras"

    # -- fit hooks (see _estimator_base) ---------------------------------------------------
    def _dry_run(self, p: Dict[str, Any], zeros: Dict[str, np.ndarray]) -> List[List[int]]:
        return _dry_run(p, zeros)

    def _checkpoint_epoch(self, p: Dict[str, Any], run_id: str) -> Optional[int]:
        from . import _trainer_keras as trainer
        try:
            found = trainer.read_checkpoint(p["store"], run_id)
            if found is None:
                return None
            saved = keras_io.model_from_bytes(found[0], p["custom_objects"])
        except Exception as exc:
            raise checkpoint_error(p["store"], run_id, exc) from exc
        theirs, mine = keras_io.weight_shapes(saved), keras_io.weight_shapes(p["model"])
        if theirs != mine:
            raise InvalidArgumentError(
                f"run_id '{run_id}' has a checkpoint (epoch {found[1]['epoch']}) of a different "
                f"model: its weights have shapes {theirs}, this model's {mine}. Use a new "
                f"run_id to train this model from scratch")
        return int(found[1]["epoch"])

    def _objects(self, p: Dict[str, Any]) -> bytes:
        import cloudpickle
        return cloudpickle.dumps({
            "model": p["_model_bytes"], "optimizer": p["_optimizer"], "loss": p["_loss"],
            "metrics": p["_metrics"], "callbacks": p["callbacks"],
            "custom_objects": p["custom_objects"], "transformation_fn": p["transformation_fn"],
            "gradient_compression": p["gradient_compression"]})

    def _train_fn(self) -> Any:
        from . import _trainer_keras as trainer
        return trainer.train

    def _train_env(self) -> Dict[str, str]:
        # TensorFlow's C++ start-up lines (INFO) would stream to the driver from every rank.
        return {"TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1")}

    def _trained_model(self, p: Dict[str, Any], run_id: str
                       ) -> Tuple[Any, Dict[str, List[float]]]:
        from . import _trainer_keras as trainer
        found = trainer.read_checkpoint(p["store"], run_id)
        if found is None:  # pragma: no cover - training always writes one
            raise no_checkpoint_error(p["store"], run_id)
        model = keras_io.model_from_bytes(found[0], p["custom_objects"])
        _compile(model, p)
        return model, found[1]["history"]

    def _model_extra(self, p: Dict[str, Any]) -> Dict[str, Any]:
        return {"custom_objects": p["custom_objects"]}

    def _log_mlflow_model(self, p: Dict[str, Any], model: Any, zeros: Dict[str, np.ndarray],
                          signature: Any) -> None:
        import mlflow.keras

        from . import _trainer_keras as trainer
        dtype = trainer.model_float_dtype(model)
        shapes = p["input_shapes"] or [None] * len(p["feature_cols"])
        inputs = [trainer.to_array(zeros[c], dtype, shapes[i])
                  for i, c in enumerate(p["feature_cols"])]
        outputs = [np.asarray(o) for o in
                   trainer.as_outputs(model(trainer.as_group(inputs), training=False))]
        layers = getattr(model, "_flatten_layers", None)
        mlflow.keras.log_model(model, name=MODEL_NAME, signature=signature(inputs, outputs),
                               pip_requirements=requirements(
                                   "mlflow.keras", list(layers()) if layers else [model]))

    # -- parameter checks (no Spark) -------------------------------------------------------
    def _check_params(self, p: Dict[str, Any]) -> None:
        """Checks the params and puts what fit uses into ``p``: ``_optimizer`` (a config),
        ``_loss`` and ``_metrics`` (the params', else the compiled model's)."""
        import keras

        model = p["model"]
        if model is None:
            raise InvalidArgumentError(
                "KerasEstimator needs model: the keras.Model to train, e.g. "
                "model=keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])")
        if not isinstance(model, keras.Model):
            raise InvalidArgumentError(
                f"model must be a keras.Model (Keras 3), got {type(model).__name__}")
        compiled = keras_io.compiled_args(model) or {}
        optimizer = p["optimizer"] if p["optimizer"] is not None else compiled.get("optimizer")
        if optimizer is None:
            raise InvalidArgumentError(
                "KerasEstimator needs optimizer: e.g. optimizer=keras.optimizers.Adam(1e-3), "
                "or a model compiled with one")
        try:
            p["_optimizer"] = keras_io.optimizer_config(optimizer)
        except Exception as exc:
            raise InvalidArgumentError(
                f"optimizer must be a keras.optimizers.Optimizer or the name of one, got "
                f"{optimizer!r}: {exc}") from exc
        loss = p["loss"] if p["loss"] is not None else compiled.get("loss")
        if loss is None:
            raise InvalidArgumentError(
                "KerasEstimator needs loss, e.g. loss='sparse_categorical_crossentropy', or a "
                "model compiled with one")
        p["_loss"] = loss
        p["_metrics"] = p["metrics"] if p["metrics"] is not None else compiled.get("metrics")
        if p["loss_weights"] is None:
            p["loss_weights"] = compiled.get("loss_weights")
        self._check_common(p, len(loss) if isinstance(loss, (list, tuple, dict)) else 1)
        bad = [cb for cb in p["callbacks"] or [] if not isinstance(cb, keras.callbacks.Callback)]
        if bad:
            raise InvalidArgumentError(
                f"callbacks must be keras.callbacks.Callback objects, got "
                f"{[type(b).__name__ for b in bad]}")


declare_params(KerasEstimator, KERAS_ESTIMATOR_PARAMS)


# -- fit helpers ------------------------------------------------------------------------------

def _fresh(obj: Any) -> Any:
    """A copy of a loss or metric (Keras metrics hold state: one object per compile)."""
    import cloudpickle
    return cloudpickle.loads(cloudpickle.dumps(obj))


def _compile(model: Any, p: Dict[str, Any], metrics: bool = True, **kwargs: Any) -> None:
    """Compile ``model`` as fit's params say, with a plain optimizer."""
    model.compile(optimizer=keras_io.optimizer_from_config(p["_optimizer"], p["custom_objects"]),
                  loss=_fresh(p["_loss"]), loss_weights=p["loss_weights"],
                  metrics=_fresh(p["_metrics"]) if metrics else None, **kwargs)


def _dry_run(p: Dict[str, Any], zeros: Dict[str, np.ndarray]) -> List[List[int]]:
    """Run the model on zero rows, then the loss and the metrics on a trial copy loaded from
    the model's ``.keras`` bytes; returns each output's per-row shape.  Puts the bytes in
    ``p['_model_bytes']``, and ``_loss_on(batch)`` (the trial's loss and metrics with the
    labels of ``batch``, for fit's check of the label values) and ``_output_shapes``."""
    from . import _trainer_keras as trainer
    model = p["model"]
    features, labels = p["feature_cols"], p["label_cols"] or []
    convert = trainer.batch_converter(features, labels, p["input_shapes"], p["label_shapes"],
                                      p["sample_weight_col"], trainer.model_float_dtype(model))
    batch = convert(transformed(p, zeros))
    x, y = batch[0], batch[1]
    weight = batch[2] if len(batch) > 2 else None
    xs = list(x) if len(features) > 1 else [x]
    try:
        outputs = [np.asarray(o) for o in trainer.as_outputs(model(x, training=False))]
    except Exception as exc:
        given = ", ".join(f"'{c}' as {a.shape} {a.dtype}" for c, a in zip(features, xs))
        raise input_shape_error(given, exc) from exc
    check_outputs(outputs, labels)

    try:
        p["_model_bytes"] = keras_io.model_to_bytes(model)
        trial = keras_io.model_from_bytes(p["_model_bytes"], p["custom_objects"])
    except Exception as exc:
        raise InvalidArgumentError(
            f"the model does not save and load as a .keras file, which is how it travels to "
            f"the executors: {type(exc).__name__}: {exc}. Fix: give custom layers get_config() "
            f"and pass them as custom_objects={{'Name': Class}}") from exc
    ys = list(y) if len(labels) > 1 else [y]
    pairs = ", ".join(f"output {o.shape} {o.dtype} vs label '{c}' {t.shape} {t.dtype}"
                      for c, o, t in zip(labels, outputs, ys))
    _compile(trial, p, metrics=False, run_eagerly=True)
    try:
        trial.test_on_batch(x, y, sample_weight=weight)
    except Exception as exc:
        raise loss_error(pairs, exc) from exc
    if p["_metrics"]:
        _compile(trial, p, run_eagerly=True)
        try:
            trial.test_on_batch(x, y, sample_weight=weight)
        except Exception as exc:
            raise InvalidArgumentError(
                f"the metrics {p['_metrics']!r} fail on the model's outputs and labels "
                f"({pairs}): {type(exc).__name__}: {exc}") from exc

    def loss_on(labelled: Dict[str, Any]) -> None:
        trial.test_on_batch(x, convert(labelled)[1], sample_weight=weight)
    p["_loss_on"] = loss_on
    p["_output_shapes"] = [list(o.shape[1:]) for o in outputs]
    return p["_output_shapes"]
