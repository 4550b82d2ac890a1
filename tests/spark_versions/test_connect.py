"""TorchEstimator under a Spark Connect session on pyspark 4.0 (the spark40 group; 3.5 has
no Spark ML on Connect and its pip package no Connect server, so the spark35 group leaves
this file out: Makefile SPARK_VERSIONS_ONLY_40): fit, ``transform`` against the fitted
module's own forward pass, the model saved twice (overwrite) and loaded, and a Pipeline of
the estimator saved, loaded, fitted and its model saved and loaded. pyspark 4.3's Connect
runs the three estimators, MLflow and bad input (tests/estimators/test_connect.py).

The driver is a process of its own: ``SparkSession.builder.remote("local[2]")`` starts a
local Connect server, which a process cannot hold beside the directory's classic session.
It prints one JSON line of what it saw; the assertions are here."""

import textwrap
from pathlib import Path

import pytest

import _connect

DRIVER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import torch
    sys.path.insert(0, {helpers!r})
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.linalg import Vectors
    from pyspark.sql import SparkSession
    from sklearn.datasets import load_digits

    import est_helpers
    from spark_hvd.estimators import Store, TorchModel

    tmp = {tmp!r}
    spark = SparkSession.builder.remote("local[2]").getOrCreate()
    out = {{"session": type(spark).__module__, "version": spark.version}}
    x, y = load_digits(return_X_y=True)
    rows = [(Vectors.dense((a / 16.0).tolist()), int(b)) for a, b in zip(x[:720], y[:720])]
    df = spark.createDataFrame(rows, ["features", "label"]).repartition(2)
    feats = np.array([r["features"].toArray() for r in
                      df.orderBy("label").limit(64).select("features").collect()])
    probe = spark.createDataFrame([(Vectors.dense(f.tolist()),) for f in feats], ["features"])
    store = Store.create(tmp + "/store")

    def outputs(model):
        return np.array([r["label__output"] for r in model.transform(probe).collect()])

    def forward(module):
        with torch.no_grad():
            return module.eval()(torch.tensor(feats, dtype=torch.float32)).numpy()

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
    spark.stop()
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.timeout(600)
def test_torch_estimator_under_spark_connect(tmp_path):
    script = tmp_path / "connect_estimator.py"
    helpers = Path(__file__).resolve().parents[1] / "estimators"
    script.write_text(DRIVER.format(helpers=str(helpers), tmp=str(tmp_path)))
    out = _connect.run_driver(script, tmp_path, 540)

    import pyspark
    assert out["session"] == "pyspark.sql.connect.session"
    assert out["version"] == pyspark.__version__, out  # the server is this pyspark's
    history = out["history"]
    assert len(history["loss"]) == 3 and history["loss"][-1] < history["loss"][0], history
    assert history["val_accuracy"][-1] > 0.7, history
    assert out["transform_diff"] < 1e-4, out
    assert out["load_diff"] == 0.0, out
    assert out["pipeline_stage"] == "TorchEstimator"
    assert out["pipeline_load_diff"] == 0.0, out
