"""TorchEstimator, KerasEstimator and LightningEstimator under a Spark Connect session: fit
and transform; save and load (alone and in a Pipeline, with overwrite), a bad-input error
and MLflow logging of the first two.

The driver is a process of its own (``SparkSession.builder.remote("local[2]")`` starts a local
Connect server; a process cannot hold it beside the classic session of the other tests).  It
prints one JSON line of what it saw; the assertions are here.
"""

import pytest

import _connect

DRIVER = """
    from pyspark.ml import Pipeline, PipelineModel

    from spark_hvd.estimators import KerasEstimator, KerasModel, TorchModel
    from spark_hvd.exceptions import InvalidArgumentError

    def check(key, model, local, cls):
        # transform against the local outputs; save twice (overwrite), load, transform
        got = outputs(model, probe)
        out[key + "_transform_diff"] = float(np.abs(got - local).max())
        path = f"{tmp}/{key}_model"
        model.write().overwrite().save(path)
        model.write().overwrite().save(path)
        out[key + "_load_diff"] = float(np.abs(outputs(cls.load(path), probe) - got).max())

    try:
        est_helpers.torch_estimator(store, feature_cols=["featrues"]).fit(df)
    except InvalidArgumentError as e:
        out["bad_input"] = str(e)

    # Torch: fit; transform against the fitted module's own forward pass; save/load.
    est = est_helpers.torch_estimator(store, epochs=3, run_id="connect_torch")
    model = est.fit(df)
    out["torch_history"] = model.getHistory()
    check("torch", model, forward(model.getModel()), TorchModel)

    # A Pipeline of the estimator: fit, save twice (overwrite), load, transform.
    pipeline = Pipeline(stages=[est_helpers.torch_estimator(store, epochs=2)])
    pipeline.write().overwrite().save(tmp + "/pipeline")
    loaded_pipeline = Pipeline.load(tmp + "/pipeline")
    out["pipeline_stage"] = type(loaded_pipeline.getStages()[0]).__name__
    fitted = loaded_pipeline.fit(df)
    fitted.write().overwrite().save(tmp + "/pipeline_model")
    fitted.write().overwrite().save(tmp + "/pipeline_model")
    reloaded = PipelineModel.load(tmp + "/pipeline_model")
    out["pipeline_load_diff"] = float(np.abs(outputs(reloaded, probe)
                                             - outputs(fitted, probe)).max())
    out["pipeline_transform_diff"] = float(np.abs(
        outputs(reloaded, probe) - forward(reloaded.stages[0].getModel())).max())

    # Keras: fit; transform against model.predict; save/load.
    import keras
    kest = KerasEstimator(
        num_proc=2, store=store, model=est_helpers.make_keras_net(),
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
        batch_size=32, epochs=3, validation=0.1, random_seed=1, verbose=1,
        run_id="connect_keras")
    kmodel = kest.fit(df)
    out["keras_history"] = kmodel.getHistory()
    check("keras", kmodel, kmodel.getModel().predict(feats.astype("float32"), verbose=0),
          KerasModel)

    # Lightning: fit; transform against the module's forward. (Its model is a TorchModel,
    # saved and loaded above; its MLflow logging is TorchEstimator's.)
    from lightning_net import DigitsNet
    from spark_hvd.estimators import LightningEstimator
    lest = LightningEstimator(
        num_proc=2, store=store, model=DigitsNet(), feature_cols=["features"],
        label_cols=["label"], batch_size=32, epochs=2, validation=0.1, random_seed=1,
        run_id="connect_lightning", mlflow_log=False)
    lmodel = lest.fit(df)
    out["lightning_history"] = lmodel.getHistory()
    out["lightning_transform_diff"] = float(np.abs(outputs(lmodel, probe)
                                                   - forward(lmodel.getModel())).max())
"""


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_estimators_under_spark_connect(tmp_path):
    pytest.importorskip("keras")
    mlflow = pytest.importorskip("mlflow")
    out = _connect.run_driver(DRIVER, tmp_path, 840,
                              MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db")

    assert out["session"] == "pyspark.sql.connect.session"
    assert out["relabels"] is False, "transform's UDF fallback is what Connect runs"
    assert "feature column 'featrues' (did you mean 'features'?)" in out["bad_input"]
    for key, loss, accuracy, epochs in (("torch", "loss", "val_accuracy", 3),
                                        ("keras", "loss", "val_accuracy", 3),
                                        ("lightning", "train_loss", "val_acc", 2)):
        history = out[f"{key}_history"]
        assert len(history[loss]) == epochs and history[loss][-1] < history[loss][0], history
        assert history[accuracy][-1] > 0.7, history
        assert out[f"{key}_transform_diff"] < 1e-4, out
    assert out["torch_load_diff"] == out["keras_load_diff"] == 0.0, out
    assert out["pipeline_stage"] == "TorchEstimator"
    assert out["pipeline_load_diff"] == 0.0 and out["pipeline_transform_diff"] < 1e-4, out
    # Each fit logged to MLflow from the Connect client (the driver of this process).
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    experiments = [e.experiment_id for e in client.search_experiments()]
    for run_id, history in (("connect_torch", out["torch_history"]),
                            ("connect_keras", out["keras_history"])):
        runs = client.search_runs(experiments,
                                  filter_string=f"tags.`spark_hvd.run_id` = '{run_id}'")
        assert len(runs) == 1, run_id
        assert runs[0].data.metrics["loss"] == pytest.approx(history["loss"][-1])
