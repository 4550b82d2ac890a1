"""TorchEstimator/TorchModel end to end on a local-cluster Spark (two executor JVMs)."""

import contextlib
import importlib.util
import os
import re

import numpy as np
import pytest
import torch
from pyspark.ml.linalg import VectorUDT

import _reference_fit
from est_helpers import (assert_mlflow_history, assert_tensorboard_history, bad_input,
                         kill_once, listing, make_net, mlflow_runs, nan_rows)
from est_helpers import torch_estimator as _estimator
from spark_hvd.estimators import LocalStore, TorchModel
from spark_hvd.estimators._predict_udf import udf_kind
from spark_hvd.exceptions import InvalidArgumentError, RankFailedError

pytestmark = pytest.mark.spark


def _test_accuracy(model, test_df):
    out = model.transform(test_df).select("label", "label__output").collect()
    pred = np.array([np.argmax(r["label__output"].toArray()) for r in out])
    return float(np.mean(pred == np.array([r["label"] for r in out])))


EXPERIMENT = "spark_hvd-tests-torch"


@pytest.fixture(scope="module")
def undisturbed(digits, tmp_path_factory):
    """The first fit, undisturbed: 4 epochs, run_id 'digits', logged to a new MLflow run in
    EXPERIMENT; (store, TorchModel, its test accuracy)."""
    store = LocalStore(str(tmp_path_factory.mktemp("torch") / "store"))
    model = _estimator(store, run_id="digits", epochs=4,
                       mlflow_experiment=EXPERIMENT).fit(digits[0])
    return store, model, _test_accuracy(model, digits[1])


def test_fit_logs_to_mlflow_and_tensorboard(undisturbed, digits):
    """The digits fit: rank 0's TensorBoard events, and the driver's MLflow run with the
    params, one metric value per epoch, the tag and a model predicting as transform does."""
    store, model, _ = undisturbed
    history = model.getHistory()
    assert_tensorboard_history(store.get_logs_path("digits"), history)
    mlflow = pytest.importorskip("mlflow")
    [run] = mlflow_runs("digits", EXPERIMENT)
    assert run.info.status == "FINISHED"
    assert run.data.params["epochs"] == "4" and run.data.params["metrics"] == "[accuracy]"
    assert run.data.params["optimizer"] == "Adam(lr=0.01)"
    assert_mlflow_history(run.info.run_id, history)
    logged = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model")
    out = model.transform(digits[1].limit(5)).collect()
    feats = np.array([r["features"].toArray() for r in out], np.float32)
    np.testing.assert_allclose(logged.predict(feats),
                               np.array([r["label__output"].toArray() for r in out]),
                               rtol=1e-5, atol=1e-5)


def _by_features(rows, names):
    """``{features: [each output as an array]}`` (the rows' order is not fixed)."""
    return {tuple(r["features"]): [np.asarray(r[n].toArray() if hasattr(r[n], "toArray")
                                              else r[n]) for n in names] for r in rows}


def test_transform_cuts_arrow_batches_into_inference_batches(undisturbed, digits):
    """An Arrow batch larger than inference_batch_size (the test rows: one batch per
    partition, up to spark.sql.execution.arrow.maxRecordsPerBatch rows) is cut into calls of
    at most that many rows, and the predictions are the same as with one call per batch: a
    module that refuses more than 7 rows fails at the default size (1024) and predicts with 7.
    On pyspark >= 4.1, the pandas UDF of older pysparks (forced here) gives the arrow_udf's
    columns value for value at 7 rows per call too."""
    _, model, _ = undisturbed

    class AtMost(torch.nn.Module):  # defined here: cloudpickled by value to the executors
        def __init__(self, inner, rows):
            super().__init__()
            self.inner, self.rows = inner, rows

        def forward(self, x):
            if x.shape[0] > self.rows:
                raise RuntimeError(f"a call of {x.shape[0]} rows, more than {self.rows}")
            return self.inner(x)

    # Cached: the same rows in the same Arrow batches in every transform (a row's float32
    # result may differ in the last bit with the batch it is computed in).
    test_df = digits[1].cache()
    names = ["label__output"]
    want = _by_features(model.transform(test_df).collect(), names)
    strict = model.copy()
    strict.setModel(AtMost(model.getModel(), 7))
    with pytest.raises(Exception, match="more than 7"):
        strict.transform(test_df).collect()
    strict.setInferenceBatchSize(7)
    got = _by_features(strict.transform(test_df).collect(), names)
    assert len(got) > 7 and got.keys() == want.keys()
    np.testing.assert_allclose(np.array([got[k][0] for k in want]),
                               np.array([v[0] for v in want.values()]), rtol=1e-6, atol=1e-6)
    if udf_kind() == "arrow":
        pandas = _by_features(strict._transform_with(test_df, "pandas").collect(), names)
        assert pandas.keys() == got.keys()
        for key, values in got.items():
            np.testing.assert_array_equal(values[0], pandas[key][0])
    test_df.unpersist()


@pytest.mark.skipif(udf_kind() != "arrow", reason="pyspark < 4.1 has no arrow_udf to compare")
def test_the_pandas_udf_of_older_pysparks_gives_the_arrow_udf_s_columns(undisturbed, digits):
    """transform's path for pyspark < 4.1 (a pandas UDF, forced here) gives the columns of
    its arrow_udf path value for value on a model of three outputs (a Vector, a number, and
    a Vector wider than MAX_STRUCT_WIDTH, which comes back as an array) taking a Vector, a
    double and a 2x2 array column (nested: pyarrow re-assembles it; the digits model is the
    test above's; the Vector packed on both paths, the pandas UDF's Vector output as rows of
    bytes), and refuses a null in the double
    column, which pandas would make NaN (the arrow_udf path's own error on nulls is
    array_to_numpy's, tests/unit)."""
    from pyspark.sql import functions as F
    _, model, _ = undisturbed

    class ThreeOutputs(torch.nn.Module):  # defined here: cloudpickled by value
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, s, m):
            out = self.inner(x)
            return out, out[:, 0] * s + m.sum(dim=(1, 2)), out.repeat(1, 30) * s.reshape(-1, 1)

    # Cached: the same Arrow batches on both paths (see the test above).
    s = F.col("label").cast("double") / 10
    df = digits[1].select("*", s.alias("s"),
                          F.array(F.array(s, s * 2), F.array(s * 3, s * 4)).alias("m")).cache()
    three = TorchModel(model=ThreeOutputs(model.getModel()), feature_cols=["features", "s", "m"],
                     feature_shapes=[[64], [], [2, 2]], output_cols=["logits", "score", "wide"])
    names = ["logits", "score", "wide"]
    for kind in ("arrow", "pandas"):  # the Vector goes packed (VectorColumns.packed) on both
        plan = three._transform_with(df, kind)._jdf.queryExecution().optimizedPlan()
        assert "Unpooled.copyFloat" in plan.toString(), (kind, plan.toString())
    # ... and the pandas UDF's Vector output comes back as bytes (PandasLayout, packed)
    assert "UnsafeArrayData.fromPrimitiveArray" in plan.toString(), plan.toString()
    arrow = _by_features(three._transform_with(df, "arrow").collect(), names)
    rows = three._transform_with(df, "pandas").collect()
    assert type(rows[0]["logits"]).__name__ == "DenseVector"
    pandas = _by_features(rows, names)
    assert arrow.keys() == pandas.keys() and len(arrow) > 400
    for key, values in arrow.items():
        for a, p in zip(values, pandas[key]):
            np.testing.assert_array_equal(a, p)
    nulls = df.withColumn("s", F.when(F.col("label") == 3, None).otherwise(F.col("s")))
    with pytest.raises(Exception, match=r"column 's' has null value"):
        three._transform_with(nulls, "pandas").collect()
    df.unpersist()


def test_transform_settles_the_python_worker(estimator_spark):
    """After transform, a task of a reused Python worker finds that worker's heap frozen out
    of the cyclic GC and the zips on its sys.path (pyspark.zip among them) behind importers
    that keep their directory (_model_base.settle_worker)."""
    import gc
    import sys

    import pandas as pd
    from est_helpers import make_net
    from pyspark.ml.linalg import Vectors
    from pyspark.sql import functions as F
    model = TorchModel(model=make_net(), feature_cols=["features"],
                       output_cols=["y"], feature_shapes=[[64]])
    df = estimator_spark.createDataFrame(
        [(Vectors.dense([float(i)] * 64),) for i in range(8)], ["features"]).repartition(2)
    assert len(model.transform(df).collect()) == 8  # (a count would prune the UDF)

    @F.pandas_udf("string")  # a UDF's worker: RDD functions get workers of their own
    def settled(s: pd.Series) -> pd.Series:
        zips = sorted({type(f).__name__ for f in sys.path_importer_cache.values()
                       if "zipimporter" in type(f).__name__.lower()})
        return pd.Series([f"{gc.get_freeze_count()} {','.join(zips)}"] * len(s))
    seen = [r[0].split(" ") for r in df.select(settled(F.lit(0))).collect()]
    transformed = [zips for frozen, zips in seen if int(frozen) > 1000]  # transform's workers
    assert transformed and set(transformed) == {"SteadyZipImporter"}, seen


def test_the_reference_fit_predicts_as_stored(estimator_spark, tmp_path):
    """tests/_reference_fit.py's fit and transform give the stored predictions on this
    pyspark too (the spark35 and spark40 groups compare theirs with them)."""
    got = _reference_fit.fit_and_predict(estimator_spark, LocalStore(str(tmp_path / "store")))
    np.testing.assert_allclose(got, _reference_fit.stored(), rtol=0,
                               atol=_reference_fit.REFERENCE_ATOL)


@contextlib.contextmanager
def _active_mlflow_run():
    """An active MLflow run for the body (None without mlflow)."""
    try:
        import mlflow
    except ImportError:
        yield None
        return
    with mlflow.start_run() as run:
        yield run


def _counted(monkeypatch, targets):
    """Each ``(object, name)`` wrapped so that its calls are counted: the counts by name."""
    calls = {}
    for obj, name in targets:
        def counting(*args, _original=getattr(obj, name), _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(obj, name, counting)
    return calls


def test_fit_digits_and_resume(undisturbed, digits, capfd, monkeypatch):
    """...and each of fit's checks runs once (the store probe, the schema check, the
    launch plan: the first launch runs on the plan checked before the data), and fit
    says where its time went."""
    from spark_hvd.estimators import _estimator_base, materialize
    from spark_hvd.spark import _checks
    store, model, acc = undisturbed
    assert set(model.fit_seconds) >= {"checks", "data", "launch", "training",
                                      "checkpoints", "total"}
    assert isinstance(model, TorchModel)
    history = model.getHistory()
    assert len(history["loss"]) == 4 and len(history["val_accuracy"]) == 4
    assert history["loss"][-1] < history["loss"][0]
    assert acc >= 0.9, acc

    # Same run_id, more epochs: continues at the saved epoch, logging to the active MLflow
    # run, which fit leaves open.
    calls = _counted(monkeypatch, [(type(store), "check_writable"), (_checks, "plan"),
                                   (_estimator_base, "validate_dataframe"),
                                   (materialize, "validate_dataframe")])
    with _active_mlflow_run() as active:
        model2 = _estimator(store, run_id="digits", epochs=6).fit(digits[0])
        if active is not None:
            import mlflow
            assert mlflow.active_run().info.run_id == active.info.run_id
            tags = mlflow.MlflowClient().get_run(active.info.run_id).data.tags
            assert tags["spark_hvd.run_id"] == "digits"
    assert calls == {"check_writable": 1, "validate_dataframe": 1, "plan": 1}, calls
    monkeypatch.undo()
    out = capfd.readouterr().out
    assert "resuming run 'digits' at epoch 5/6" in out
    assert re.search(r"^TorchEstimator\.fit: [0-9.]+ s \(checks [0-9.]+ s, data [0-9.]+ s, "
                     r"launch [0-9.]+ s, training [0-9.]+ s, checkpoints [0-9.]+ s", out,
                     re.MULTILINE), out
    assert "epoch 1/6" not in out and "[0] epoch 6/6" in out and "val_accuracy" in out
    h2 = model2.getHistory()
    assert len(h2["loss"]) == 6 and h2["loss"][:4] == history["loss"]
    if active is not None:
        assert_mlflow_history(active.info.run_id, h2)
    # Two event files (the first fit's, the resumed one's): each epoch once.
    assert_tensorboard_history(store.get_logs_path("digits"), h2)
    ckpt = os.path.join(store.prefix, "runs", "digits", "checkpoint")
    assert sorted(os.listdir(ckpt)) == ["best.pt", "last.pt"]


def _killing(store, marker, step, **kw):
    """The estimator of the digits fits with a model whose rank 1 kills its own process at
    its ``step``-th training batch, once."""
    net = kill_once(make_net(), rank=1, step=step, marker=str(marker))
    return _estimator(store, model=net, optimizer=torch.optim.Adam(net.parameters(), lr=1e-2),
                      **kw)


def test_a_lost_rank_restarts_from_the_last_epoch_checkpoint(undisturbed, digits, store,
                                                             tmp_path, capfd):
    """Rank 1's process is SIGKILLed in the middle of epoch 2 (about 19 steps per epoch):
    fit restarts the run from the epoch 1 checkpoint and ends as an undisturbed fit does."""
    marker = tmp_path / "killed"
    model = _killing(store, marker, step=25, run_id="killed", mlflow_log=False).fit(digits[0])
    out = capfd.readouterr().out
    assert marker.exists()
    if importlib.util.find_spec("mlflow") is not None:
        assert mlflow_runs("killed") == []  # mlflow_log=False
    assert ("TorchEstimator: rank 1 lost during epoch 2/4 (its process was killed by signal 9 "
            "(SIGKILL) without a Python exception); restarting from the epoch 1 checkpoint, "
            "attempt 2/4") in out, out
    assert out.count("restarting from") == 1
    assert "resuming run 'killed' at epoch 2/4" in out and "[0] epoch 4/4" in out
    history, expected = model.getHistory(), undisturbed[1].getHistory()
    assert {k: len(v) for k, v in history.items()} == {k: 4 for k in expected}
    # Two fits of digits in one session can differ from the first epoch on (its rows do not
    # always come in the same order): "within noise" is within 3 points of test accuracy.
    acc = _test_accuracy(model, digits[1])
    assert acc >= 0.9 and abs(acc - undisturbed[2]) <= 0.03, (acc, undisturbed[2])


def test_max_restarts_0_fails_naming_the_lost_rank_and_the_fix(digits, store, tmp_path):
    with pytest.raises(RankFailedError) as err:
        _killing(store, tmp_path / "killed", step=3, epochs=1, max_restarts=0,
                 run_id="killed0").fit(digits[0])
    e = err.value
    assert (e.ranks, e.cause) == ([1], "process")
    msg = str(e)
    assert msg.startswith("TorchEstimator: training failed on its only attempt (max_restarts=0)")
    assert "Raise max_restarts (e.g. max_restarts=3)" in msg and "run_id='killed0'" in msg
    assert "spark_hvd.spark.run: rank 1 failed: its process was killed by signal 9" in msg
    assert any(p.startswith("intermediate_train_data") for p in listing(store.prefix))


def test_pipeline_on_uneven_partitions_saves_loads_and_predicts_the_same(
        estimator_spark, store, tmp_path):
    """VectorAssembler + TorchEstimator in a Pipeline, on a DataFrame whose second partition
    holds one row: fit, save, PipelineModel.load, identical predictions."""
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import VectorAssembler
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    cols = [f"p{i}" for i in range(64)]
    rows = [tuple(float(v) / 16 for v in a) + (int(b), i)
            for i, (a, b) in enumerate(zip(x[:600], y[:600]))]
    sc = estimator_spark.sparkContext
    rdd = sc.parallelize(rows[:599], 1).union(sc.parallelize(rows[599:], 1))
    df = estimator_spark.createDataFrame(rdd, cols + ["label", "id"])
    assert df.rdd.glom().map(len).collect() == [599, 1]

    assembler = VectorAssembler(inputCols=cols, outputCol="features")
    pipeline = Pipeline(stages=[assembler, _estimator(store, epochs=1, validation=None,
                                                      mlflow_log=False)])
    pipeline.write().overwrite().save(str(tmp_path / "pipeline"))  # unfitted: saves too
    fitted = pipeline.fit(df)
    path = str(tmp_path / "fitted")
    fitted.write().overwrite().save(path)
    loaded = PipelineModel.load(path)
    assert isinstance(loaded.stages[-1], TorchModel)
    assert loaded.stages[-1].getHistory() == fitted.stages[-1].getHistory()
    assert len(fitted.stages[-1].getHistory()["loss"]) == 1
    out = fitted.transform(df)
    assert isinstance(out.schema["label__output"].dataType, VectorUDT)
    before = {r["id"]: r["label__output"].toArray()
              for r in out.select("id", "label__output").collect()}
    after = {r["id"]: r["label__output"].toArray()
             for r in loaded.transform(df).select("id", "label__output").collect()}
    assert before.keys() == after.keys() and len(before) == 600
    assert all(np.array_equal(before[k], after[k]) for k in before)
    reread = Pipeline.load(str(tmp_path / "pipeline")).getStages()[-1]
    assert reread.getEpochs() == 1 and isinstance(reread.getModel(), torch.nn.Module)
    assert reread.getMlflowLog() is False


@pytest.mark.parametrize("case", ["misspelt", "string_type", "empty", "shape", "num_proc",
                                  "float_label", "duplicate", "input_shapes", "nonfinite",
                                  "label_range"])
def test_bad_input_errors_leave_the_store_untouched(estimator_spark, digits, store, case):
    df, kw, needle = bad_input(digits[0], case)
    with pytest.raises(Exception) as err:
        _estimator(store, **kw).fit(df)
    assert needle in str(err.value), str(err.value)
    if case == "label_range":  # found from the written data's statistics, before training
        assert not [p for p in listing(store.prefix) if p.startswith("runs")]
    else:
        assert listing(store.prefix) == []


def test_nonfinite_data_let_in_stops_training_at_the_first_nan_loss(digits, store, capfd):
    """allow_nonfinite=True lets the NaN of nan_rows into the data; the first training batch
    holding one gives a NaN loss, and fit stops there (terminate_on_nan, the default) with
    an InvalidArgumentError naming the epoch and step, not after all epochs."""
    with pytest.raises(InvalidArgumentError) as err:
        _estimator(store, allow_nonfinite=True, epochs=3, validation=None,
                   mlflow_log=False).fit(nan_rows(digits[0]))
    msg = str(err.value)
    assert msg.startswith("TorchEstimator: the training loss is nan at epoch 1/3, step "), msg
    assert "terminate_on_nan=True" in msg and "allow_nonfinite=True" in msg
    assert "epoch 2/3" not in capfd.readouterr().out  # stopped within the first epoch
