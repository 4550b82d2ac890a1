"""TorchEstimator: a pyspark.ml Estimator that trains a torch model with spark_hvd.

``fit`` is the shared one of ``_estimator_base`` (checks, dry run, data in the Store,
``spark.run``, model from the Store); here are its torch parts:

* the dry run runs the model on two zero rows (``input_shapes`` applied,
  ``transformation_fn`` too), then the loss and metrics on its outputs and zero labels;
* a checkpoint of ``run_id`` is loaded into a copy of the model on the driver (a checkpoint
  of another architecture is an error, not a crash on the workers);
* each rank runs ``_trainer_torch.train``;
* the trained weights come back through the Store (``<run>/checkpoint/last.pt``), are
  loaded into a copy of the model, and a TorchModel is returned;
* MLflow gets the model in the ``mlflow.pytorch`` flavor, pickled (see
  ``_log_mlflow_model``); its pyfunc takes one float tensor as the model does.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from spark_hvd.exceptions import InvalidArgumentError

from . import _trainer_torch as trainer
from ._dry_run import (check_outputs, checkpoint_error, input_shape_error, loss_error,
                       no_checkpoint_error, transformed)
from ._estimator_base import DistributedEstimator
from ._mlflow import MODEL_NAME, requirements
from .params import ESTIMATOR_PARAMS, declare_params
from .torch_model import TorchModel

logger = logging.getLogger(__name__)


class TorchEstimator(DistributedEstimator):
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

    _RUN_PREFIX = "torch"
    _model_class = TorchModel
    _trainer_module = trainer

    # -- fit hooks (see _estimator_base) ---------------------------------------------------
    def _dry_run(self, p: Dict[str, Any], zeros: Dict[str, np.ndarray]) -> List[List[int]]:
        return _dry_run(p, zeros)

    def _checkpoint_epoch(self, p: Dict[str, Any], run_id: str) -> Optional[int]:
        state = compatible_checkpoint(p["store"], run_id, p["model"])
        return None if state is None else int(state["epoch"])

    def _objects(self, p: Dict[str, Any]) -> bytes:
        import cloudpickle
        objects = {k: p[k] for k in ("model", "optimizer", "loss", "loss_constructors",
                                     "metrics", "callbacks", "transformation_fn",
                                     "gradient_compression", "lr_scheduler_fn",
                                     "torch_compile", "mixed_precision")}
        if any(t.device.type != "cpu" for t in p["model"].parameters()):
            objects["model"], objects["optimizer"] = copy.deepcopy((p["model"], p["optimizer"]))
            objects["model"].cpu()
        return cloudpickle.dumps(objects)

    def _trained_model(self, p: Dict[str, Any], run_id: str
                       ) -> Tuple[Any, Dict[str, List[float]]]:
        state = trainer.read_checkpoint(p["store"], run_id)
        if state is None:  # pragma: no cover - training always writes one
            raise no_checkpoint_error(p["store"], run_id)
        return trainer.loaded_copy(p["model"], state["model"]), state["history"]

    def _log_mlflow_model(self, p: Dict[str, Any], model: Any, zeros: Dict[str, np.ndarray],
                          signature: Any) -> None:
        log_torch_model(p, model, zeros, signature)

    # -- parameter checks (no Spark) -------------------------------------------------------
    def _check_params(self, p: Dict[str, Any]) -> None:
        import torch

        if p["model"] is None:
            raise InvalidArgumentError(
                "TorchEstimator needs model: the torch.nn.Module to train, e.g. model=MyNet()")
        if not isinstance(p["model"], torch.nn.Module):
            raise InvalidArgumentError(
                f"model must be a torch.nn.Module, got {type(p['model']).__name__}")
        if p["optimizer"] is None:
            raise InvalidArgumentError(
                "TorchEstimator needs optimizer: e.g. "
                "optimizer=torch.optim.Adam(model.parameters(), lr=1e-3)")
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
        losses = p["loss_constructors"] if p["loss_constructors"] is not None else p["loss"]
        self._check_common(p, len(losses) if isinstance(losses, (list, tuple)) else 1)
        for cb in p["callbacks"] or []:
            hooks = ("on_train_begin", "on_epoch_begin", "on_batch_end", "on_epoch_end",
                     "on_train_end")
            if not any(hasattr(cb, h) for h in hooks):
                raise InvalidArgumentError(
                    f"callback {cb!r} has none of the methods {', '.join(hooks)}")


declare_params(TorchEstimator, ESTIMATOR_PARAMS)


# -- fit helpers ------------------------------------------------------------------------------

def forward_on_zeros(p: Dict[str, Any], zeros: Dict[str, np.ndarray]
                     ) -> Tuple[List[Any], Dict[str, Any], Any, Any]:
    """The model's outputs on the zero rows (through ``transformation_fn``, reshaped by
    ``input_shapes``), in eval mode; a failure is an error naming the columns and shapes.
    Returns (outputs, the transformed batch, the model's float dtype, its device)."""
    import torch
    model = p["model"]
    features = p["feature_cols"]
    batch = transformed(p, zeros)
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
        raise input_shape_error(given, exc) from exc
    finally:
        model.train(was_training)
    return outputs, batch, float_dtype, device


def _dry_run(p: Dict[str, Any], zeros: Dict[str, np.ndarray]) -> List[List[int]]:
    """Run the model, loss and metrics on zero rows; returns each output's per-row shape.
    Puts into ``p`` ``_loss_on(batch)``, the loss and metrics on the same outputs with the
    labels of ``batch`` (for fit's check of the label values), and ``_output_shapes``."""
    labels = p["label_cols"] or []
    outputs, batch, float_dtype, device = forward_on_zeros(p, zeros)
    check_outputs(outputs, labels)

    def loss_on(batch: Dict[str, Any]) -> None:
        _loss_and_metrics(p, outputs, batch, float_dtype, device)
    loss_on(batch)
    p["_loss_on"] = loss_on
    p["_output_shapes"] = [list(o.shape[1:]) for o in outputs]
    return p["_output_shapes"]


def _loss_and_metrics(p: Dict[str, Any], outputs: List[Any], batch: Dict[str, Any],
                      float_dtype: Any, device: Any) -> None:
    """The loss and the metrics on ``outputs`` and the labels of ``batch``; a failure is an
    error naming the outputs and labels and the fix."""
    import torch
    labels = p["label_cols"] or []
    lshapes = p["label_shapes"]
    label_t = [trainer.to_tensor(batch[c], c, float_dtype, lshapes[i] if lshapes else None,
                                 device) for i, c in enumerate(labels)]
    label_t = trainer.align_labels(outputs, label_t, lshapes is not None)
    weight = (trainer.to_tensor(np.ones(len(outputs[0]), np.float32), "w", float_dtype, None,
                                device) if p["sample_weight_col"] else None)
    loss = p["loss"] if p["loss_constructors"] is None else [c() for c in p["loss_constructors"]]
    spec = trainer.LossSpec.build(loss, len(labels), p["loss_weights"], weight is not None)
    pairs = ", ".join(f"output {tuple(o.shape)} {o.dtype} vs label '{c}' {tuple(y.shape)} "
                      f"{y.dtype}" for c, o, y in zip(labels, outputs, label_t))
    try:
        with torch.no_grad():
            value = spec(outputs, label_t, weight)
    except Exception as exc:
        raise loss_error(pairs, exc) from exc
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


def compatible_checkpoint(store: Any, run_id: str, model: Any,
                          read: Callable[[Any, str], Optional[Dict[str, Any]]] =
                          trainer.read_checkpoint,
                          weights: str = "model",
                          epoch_of: Callable[[Dict[str, Any]], int] = lambda s: s["epoch"]
                          ) -> Optional[Dict[str, Any]]:
    """The last checkpoint of ``run_id`` (``read``, TorchEstimator's by default) if any; an
    error if its ``weights`` entry does not fit ``model``."""
    try:
        state = read(store, run_id)
    except Exception as exc:
        raise checkpoint_error(store, run_id, exc) from exc
    if state is None:
        return None
    try:
        copy.deepcopy(model).cpu().load_state_dict(state[weights])
    except Exception as exc:
        raise InvalidArgumentError(
            f"run_id '{run_id}' has a checkpoint (epoch {epoch_of(state)}) of a different "
            f"model: {exc}. Use a new run_id to train this model from scratch") from exc
    return state


def log_torch_model(p: Dict[str, Any], model: Any, zeros: Dict[str, np.ndarray],
                    signature: Any) -> None:
    """Log the trained torch ``model`` into the active MLflow run (``mlflow.pytorch``), its
    signature from the model on the zero batch (see ``_log_mlflow_model``)."""
    import mlflow.pytorch
    import torch
    dtype = trainer.model_float_dtype(model)
    shapes = p["input_shapes"] or [None] * len(p["feature_cols"])
    inputs = [trainer.to_tensor(zeros[c], c, dtype, shapes[i], torch.device("cpu"))
              for i, c in enumerate(p["feature_cols"])]
    with torch.no_grad():
        outputs = trainer.as_outputs(model(*inputs))
    # Pickled (cloudpickle), as the model travels to the executors and into saved
    # Pipelines: whatever trains logs, where MLflow's default torch.export format
    # needs an example input and a model that exports.
    mlflow.pytorch.log_model(
        model, name=MODEL_NAME, serialization_format="pickle",
        signature=signature([t.numpy() for t in inputs], [o.numpy() for o in outputs]),
        pip_requirements=requirements("mlflow.pytorch", model.modules()))
