"""TorchEstimator under a Spark Connect session on pyspark 4.0 (the spark40 group; 3.5 has
no Spark ML on Connect and its pip package no Connect server, so the spark35 group leaves
this file out: Makefile SPARK_VERSIONS_ONLY_40): fit, ``transform`` against the fitted
module's own forward pass, the model saved twice (overwrite) and loaded, and a Pipeline of
the estimator saved, loaded, fitted and its model saved and loaded. pyspark 4.3's Connect
runs the three estimators, MLflow and bad input (tests/estimators/test_connect.py).

The driver is a process of its own: ``SparkSession.builder.remote("local[2]")`` starts a
local Connect server, which a process cannot hold beside the directory's classic session.
It prints one JSON line of what it saw; the assertions are here."""

import pytest

import _connect

DRIVER = """
    from pyspark.ml import Pipeline, PipelineModel

    from spark_hvd.estimators import TorchModel

    model = est_helpers.torch_estimator(store, epochs=3, run_id="connect40",
                                        mlflow_log=False).fit(df)
    out["history"] = model.getHistory()
    got = outputs(model)
    out["transform_diff"] = float(np.abs(got - forward(model.getModel())).max())
    model.write().overwrite().save(tmp + "/model")
    model.write().overwrite().save(tmp + "/model")
    out["load_diff"] = float(np.abs(outputs(TorchModel.load(tmp + "/model")) - got).max())

    pipeline = Pipeline(stages=[est_helpers.torch_estimator(store, epochs=1, mlflow_log=False)])
    pipeline.write().overwrite().save(tmp + "/pipeline")
    loaded = Pipeline.load(tmp + "/pipeline")
    out["pipeline_stage"] = type(loaded.getStages()[0]).__name__
    fitted = loaded.fit(df)
    fitted.write().overwrite().save(tmp + "/pipeline_model")
    out["pipeline_load_diff"] = float(np.abs(
        outputs(PipelineModel.load(tmp + "/pipeline_model")) - outputs(fitted)).max())
"""


@pytest.mark.timeout(600)
def test_torch_estimator_under_spark_connect(tmp_path):
    out = _connect.run_driver(DRIVER, tmp_path, 540)

    import pyspark
    assert out["session"] == "pyspark.sql.connect.session"
    assert out["relabels"] is False, "transform's UDF fallback is what Connect runs"
    assert out["version"] == pyspark.__version__, out  # the server is this pyspark's
    history = out["history"]
    assert len(history["loss"]) == 3 and history["loss"][-1] < history["loss"][0], history
    assert history["val_accuracy"][-1] > 0.7, history
    assert out["transform_diff"] < 1e-4, out
    assert out["load_diff"] == 0.0, out
    assert out["pipeline_stage"] == "TorchEstimator"
    assert out["pipeline_load_diff"] == 0.0, out
