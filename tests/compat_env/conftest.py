"""tests/compat_env runs in the compat environment (``make compat``: .venv-compat, with
MXNet 1.9.1, numpy 1.23, pyarrow 14, petastorm 0.13.1); `make test` runs it there. Under
any other interpreter these files are not collected: that environment cannot import them.

One spark-hvdrun launch per rank count runs every MXNet rank function (rank_mxnet.py)."""

import importlib.util
import os
import sys

import pytest

if importlib.util.find_spec("mxnet") is None or importlib.util.find_spec("petastorm") is None:
    collect_ignore_glob = ["*.py"]
else:
    HERE = os.path.dirname(os.path.abspath(__file__))
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import _ranks
    import mxnet_harness

    _RUNS = {}

    def ranks_run(np: int) -> _ranks.ChecksRun:
        if np not in _RUNS:
            _RUNS[np] = mxnet_harness.run_specs(mxnet_harness.specs("rank_mxnet.py"), np=np)
        return _RUNS[np]

    @pytest.fixture(scope="session", params=[1, 2, 3], ids=lambda n: f"np{n}")
    def mx_ranks(request):
        return ranks_run(request.param)

    @pytest.fixture(scope="session")
    def spark():
        """One local[2] SparkSession for the modules that need one (one JVM start)."""
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        os.environ["PYSPARK_PYTHON"] = sys.executable
        from pyspark.sql import SparkSession

        session = (SparkSession.builder.master("local[2]").appName("spark_hvd-compat")
                   .config("spark.ui.enabled", "false")
                   .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1")
                   .config("spark.sql.shuffle.partitions", "2").getOrCreate())
        yield session
        session.stop()


def pytest_configure(config):
    # petastorm 0.13.1 uses pyarrow's legacy ParquetDataset attributes on every read.
    config.addinivalue_line("filterwarnings", "ignore::FutureWarning")
