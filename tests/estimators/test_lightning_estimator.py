"""LightningEstimator end to end on a local-cluster Spark (two executor JVMs): a
LightningModule trained from a DataFrame, its TorchModel, resuming by run_id, persistence,
and the checks before any work."""

import json
import os

import numpy as np
import pytest
import torch

from est_helpers import assert_mlflow_history, mlflow_runs
from lightning_net import DigitsNet, EpochsSeen, ForwardOnly, KillOnce
from spark_hvd.estimators import LightningEstimator, LocalStore, TorchModel
from spark_hvd.exceptions import InvalidArgumentError

pytestmark = pytest.mark.spark


def _estimator(store, **kw):
    args = dict(num_proc=2, store=store, model=DigitsNet(), feature_cols=["features"],
                label_cols=["label"], batch_size=32, epochs=2, validation=0.1, random_seed=1,
                run_id="lightning", mlflow_log=False, callbacks=[EpochsSeen()],
                trainer_args={"gradient_clip_val": 5.0})
    args.update(kw)
    return LightningEstimator(**args)


EXPERIMENT = "spark_hvd-tests-lightning"


@pytest.fixture(scope="module")
def fitted(digits, tmp_path_factory):
    """The first fit (2 epochs, run_id 'lightning'), logged to MLflow in EXPERIMENT."""
    store = LocalStore(str(tmp_path_factory.mktemp("lightning") / "store"))
    return store, _estimator(store, mlflow_log=True, mlflow_experiment=EXPERIMENT).fit(
        digits[0])


def _accuracy(model, test_df):
    out = model.transform(test_df).select("label", "label__output").collect()
    pred = np.array([np.argmax(r["label__output"].toArray()) for r in out])
    return float(np.mean(pred == np.array([r["label"] for r in out])))


def test_fit_transform_and_resume(fitted, digits, capfd):
    store, model = fitted
    assert isinstance(model, TorchModel) and isinstance(model.getModel(), DigitsNet)
    history = model.getHistory()
    assert sorted(history) == ["train_loss", "val_acc", "val_loss"]
    assert all(len(v) == 2 for v in history.values())
    assert history["train_loss"][-1] < history["train_loss"][0]
    assert history["val_acc"][-1] >= 0.85, history
    assert _accuracy(model, digits[1]) >= 0.85

    # transform is the module's forward on the features.
    rows = model.transform(digits[1].limit(6)).collect()
    x = torch.tensor(np.array([r["features"].toArray() for r in rows]), dtype=torch.float32)
    with torch.no_grad():
        want = model.getModel()(x).numpy()
    np.testing.assert_allclose(np.array([r["label__output"].toArray() for r in rows]), want,
                               rtol=1e-5, atol=1e-5)

    mlflow = pytest.importorskip("mlflow")
    [logged_run] = mlflow_runs("lightning", EXPERIMENT)
    assert logged_run.data.params["trainer_args"] == "{gradient_clip_val: 5}"
    assert_mlflow_history(logged_run.info.run_id, history)
    logged = mlflow.pyfunc.load_model(f"runs:/{logged_run.info.run_id}/model")
    np.testing.assert_allclose(logged.predict(x.numpy()), want, rtol=1e-5, atol=1e-5)

    run = os.path.join(store.prefix, "runs", "lightning")
    assert os.listdir(os.path.join(run, "checkpoint")) == ["last.ckpt"]
    with open(os.path.join(run, "logs", "history.json")) as f:
        assert json.load(f) == {"epochs": 2, "history": history}

    # The same run_id with more epochs resumes at epoch 3: Lightning restores the weights,
    # the optimizer and the scheduler, and the history goes on.
    capfd.readouterr()
    model2 = _estimator(store, epochs=3).fit(digits[0])
    out = capfd.readouterr().out
    assert "resuming run 'lightning' at epoch 3/3" in out, out[-3000:]
    assert "[0] epoch 3/3" in out and "[0] epoch 2/3" not in out
    assert "[0] user callback: epoch 3 ended" in out
    h2 = model2.getHistory()
    assert all(h2[k][:2] == history[k] and len(h2[k]) == 3 for k in history)


def test_a_lost_rank_restarts_from_the_last_lightning_checkpoint(digits, tmp_path, capfd):
    """Rank 1's process is SIGKILLed in epoch 2 (about 19 batches per epoch): fit restarts
    the run, the ranks resume from the epoch 1 Lightning checkpoint, and training ends."""
    store = LocalStore(str(tmp_path / "store"))
    marker = tmp_path / "killed"
    model = _estimator(store, model=KillOnce(step=25, marker=str(marker)),
                       run_id="killed").fit(digits[0])
    out = capfd.readouterr().out
    assert marker.exists()
    assert "LightningEstimator: rank 1 lost during epoch 2/2" in out, out[-3000:]
    assert "restarting from the epoch 1 checkpoint, attempt 2/4" in out
    assert "resuming run 'killed' at epoch 2/2" in out and "[0] epoch 2/2" in out
    history = model.getHistory()
    assert {k: len(v) for k, v in history.items()} == {"train_loss": 2, "val_acc": 2,
                                                        "val_loss": 2}
    assert history["val_acc"][-1] >= 0.85, history


def test_persistence_keeps_the_module_and_trainer_args(fitted, tmp_path):
    store, _ = fitted
    est = _estimator(store, epochs=7)
    path = str(tmp_path / "est")
    est.write().save(path)
    back = LightningEstimator.load(path)
    assert back.getEpochs() == 7 and back.getTrainerArgs() == {"gradient_clip_val": 5.0}
    assert isinstance(back.getModel(), DigitsNet)
    assert not hasattr(back, "optimizer") and not hasattr(back, "loss")


@pytest.mark.parametrize("kw, message", [
    (dict(model=torch.nn.Linear(64, 10)), "must be a"),
    (dict(model=ForwardOnly()), "does not define training_step"),
    (dict(trainer_args={"max_epochs": 3}), "max_epochs (use epochs)"),
    (dict(trainer_args={"strategy": "ddp", "devices": 2}), "devices (one device per process"),
    (dict(trainer_args={"gradient_clip_vale": 1.0}), "do not fit"),
    (dict(callbacks=[object()]), "is not a"),
    (dict(input_shapes=[[-1, 8, 8]]), "the model cannot run on the feature columns"),
])
def test_bad_params_fail_before_any_work(digits, tmp_path, kw, message):
    store = LocalStore(str(tmp_path / "store"))
    with pytest.raises(InvalidArgumentError) as err:
        _estimator(store, run_id="bad", **kw).fit(digits[0])
    assert message in str(err.value), str(err.value)
    assert not os.path.exists(os.path.join(store.prefix, "runs", "bad"))
