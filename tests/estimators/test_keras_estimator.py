"""KerasEstimator/KerasModel: the driver-side pieces (no Spark), then end to end on a
local-cluster Spark (two executor JVMs, two ranks)."""

import importlib.util
import os
import re

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from est_helpers import (assert_mlflow_history, assert_tensorboard_history,  # noqa: E402
                         bad_input, kill_at_batch, listing, make_keras_net, mlflow_runs,
                         nan_rows, stop_mid_epoch)
from spark_hvd.estimators import KerasEstimator, KerasModel, LocalStore  # noqa: E402
from spark_hvd.estimators import _keras_io as keras_io  # noqa: E402
from spark_hvd.estimators import _trainer_keras as trainer  # noqa: E402
from spark_hvd.estimators import keras_estimator as ke  # noqa: E402
from spark_hvd.estimators.params import KERAS_ESTIMATOR_PARAMS  # noqa: E402
from spark_hvd.exceptions import InvalidArgumentError  # noqa: E402


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _estimator(store, **kw):
    args = dict(num_proc=2, store=store, model=make_keras_net(),
                optimizer=keras.optimizers.Adam(1e-2), loss=_loss(), metrics=["accuracy"],
                feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=3,
                validation=0.1, random_seed=1, verbose=1)
    args.update(kw)
    return KerasEstimator(**args)


ZEROS = {"features": np.zeros((2, 64)), "label": np.zeros(2, np.int64)}


# -- driver side, no Spark ----------------------------------------------------------------------

def test_keras_params():
    names = {s.name for s in KERAS_ESTIMATOR_PARAMS}
    assert "custom_objects" in names and "loss_constructors" not in names
    assert "keras.Model" in KerasEstimator.model.doc
    assert KerasEstimator(loss="mse", metrics=["mae", "accuracy"]).getMetrics() == \
        ["mae", "accuracy"]


@pytest.mark.parametrize("change,needle", [
    (dict(model=None), "needs model"),
    (dict(model=object()), "must be a keras.Model"),
    (dict(optimizer=None), "needs optimizer"),
    (dict(optimizer="no_such_optimizer"), "optimizer must be a keras.optimizers.Optimizer"),
    (dict(loss=None), "needs loss"),
    (dict(label_cols=["a", "b"], loss=["mse"] * 3), "3 loss functions for 2 label_cols"),
    (dict(callbacks=[object()]), "keras.callbacks.Callback"),
    (dict(store=None), "needs store"),
])
def test_param_checks(change, needle):
    p = _estimator(LocalStore("/tmp/unused-store"))._values()
    p.update(change)
    with pytest.raises(InvalidArgumentError) as err:
        KerasEstimator()._check_params(p)
    assert needle in str(err.value)


def test_a_compiled_model_gives_what_the_params_leave_unset():
    model = make_keras_net(compile_with=dict(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                                             metrics=["mae"], loss_weights=[2.0]))
    est = KerasEstimator(model=model, metrics=["accuracy"], feature_cols=["f"],
                         label_cols=["y"], store=LocalStore("/tmp/unused-store"))
    p = est._values()
    est._check_params(p)
    assert p["_optimizer"]["class_name"] == "SGD" and p["_loss"] == "mse"
    assert p["_metrics"] == ["accuracy"] and p["loss_weights"] == [2.0]


def test_dry_run_shapes_and_errors():
    p = _estimator(LocalStore("/tmp/unused-store"))._values()
    KerasEstimator()._check_params(p)
    assert ke._dry_run(p, ZEROS) == [[10]] and p["_model_bytes"].startswith(b"PK")
    with pytest.raises(InvalidArgumentError) as err:
        ke._dry_run(p, {"features": np.zeros((2, 10)), "label": np.zeros(2, np.int64)})
    msg = str(err.value)
    assert "'features' as (2, 10) float32" in msg and "input_shapes" in msg and "\x1b" not in msg
    with pytest.raises(InvalidArgumentError, match="the loss fails"):
        ke._dry_run(p, {"features": np.zeros((2, 64)), "label": np.zeros((2, 3))})
    p["_metrics"] = ["no_such_metric"]
    with pytest.raises(InvalidArgumentError, match="the metrics .* fail"):
        ke._dry_run(p, ZEROS)


def test_persistence_stores_the_model_as_keras_bytes():
    est = _estimator(LocalStore("/tmp/unused-store"),
                     model=make_keras_net(compile_with=dict(optimizer="sgd", loss="mse")))
    plain, objects = est._split_for_persistence()
    assert isinstance(objects["model"], keras_io.SavedModel)
    assert objects["model"].data.startswith(b"PK")  # a .keras (zip) file
    assert objects["optimizer"][0] == "keras_optimizer"
    back = est._decode_objects(objects)
    assert isinstance(back["optimizer"], keras.optimizers.Adam)
    assert back["model"].compiled and back["model"].loss == "mse"
    for a, b in zip(back["model"].get_weights(), est.getModel().get_weights()):
        np.testing.assert_array_equal(a, b)


def test_checkpoint_is_a_keras_file_with_metadata(tmp_path):
    store = LocalStore(str(tmp_path))
    assert trainer.read_checkpoint(store, "r") is None
    model = make_keras_net()
    trainer.write_checkpoint(store, "r", trainer.LAST_CHECKPOINT, keras_io.model_to_bytes(model),
                             {"epoch": 2, "history": {"loss": [1.0, 0.5]}})
    data, meta = trainer.read_checkpoint(store, "r")
    assert meta["epoch"] == 2 and meta["history"] == {"loss": [1.0, 0.5]}
    path = os.path.join(store.get_checkpoint_path("r"), "last.keras")
    loaded = keras.models.load_model(path)
    assert keras_io.weight_shapes(loaded) == keras_io.weight_shapes(model)
    # A checkpoint of another architecture is refused on the driver, before any job.
    p = _estimator(store, model=make_keras_net(hidden=8))._values()
    with pytest.raises(InvalidArgumentError, match="different model"):
        KerasEstimator()._checkpoint_epoch(p, "r")
    assert KerasEstimator()._checkpoint_epoch(_estimator(store)._values(), "r") == 2


def test_batch_converter():
    convert = trainer.batch_converter(["a", "b"], ["y"], [None, [-1, 2, 2]], None, "w",
                                      np.float32,  # Horovod's transformation_fn: pandas
                                      lambda df: df.assign(a=df["a"].map(lambda v: v + 1)))
    x, y, w = convert({"a": np.zeros((3, 2)), "b": np.zeros((3, 4)), "y": np.arange(3),
                       "w": np.ones(3)})
    assert x[0].dtype == np.float32 and float(x[0][0, 0]) == 1.0 and x[1].shape == (3, 2, 2)
    assert y.dtype == np.int64 and w.dtype == np.float32


# -- end to end on Spark ------------------------------------------------------------------------

def _test_accuracy(model, test_df):
    out = model.transform(test_df).select("label", "label__output").collect()
    pred = np.array([np.argmax(r["label__output"].toArray()) for r in out])
    return float(np.mean(pred == np.array([r["label"] for r in out])))


@pytest.fixture(scope="module")
def fitted(digits, tmp_path_factory):
    """The first fit: 3 epochs, run_id 'kdigits'; (store, KerasModel)."""
    store = LocalStore(str(tmp_path_factory.mktemp("keras") / "store"))
    return store, _estimator(store, run_id="kdigits").fit(digits[0])


@pytest.mark.spark
def test_fit_digits_history_checkpoints_and_transform(fitted, digits):
    store, model = fitted
    assert isinstance(model, KerasModel)
    history = model.getHistory()
    assert set(history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert all(len(v) == 3 for v in history.values())
    assert history["loss"][-1] < history["loss"][0]
    acc = _test_accuracy(model, digits[1])
    assert acc >= 0.9, acc
    ckpt = store.get_checkpoint_path("kdigits")
    assert sorted(os.listdir(ckpt)) == ["best.keras", "last.keras"]
    # transform predicts what the keras model itself predicts.
    net = model.getModel()
    assert isinstance(net, keras.Model) and net.compiled
    out = model.transform(digits[1].limit(5)).collect()
    feats = np.array([r["features"].toArray() for r in out], np.float32)
    np.testing.assert_allclose(np.array([r["label__output"].toArray() for r in out]),
                               net.predict_on_batch(feats), rtol=1e-5, atol=1e-5)


@pytest.mark.spark
def test_fit_logs_to_mlflow_and_tensorboard(fitted, digits):
    """The first fit: rank 0's TensorBoard events, and the driver's MLflow run (MLflow's
    default experiment) with the params, one metric value per epoch, the tag and a
    mlflow.keras model predicting as transform does."""
    store, model = fitted
    history = model.getHistory()
    assert_tensorboard_history(store.get_logs_path("kdigits"), history)
    mlflow = pytest.importorskip("mlflow")
    [run] = mlflow_runs("kdigits")
    assert run.data.params["epochs"] == "3" and run.data.params["metrics"] == "['accuracy']"
    assert run.data.params["optimizer"] == "Adam(learning_rate=0.01)"
    assert run.data.params["loss"] == "SparseCategoricalCrossentropy"
    assert_mlflow_history(run.info.run_id, history)
    logged = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model")
    assert logged.metadata.flavors.keys() >= {"keras", "python_function"}
    out = model.transform(digits[1].limit(5)).collect()
    feats = np.array([r["features"].toArray() for r in out], np.float32)
    np.testing.assert_allclose(logged.predict(feats),
                               np.array([r["label__output"].toArray() for r in out]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.spark
def test_resume_with_a_compiled_model_and_a_callback_stopping_one_rank(fitted, digits, capfd):
    """Same run_id, up to 2 epochs more, the model compiled instead of optimizer/loss/metrics;
    a callback on rank 1 alone stops training in the middle of the first new epoch."""
    store, first = fitted
    compiled = make_keras_net(compile_with=dict(optimizer=keras.optimizers.Adam(1e-2),
                                                loss=_loss(), metrics=["accuracy"]))
    est = KerasEstimator(num_proc=2, store=store, model=compiled, feature_cols=["features"],
                         label_cols=["label"], batch_size=32, epochs=5, validation=0.1,
                         random_seed=1, run_id="kdigits", mlflow_log=False,
                         callbacks=[stop_mid_epoch(rank=1, epoch=3, batch=1)])
    model = est.fit(digits[0])
    out = capfd.readouterr().out
    assert "resuming run 'kdigits' at epoch 4/5" in out
    assert "epoch 1/5" not in out and "[0] epoch 4/5" in out and "val_accuracy" in out
    assert "a callback stopped training after epoch 4" in out and "epoch 5/5" not in out
    history = model.getHistory()
    assert len(history["accuracy"]) == 4
    assert {k: v[:3] for k, v in history.items()} == first.getHistory()
    # A second event file holds epoch 4.
    assert_tensorboard_history(store.get_logs_path("kdigits"), history)
    if importlib.util.find_spec("mlflow") is not None:
        assert len(mlflow_runs("kdigits")) == 1  # the first fit's; mlflow_log=False here


@pytest.mark.spark
def test_a_lost_rank_restarts_from_the_last_epoch_checkpoint(digits, tmp_path, capfd):
    """Rank 1's process is SIGKILLed in the middle of epoch 2: fit restarts the run from the
    epoch 1 checkpoint (last.keras) and finishes all 3 epochs."""
    store = LocalStore(str(tmp_path / "store"))
    marker = tmp_path / "killed"
    model = _estimator(store, run_id="kkilled", mlflow_log=False,
                       callbacks=[kill_at_batch(rank=1, epoch=1, batch=5,
                                                marker=str(marker))]).fit(digits[0])
    out = capfd.readouterr().out
    assert marker.exists()
    assert ("KerasEstimator: rank 1 lost during epoch 2/3 (its process was killed by signal 9 "
            "(SIGKILL) without a Python exception); restarting from the epoch 1 checkpoint, "
            "attempt 2/4") in out, out
    assert out.count("restarting from") == 1
    assert "resuming run 'kkilled' at epoch 2/3" in out and "[0] epoch 3/3" in out
    history = model.getHistory()
    assert {k: len(v) for k, v in history.items()} == {k: 3 for k in history}
    assert history["loss"][-1] < history["loss"][0]
    assert _test_accuracy(model, digits[1]) >= 0.9


@pytest.mark.spark
def test_pipeline_saves_loads_and_predicts_the_same(estimator_spark, fitted, digits, tmp_path):
    from pyspark.ml import Pipeline, PipelineModel
    _, model = fitted
    # Local rows, not digits[1] (a shuffle's output): the same rows in the same Arrow batches
    # both times, so that the float32 results are bit for bit the same.
    test_df = estimator_spark.createDataFrame(digits[1].collect(), digits[1].schema)
    path = str(tmp_path / "fitted")
    PipelineModel(stages=[model]).write().overwrite().save(path)
    loaded = PipelineModel.load(path)
    stage = loaded.stages[-1]
    assert isinstance(stage, KerasModel) and stage.getHistory() == model.getHistory()
    for a, b in zip(stage.getModel().get_weights(), model.getModel().get_weights()):
        np.testing.assert_array_equal(a, b)

    def predictions(m):
        return [r["label__output"].toArray()
                for r in m.transform(test_df).select("label__output").collect()]
    before, after = predictions(model), predictions(loaded)
    assert len(before) == len(after) > 400
    assert all(np.array_equal(a, b) for a, b in zip(before, after))

    est = _estimator(LocalStore(str(tmp_path / "store")), epochs=2)
    Pipeline(stages=[est]).write().overwrite().save(str(tmp_path / "pipeline"))
    reread = Pipeline.load(str(tmp_path / "pipeline")).getStages()[-1]
    assert isinstance(reread, KerasEstimator) and reread.getEpochs() == 2
    assert isinstance(reread.getModel(), keras.Model)
    assert isinstance(reread.getOptimizer(), keras.optimizers.Adam)


@pytest.mark.spark
@pytest.mark.parametrize("case", ["misspelt", "string_type", "empty", "shape", "num_proc",
                                  "duplicate", "input_shapes", "label_range"])
def test_bad_input_errors_leave_the_store_untouched(estimator_spark, digits, store, case):
    """The cases whose checks involve Keras (the dry run, the label check) or none; the
    non-finite values' check is the data's write, the same for every framework (tested with
    TorchEstimator)."""
    df, kw, needle = bad_input(digits[0], case)
    with pytest.raises(InvalidArgumentError) as err:
        _estimator(store, **kw).fit(df)
    assert needle in str(err.value), str(err.value)
    if case == "label_range":  # found from the written data's statistics, before training
        assert not [p for p in listing(store.prefix) if p.startswith("runs")]
    else:
        assert listing(store.prefix) == []


@pytest.mark.spark
def test_nonfinite_data_let_in_stops_training_at_the_first_nan_loss(digits, store, capfd):
    """As TorchEstimator's: with allow_nonfinite=True the NaN rows reach model.fit, and the
    fit stops (terminate_on_nan, the default) with an InvalidArgumentError naming the epoch
    and step, within the first epoch.  Keras' loss stays finite here (TensorFlow's CPU ReLU
    turns the NaN into 0) while the weights turn NaN: that is what is found."""
    with pytest.raises(InvalidArgumentError) as err:
        _estimator(store, allow_nonfinite=True, epochs=3, validation=None,
                   mlflow_log=False).fit(nan_rows(digits[0]))
    msg = str(err.value)
    assert re.match(r"KerasEstimator: the (training loss is nan|model's weights are "
                    r"non-finite) at epoch 1/3, step ", msg), msg
    assert "terminate_on_nan=True" in msg and "allow_nonfinite=True" in msg
    assert "epoch 2/3" not in capfd.readouterr().out  # stopped within the first epoch
