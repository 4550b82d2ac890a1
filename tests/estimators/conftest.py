"""Fixtures of the estimator tests: one SparkSession for the Spark ones, digits data.

Helpers the tests import live in est_helpers.py: ``from conftest import`` would find
whichever conftest.py of the test tree Python imported first.
"""

import importlib.util
import os
import sys

import pytest

LOCAL_CLUSTER = "local-cluster[2,1,1024]"
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
APP_NAME = "spark_hvd-tests-estimators"


@pytest.fixture(scope="module")
def estimator_spark(request):
    """A ``local-cluster[2,1,1024]`` session (two executor JVMs, one core each).

    Started by the first module that needs it and kept for the later modules of this run
    that need it too (starting one takes ~25 s here); the module after which no test needs
    it stops it, so it does not outlive these tests (a process holds one SparkContext: a
    later ``getOrCreate`` elsewhere must not get this one).  If another SparkContext is
    already running in this process (another directory's session), it is reused and left
    running: spark_hvd.spark.run works on any master with two task slots.
    """
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    active = SparkContext._active_spark_context
    if active is not None and active.appName != APP_NAME:
        yield SparkSession.builder.getOrCreate()
        return
    spark = (SparkSession.builder.master(LOCAL_CLUSTER)
             .appName(APP_NAME)
             .config("spark.driver.extraJavaOptions", JVM_OPTIONS)
             .config("spark.executor.extraJavaOptions", JVM_OPTIONS)
             .config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "4")
             .config("spark.default.parallelism", "2")
             .config("spark.python.worker.reuse", "true")
             .getOrCreate())
    yield spark
    if not _needed_later(request):
        spark.stop()


def _needed_later(request):
    """Whether a test after this module's tests uses ``estimator_spark``."""
    items = request.session.items
    mine = [i for i, item in enumerate(items) if item.module is request.module]
    return any("estimator_spark" in item.fixturenames
               for item in items[(mine[-1] + 1 if mine else len(items)):])


@pytest.fixture(scope="module")
def digits(estimator_spark):
    """sklearn's digits as (train_df, test_df): 'features' Vector, 'label' long."""
    from pyspark.ml.linalg import Vectors
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.25,
                                                        random_state=0, stratify=y)

    def frame(xs, ys):
        rows = [(Vectors.dense(a.tolist()), int(b)) for a, b in zip(xs, ys)]
        return estimator_spark.createDataFrame(rows, ["features", "label"]).repartition(2)
    return frame(x_train, y_train), frame(x_test, y_test)


@pytest.fixture(scope="session", autouse=True)
def mlflow_tracking_uri(tmp_path_factory):
    """Every fit of these tests logs to MLflow (mlflow_log defaults to True) in a SQLite
    store of a temporary directory, never to MLflow's default ``./mlflow.db``; the notebooks'
    kernels inherit the variables.  The URI, or None without mlflow.

    A ``sqlite:`` store puts artifacts (the models) in ``./mlruns`` unless it runs in an
    MLflow server, whose artifact root MLflow passes in ``_MLFLOW_SERVER_ARTIFACT_ROOT``:
    that variable sends them to the temporary directory too, and the end of the session
    checks that no ``./mlruns`` appeared."""
    if importlib.util.find_spec("mlflow") is None:
        yield None
        return
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    had_mlruns = os.path.exists("mlruns")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.setenv("_MLFLOW_SERVER_ARTIFACT_ROOT", str(root / "artifacts"))
        yield uri
    assert had_mlruns or not os.path.exists("mlruns"), \
        f"MLflow wrote artifacts to {os.path.abspath('mlruns')}, not under {root}"


@pytest.fixture
def store(tmp_path):
    from spark_hvd.estimators import LocalStore
    return LocalStore(str(tmp_path / "store"))
