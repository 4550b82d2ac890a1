"""TorchEstimator on an s3:// store (moto's S3 server on 127.0.0.1, tests/_s3.py), and what
fit checks before training: a store it cannot write, ragged or null rows.

The driver, the executors and the ranks find S3 through the usual environment variables
only (dummy credentials, AWS_ENDPOINT_URL); Spark here has no S3 connector, so the training
data is written by the executors through the store, and the model saved through it.
"""

import posixpath

import numpy as np
import pytest
import torch

from _s3 import make_bucket, s3_endpoint, spark_s3_environment  # noqa: F401 (fixture)
from est_helpers import LabelCast, assert_tensorboard_history, listing, torch_estimator
from spark_hvd.estimators import (LocalStore, Store, TorchEstimator, TorchModel, load_pipeline,
                                  save_pipeline)
from spark_hvd.exceptions import InvalidArgumentError

pytestmark = pytest.mark.spark

STALE = ".last.pt." + "0" * 32 + ".tmp"  # what a rank 0 killed while writing last.pt leaves


def _estimator(store, epochs=2, **kw):
    # MLflow is tested on the local-store fits (test_torch_estimator.py): not again here.
    return torch_estimator(store, epochs=epochs, mlflow_log=False, **kw)


def _files(store, sub=""):
    """Every file under the store (relative paths), temporaries included."""
    import pyarrow.fs as pafs
    base = store.join(sub) if sub else store.prefix
    found = store.filesystem.get_file_info(pafs.FileSelector(base, recursive=True,
                                                             allow_not_found=True))
    return sorted(posixpath.relpath(f.path, store.prefix) for f in found
                  if f.type == pafs.FileType.File)


@pytest.fixture(scope="module")
def s3(estimator_spark, s3_endpoint):
    """An s3:// store, with the S3 environment in the executors' Python workers."""
    with spark_s3_environment(estimator_spark, s3_endpoint):
        yield Store.create(f"s3://{make_bucket()}/store")


def test_fit_checkpoints_and_resume_on_s3(s3, digits, capfd, tmp_path):
    model = _estimator(s3, run_id="s3run").fit(digits[0])
    assert len(model.getHistory()["loss"]) == 2
    files = _files(s3)
    runs = [f for f in files if f.startswith("runs/")]
    events = [f for f in runs if f.startswith("runs/s3run/logs/events.out.tfevents.")]
    assert ["runs/s3run/checkpoint/best.pt", "runs/s3run/checkpoint/last.pt",
            "runs/s3run/logs/history.json"] == [f for f in runs if f not in events]
    # Rank 0's TensorBoard events: one file, rewritten whole each epoch on an object store.
    assert len(events) == 1
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / posixpath.basename(events[0])).write_bytes(
        s3.read_bytes(s3.join(events[0])))
    assert_tensorboard_history(str(tmp_path / "events"), model.getHistory())
    data = [f for f in files if f.startswith("intermediate_train_data/")]
    assert any(f.endswith("/_spark_hvd_meta.json") for f in data)
    assert any("__spark_hvd_split=val/part-" in f for f in data)
    assert not [f for f in files if f.endswith(".tmp")]

    # Rank 0 killed while writing last.pt leaves a temporary: the resume removes it.
    ckpt = s3.get_checkpoint_path("s3run")
    with s3.filesystem.open_output_stream(posixpath.join(ckpt, STALE)) as f:
        f.write(b"half a checkpoint")
    capfd.readouterr()
    resumed = _estimator(s3, run_id="s3run", epochs=3).fit(digits[0])
    out = capfd.readouterr().out
    assert "resuming run 's3run' at epoch 3/3" in out and "[0] epoch 3/3" in out
    assert "epoch 1/3" not in out
    history = resumed.getHistory()
    assert len(history["loss"]) == 3 and history["loss"][:2] == model.getHistory()["loss"]
    assert s3.listdir(ckpt) == ["best.pt", "last.pt"]
    assert [f for f in _files(s3) if f.startswith("intermediate_train_data/")] == data  # reused

    # The fitted model and the estimator, saved to and loaded from s3:// (through the store:
    # no Spark S3 connector here).
    url = s3.url + "/models/digits"
    resumed.write().save(url)
    with pytest.raises(InvalidArgumentError, match=r"exists; use write\(\)\.overwrite\(\)"):
        resumed.write().save(url)
    resumed.write().overwrite().save(url)
    loaded = TorchModel.load(url)
    assert loaded.getHistory() == history
    # the same 40 rows for both (limit over an unordered DataFrame may pick others each time)
    rows = digits[1].sparkSession.createDataFrame(digits[1].limit(40).collect(), digits[1].schema)
    before = [r["label__output"].toArray() for r in resumed.transform(rows).collect()]
    after = [r["label__output"].toArray() for r in loaded.transform(rows).collect()]
    assert len(before) == 40 and all(np.array_equal(a, b) for a, b in zip(before, after))
    _estimator(s3, epochs=5).write().save(s3.url + "/models/estimator")
    reread = TorchEstimator.load(s3.url + "/models/estimator")
    assert reread.getEpochs() == 5 and isinstance(reread.getModel(), torch.nn.Module)


def test_an_unwritable_store_fails_before_any_spark_job(estimator_spark, digits, s3_endpoint,
                                                        monkeypatch):
    """A bucket that does not exist, and one that does but without credentials (botocore's
    NoCredentialsError, raised again by the probe's clean-up, must not replace the
    message): the error names the store and the fix, before any Spark job."""
    tracker = estimator_spark.sparkContext.statusTracker()
    jobs = len(tracker.getJobIdsForGroup())
    url = "s3://no-such-bucket-for-spark-hvd/store"
    with pytest.raises(InvalidArgumentError) as err:
        _estimator(Store.create(url)).fit(digits[0])
    msg = str(err.value)
    assert msg.startswith(f"the store {url} is not writable: ")
    assert "Fix: check that the bucket or container exists" in msg and "Py4J" not in msg
    url = f"s3://{make_bucket()}/store"
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    with pytest.raises(InvalidArgumentError) as err:
        _estimator(Store.create(url, skip_instance_cache=True)).fit(digits[0])
    msg = str(err.value)
    assert msg.startswith(f"the store {url} is not writable: writing ")
    assert "failed with NoCredentialsError: Unable to locate credentials. Fix: " in msg, msg
    assert len(tracker.getJobIdsForGroup()) == jobs


def test_a_ragged_row_fails_fit_before_training(estimator_spark, tmp_path, capfd):
    """Row 57 of 100 has 63 features where the first has 64: an error naming the column and
    both lengths while the data is written, before any rank starts."""
    rows = [([float(i % 7)] * (63 if i == 57 else 64), i % 10) for i in range(100)]
    df = estimator_spark.createDataFrame(rows, "features array<double>, label long")
    store = LocalStore(str(tmp_path / "store"))
    with pytest.raises(InvalidArgumentError, match=r"^column 'features' has a row of length 63, "
                                                   r"expected 64 \(the length of the first row\)"):
        _estimator(store, validation=None).fit(df.repartition(2))
    assert "[0] epoch" not in capfd.readouterr().out
    assert not [p for p in listing(store.prefix) if p.endswith(".parquet")]


def test_pipeline_save_and_load_on_s3(s3, digits, tmp_path):
    """save_pipeline/load_pipeline write pyspark's Pipeline layout through the store where
    Spark has no connector (s3:// here), and are pyspark's own writer/reader where it has."""
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import VectorAssembler
    pipeline = Pipeline(stages=[LabelCast("long"), _estimator(s3, epochs=1)])
    url = s3.url + "/pipelines/digits"
    save_pipeline(pipeline, url)
    reread = load_pipeline(url)
    assert isinstance(reread, Pipeline) and reread.uid == pipeline.uid
    cast, est = reread.getStages()
    assert isinstance(cast, LabelCast) and cast.getOrDefault("dtype") == "long"
    assert isinstance(est, TorchEstimator) and est.getEpochs() == 1

    fitted = reread.fit(digits[0])
    model_url = s3.url + "/pipelines/model"
    save_pipeline(fitted, model_url)
    with pytest.raises(InvalidArgumentError, match=r"already exists; use save_pipeline\(\.\.\., "
                                                   r"overwrite=True\)"):
        save_pipeline(fitted, model_url)
    save_pipeline(fitted, model_url, overwrite=True)
    stages = [f"stages/0_{fitted.stages[0].uid}", f"stages/1_{fitted.stages[1].uid}"]
    assert _files(s3, "pipelines/model") == [
        "pipelines/model/metadata/part-00000",
        f"pipelines/model/{stages[0]}/metadata/part-00000",
        f"pipelines/model/{stages[1]}/metadata/part-00000",
        f"pipelines/model/{stages[1]}/objects/part-00000.parquet"]
    loaded = load_pipeline(model_url)
    assert isinstance(loaded, PipelineModel) and isinstance(loaded.stages[1], TorchModel)
    rows = digits[1].sparkSession.createDataFrame(digits[1].limit(40).collect(), digits[1].schema)
    expected = [r["label__output"].toArray() for r in fitted.transform(rows).collect()]

    def same(model):
        got = [r["label__output"].toArray() for r in model.transform(rows).collect()]
        return len(got) == 40 and all(np.array_equal(a, b) for a, b in zip(got, expected))
    assert same(loaded)

    # A JVM stage is written by Spark only: an error naming it, before anything is written.
    jvm = Pipeline(stages=[VectorAssembler(inputCols=["label"], outputCol="v"), fitted])
    with pytest.raises(InvalidArgumentError, match=r"stage VectorAssembler_\w+ "
                                                   r"\(VectorAssembler\) is written by Spark"):
        save_pipeline(jvm, s3.url + "/pipelines/jvm")
    assert not s3.exists(s3.join("pipelines/jvm"))

    # Where Spark opens the path, the same calls go through pyspark's writer and reader.
    local = str(tmp_path / "model")
    save_pipeline(fitted, local)
    save_pipeline(fitted, local, overwrite=True)
    assert same(PipelineModel.load(local)) and same(load_pipeline(local))
