"""The Spark layer on pyspark 3.5 and 4.0 (`make test` runs this directory in .venv-spark35
and .venv-spark40 with four tests and one module of tests/spark, Makefile
SPARK_VERSIONS_TESTS; it passes on 4.3 too), in one ``local[2]`` session.

What runs on those versions is what calls pyspark APIs that changed between 3.5 and 4.3,
once each: from tests/spark, ``spark.run`` (barrier RDD, job groups, the inheritable
thread) with an allreduce and with a rank that fails (the report, the job cancelled),
``check_launch`` (the conf and slot checks), ``run_elastic`` (plain tasks) and transform's
Vector <-> array columns (test_vector_columns.py: Catalyst internals reached through py4j);
here, the TorchDistributor drop-in on DDP in barrier tasks; the estimators' data checks
(``raise_error`` inside the write job, turned back into our error); a TorchEstimator fit
and ``transform`` (``pandas_udf`` before pyspark 4.1) whose predictions must equal pyspark
4.3's (tests/_reference_fit.py); a Pipeline of the model saved and loaded (Spark ML's
metadata); Keras and Lightning fits whose ``transform`` predicts as their model does on the
driver; and on 4.0 only, a TorchEstimator under Spark Connect (test_connect.py).

Left to 4.3 (tests/spark, tests/estimators), because they exercise no pyspark API that
these versions lack or changed, or cost a session of their own: local-cluster runs (GPU
mapping, output streaming, kills and timeouts: the same code once a task runs), resuming
and restarts, object stores, MLflow and TensorBoard, the notebooks, and Spark Connect on
3.5 (its pip package has no Connect server, and Spark ML on Connect came with 4.0: saving
under Connect there is our error naming 4.0, below).
"""

import os
import re
import sys

import cloudpickle
import numpy as np
import pytest

import _reference_fit
from spark_hvd.exceptions import InvalidArgumentError

cloudpickle.register_pickle_by_value(sys.modules[__name__])
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "spark"))
import ddp_program  # noqa: E402  (tests/spark's unchanged DDP program)

cloudpickle.register_pickle_by_value(ddp_program)

pytestmark = pytest.mark.spark


def test_torch_distributor_trains_ddp_in_barrier_tasks(spark):
    pytest.importorskip("torch")
    from spark_hvd.spark import TorchDistributor
    steps = 3
    result = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
        ddp_program.train, steps)
    assert result["rank"] == 0 and result["world"] == 2 and result["sum"] == 1.0
    expected = ddp_program.reference(steps, 2)
    assert [pytest.approx(w, rel=1e-5, abs=1e-7) for w in expected] == result["weights"]


@pytest.fixture(scope="module")
def reference_fit(spark, tmp_path_factory):
    """The reference TorchEstimator fit: (DataFrame, fitted model)."""
    pytest.importorskip("torch")
    from spark_hvd.estimators import LocalStore
    store = LocalStore(str(tmp_path_factory.mktemp("reference") / "store"))
    df = _reference_fit.frame(spark)
    return df, _reference_fit.estimator(store).fit(df)


def test_fit_and_transform_predict_as_on_pyspark_4_3(reference_fit):
    df, model = reference_fit
    got = _reference_fit.predictions(model, df)
    np.testing.assert_allclose(got, _reference_fit.stored(), rtol=0,
                               atol=_reference_fit.REFERENCE_ATOL)


def test_a_pipeline_of_the_model_saves_loads_and_predicts_the_same(reference_fit, tmp_path):
    from pyspark.ml import Pipeline, PipelineModel
    df, model = reference_fit
    fitted = Pipeline(stages=[model]).fit(df)
    fitted.write().overwrite().save(str(tmp_path / "pipeline"))
    loaded = PipelineModel.load(str(tmp_path / "pipeline"))
    cols = ("id", "label__output")
    want = fitted.transform(df).select(*cols).orderBy("id").collect()
    got = loaded.transform(df).select(*cols).orderBy("id").collect()
    assert [r["label__output"].toArray().tolist() for r in got] == \
        [r["label__output"].toArray().tolist() for r in want]


def test_a_null_feature_fails_fit_with_our_error_before_training(spark, tmp_path):
    """The row checks of the data write: Spark's raise_error inside the job, and the message
    taken back out of Spark's error (its format differs between versions)."""
    pytest.importorskip("torch")
    from pyspark.sql import functions as F

    from spark_hvd.estimators import LocalStore
    df = _reference_fit.frame(spark)
    df = df.withColumn("label", F.when(F.col("id") == 7, None).otherwise(F.col("label")))
    with pytest.raises(InvalidArgumentError, match="column 'label' has null values"):
        _reference_fit.estimator(LocalStore(str(tmp_path / "store"))).fit(df)


def _transform_matches_the_model(model, df, predict):
    """``model.transform(df)``'s outputs equal ``predict(features)`` on the driver."""
    rows = model.transform(df).select("id", "features", "label__output").orderBy("id").collect()
    x = np.array([r["features"].toArray() for r in rows], np.float32)
    np.testing.assert_allclose(np.array([r["label__output"].toArray() for r in rows]),
                               predict(x), rtol=1e-5, atol=1e-5)


def test_a_keras_estimator_fits_and_transforms(spark, tmp_path):
    """KerasEstimator's Spark side is TorchEstimator's; this runs its ranks and KerasModel's
    predictor in the pandas UDF (and TensorFlow on this environment's numpy)."""
    keras = pytest.importorskip("keras")
    from spark_hvd.estimators import KerasEstimator, LocalStore
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model = KerasEstimator(
        num_proc=2, store=LocalStore(str(tmp_path / "store")), model=net,
        optimizer=keras.optimizers.SGD(0.2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        feature_cols=["features"], label_cols=["label"], batch_size=16, epochs=1, verbose=0,
        mlflow_log=False).fit(_reference_fit.frame(spark))
    assert len(model.getHistory()["loss"]) == 1
    _transform_matches_the_model(model, _reference_fit.frame(spark),
                                 lambda x: model.getModel().predict(x, verbose=0))


def test_a_lightning_estimator_fits_and_transforms(spark, tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    import torch
    from spark_hvd.estimators import LightningEstimator, LocalStore

    class Net(pl.LightningModule):  # cloudpickled by value with this module
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.layer(x)

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.cross_entropy(self(batch["features"]), batch["label"])
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2)

    model = LightningEstimator(
        num_proc=2, store=LocalStore(str(tmp_path / "store")), model=Net(),
        feature_cols=["features"], label_cols=["label"], batch_size=16, epochs=1,
        mlflow_log=False).fit(_reference_fit.frame(spark))

    def predict(x):
        with torch.no_grad():
            return model.getModel()(torch.from_numpy(x)).numpy()
    _transform_matches_the_model(model, _reference_fit.frame(spark), predict)


def test_saving_under_spark_connect_names_the_pyspark_it_needs():
    """Spark ML on Connect (what saving a model through a Connect session takes) came with
    pyspark 4.0: before, the error says so instead of failing inside pyspark."""
    import pyspark
    import pyspark.ml.util as ml_util

    from spark_hvd.estimators import persistence
    if hasattr(ml_util, "ML_CONNECT_HELPER_ID"):
        persistence._require_connect_ml()
        return
    with pytest.raises(InvalidArgumentError, match=r"needs pyspark >= 4\.0 .*this is pyspark "
                                                   + re.escape(pyspark.__version__)):
        persistence._require_connect_ml()
