"""Spark fixtures shared by tests/spark."""

import os
import sys

import pytest


@pytest.fixture(scope="session")
def spark_local():
    """One in-process ``local[2]`` SparkSession for the whole test session."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]")
             .appName("spark_hvd-tests-local")
             .config("spark.driver.extraJavaOptions",
                     "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
             .config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "4")
             .config("spark.default.parallelism", "2")
             .getOrCreate())
    yield spark
    spark.stop()
