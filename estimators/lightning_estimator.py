"""LightningEstimator: a pyspark.ml Estimator that trains a PyTorch Lightning module with
spark_hvd (Horovod's ``horovod.spark.lightning.TorchEstimator``); ``fit`` returns a
TorchModel whose ``transform`` calls the module's ``forward`` on the feature columns.

``fit`` is the shared one of ``_estimator_base``; here are its Lightning parts:

* the module is the whole training recipe: ``training_step(batch, batch_idx)`` and
  ``validation_step`` get ``batch`` as a dict ``{column: tensor}`` of the feature, label
  (and sample weight) columns, ``configure_optimizers`` gives the optimizers and
  schedulers; so the estimator has no optimizer, loss or metrics params;
* the dry run calls ``forward`` on two zero rows of the feature columns (``input_shapes``
  applied), which is what ``transform`` will call;
* each rank runs ``_trainer_lightning.train``: a Trainer with spark_hvd's HorovodStrategy
  (learning rates scaled by num_proc, as Lightning's Horovod strategy did), plus
  ``trainer_args``; after each epoch the Lightning checkpoint goes to the Store
  (``<run>/checkpoint/last.ckpt``), which a later fit with the same run_id resumes from;
* the trained weights come back from that checkpoint into a copy of the module.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from spark_hvd.exceptions import InvalidArgumentError

from . import _trainer_lightning as trainer
from . import _trainer_torch as torch_trainer
from ._dry_run import check_outputs, no_checkpoint_error
from ._estimator_base import DistributedEstimator
from .params import ESTIMATOR_PARAMS, _P, PICKLE, _any, _dict, _list_of_objects, \
    declare_params, derive_table
from .torch_estimator import compatible_checkpoint, forward_on_zeros, log_torch_model
from .torch_model import TorchModel

# The rows of TorchEstimator's table a LightningModule makes moot (it computes its own
# loss and metrics and configures its own optimizers and schedulers; mixed precision is the
# Trainer's `precision`, through trainer_args, and compiling is up to the module).
_MOOT = ("optimizer", "loss", "loss_constructors", "loss_weights", "metrics", "lr_scheduler_fn",
         "torch_compile", "mixed_precision")

LIGHTNING_ESTIMATOR_PARAMS = derive_table(
    ESTIMATOR_PARAMS,
    replace=(
        _P("model", None, _any, PICKLE,
           "the LightningModule to train: training_step/validation_step get a batch "
           "{column: tensor}; configure_optimizers gives its optimizers"),
        _P("callbacks", None, _list_of_objects, PICKLE,
           "Lightning Callback objects, run on every process"),
    ),
    drop=_MOOT,
    add=(_P("trainer_args", None, _dict, PICKLE,
            "more keyword arguments for lightning's Trainer (e.g. {'gradient_clip_val': 1.0, "
            "'precision': 'bf16-mixed'}); the estimator sets strategy, accelerator, devices, "
            "max_epochs, accumulate_grad_batches and use_distributed_sampler itself"),))


class LightningEstimator(DistributedEstimator):
    """Train a LightningModule on a DataFrame with spark_hvd; ``fit`` returns a TorchModel.

    Example::

        class Net(pl.LightningModule):
            ...
            def training_step(self, batch, batch_idx):
                loss = F.cross_entropy(self(batch["features"]), batch["label"])
                self.log("train_loss", loss)
                return loss

        est = LightningEstimator(num_proc=2, store=Store.create("/tmp/runs"), model=Net(),
                                 feature_cols=["features"], label_cols=["label"],
                                 batch_size=64, epochs=5, validation=0.1)
        model = est.fit(train_df)
        model.transform(test_df)   # adds 'label__output': Net.forward on the features
    """

    _RUN_PREFIX = "lightning"
    _model_class = TorchModel
    _trainer_module = trainer

    # -- fit hooks (see _estimator_base) ---------------------------------------------------
    def _dry_run(self, p: Dict[str, Any], zeros: Dict[str, np.ndarray]) -> List[List[int]]:
        outputs = forward_on_zeros(p, zeros)[0]
        check_outputs(outputs, p["label_cols"] or [])
        return [list(o.shape[1:]) for o in outputs]

    def _checkpoint_epoch(self, p: Dict[str, Any], run_id: str) -> Optional[int]:
        state = compatible_checkpoint(p["store"], run_id, p["model"], trainer.read_checkpoint,
                                      "state_dict", _epoch_of)
        return None if state is None else _epoch_of(state)

    def _objects(self, p: Dict[str, Any]) -> bytes:
        import cloudpickle
        return cloudpickle.dumps({"model": torch_trainer.on_cpu(p["model"]),
                                  "callbacks": p["callbacks"],
                                  "transformation_fn": p["transformation_fn"],
                                  "gradient_compression": p["gradient_compression"],
                                  "trainer_args": p["trainer_args"]})

    def _trained_model(self, p: Dict[str, Any], run_id: str
                       ) -> Tuple[Any, Dict[str, List[float]]]:
        state = trainer.read_checkpoint(p["store"], run_id)
        if state is None:  # pragma: no cover - training always writes one
            raise no_checkpoint_error(p["store"], run_id)
        return (torch_trainer.loaded_copy(p["model"], state["state_dict"]),
                state[trainer.META_KEY]["history"])

    def _log_mlflow_model(self, p: Dict[str, Any], model: Any, zeros: Dict[str, np.ndarray],
                          signature: Any) -> None:
        log_torch_model(p, model, zeros, signature)

    # -- parameter checks (no Spark) -------------------------------------------------------
    def _check_params(self, p: Dict[str, Any]) -> None:
        try:
            from spark_hvd.torch.lightning import lightning_package
            package = lightning_package()
        except ImportError as exc:
            raise InvalidArgumentError(
                f"LightningEstimator needs PyTorch Lightning on the driver and the executors: "
                f"{exc}") from exc
        import importlib
        pl = importlib.import_module(package)
        model = p["model"]
        if model is None:
            raise InvalidArgumentError(
                "LightningEstimator needs model: the LightningModule to train, e.g. model=Net()")
        if not isinstance(model, pl.LightningModule):
            raise InvalidArgumentError(
                f"model must be a {package}.LightningModule, got {type(model).__name__} (for a "
                f"plain torch.nn.Module use TorchEstimator)")
        for name in ("training_step", "configure_optimizers"):
            if getattr(type(model), name) is getattr(pl.LightningModule, name):
                raise InvalidArgumentError(
                    f"{type(model).__name__} does not define {name}: LightningEstimator "
                    f"trains through the module's training_step and configure_optimizers")
        self._check_common(p, 1)
        for cb in p["callbacks"] or []:
            if not isinstance(cb, pl.Callback):
                raise InvalidArgumentError(
                    f"callback {cb!r} is not a {package}.Callback (LightningEstimator runs "
                    f"Lightning's callbacks)")
        args = p["trainer_args"] or {}
        taken = sorted(set(args) & set(trainer.RESERVED_TRAINER_ARGS))
        if taken:
            raise InvalidArgumentError(
                "trainer_args may not set " + "; ".join(
                    f"{k} ({trainer.RESERVED_TRAINER_ARGS[k]})" for k in taken))
        try:
            import inspect
            inspect.signature(pl.Trainer).bind(**args)
        except TypeError as exc:
            raise InvalidArgumentError(
                f"trainer_args {sorted(args)} do not fit {package}.Trainer: {exc}") from exc


declare_params(LightningEstimator, LIGHTNING_ESTIMATOR_PARAMS)


def _epoch_of(state: Dict[str, Any]) -> int:
    return int(state[trainer.META_KEY]["epoch"])
