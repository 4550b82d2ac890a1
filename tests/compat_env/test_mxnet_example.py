"""examples/mxnet_digits.py at 2 ranks reaches >= 0.9 test accuracy, under spark-hvdrun and
under spark_hvd.spark.run (on the session's local[2] SparkSession)."""

import importlib.util
import os
import re
import sys

import cloudpickle

import _ranks

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "mxnet_digits.py")
EPOCHS = "4"
ENV = {"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1"}


def test_mxnet_digits_under_spark_hvdrun():
    proc = _ranks.hvdrun(2, [sys.executable, EXAMPLE, "--epochs", EPOCHS], env=ENV,
                         timeout=240)
    assert proc.returncode == 0, _ranks.output_tail(proc)
    found = re.findall(r"\[0\] test accuracy ([0-9.]+)", proc.stdout)
    assert found and float(found[-1]) >= 0.9, _ranks.output_tail(proc)


def test_mxnet_digits_under_spark_run(spark, monkeypatch):
    import spark_hvd.spark

    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    spec = importlib.util.spec_from_file_location("mxnet_digits", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "mxnet_digits", example)
    spec.loader.exec_module(example)
    cloudpickle.register_pickle_by_value(example)  # executors cannot import it by name
    args = example.parser.parse_args(["--epochs", EPOCHS])
    results = spark_hvd.spark.run(example.train, args=(args,), num_proc=2)
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["accuracy"] >= 0.9, results
