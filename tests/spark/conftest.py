"""Spark fixtures shared by tests/spark."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

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


# -- local-cluster --------------------------------------------------------------------
#
# A process holds one SparkContext, so the local-cluster session cannot share a pytest
# process with `spark_local` (which other modules start first).  Tests marked
# `local_cluster` therefore run in a pytest process of their own: in the outer
# process, the first such test starts one child pytest for all of them (with
# LOCAL_CLUSTER_ENV set), and each test then reports the outcome its twin had there
# (pytest_pyfunc_call below), so results stay per test.  The `spark_cluster` fixture
# yields None in the outer process, where the test bodies never run.

LOCAL_CLUSTER_ENV = "PYTEST_SPARK_HVD_LOCAL_CLUSTER"
_OUTCOMES_ENV = "PYTEST_SPARK_HVD_OUTCOMES"
CLUSTER_SUITE_TIMEOUT_S = 600
# Each executor's CUDA_VISIBLE_DEVICES; the fake discovery script gives every executor
# GPU address "0", so a rank pinned to its GPU sees the first of these.
EXECUTOR_VISIBLE_DEVICES = "3,5"
_outcomes_key = pytest.StashKey[dict]()


def in_cluster_process() -> bool:
    return os.environ.get(LOCAL_CLUSTER_ENV) == "1"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "local_cluster: uses the local-cluster SparkSession `spark_cluster`; runs "
                   "in a pytest process of its own (see tests/spark/conftest.py)")


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory):
    """One ``local-cluster[2,1,1024]`` SparkSession: two executor JVMs of one core, each
    with a fake GPU (address "0") and CUDA_VISIBLE_DEVICES=EXECUTOR_VISIBLE_DEVICES.

    None outside the cluster process (see above).
    """
    if not in_cluster_process():
        yield None
        return
    tmp = tmp_path_factory.mktemp("local_cluster")
    script = tmp / "discover_gpu.sh"
    script.write_text("#!/bin/sh\necho '{\"name\":\"gpu\",\"addresses\":[\"0\"]}'\n")
    script.chmod(0o755)
    repo = str(Path(__file__).resolve().parents[2])
    pythonpath = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
    os.environ["PYTHONPATH"] = pythonpath
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master("local-cluster[2,1,1024]")
               .appName("spark_hvd-tests-local-cluster")
               .config("spark.driver.extraJavaOptions",
                       "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
               .config("spark.executor.extraJavaOptions",
                       "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.executorEnv.PYTHONPATH", pythonpath)
               .config("spark.executorEnv.CUDA_VISIBLE_DEVICES", EXECUTOR_VISIBLE_DEVICES))
    for scope in ("worker", "executor"):
        builder = (builder.config(f"spark.{scope}.resource.gpu.amount", "1")
                   .config(f"spark.{scope}.resource.gpu.discoveryScript", str(script)))
    spark = builder.config("spark.task.resource.gpu.amount", "1").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    yield spark
    spark.stop()


def pytest_runtest_logreport(report):
    """In the cluster process: record each test's outcome for the outer process."""
    path = os.environ.get(_OUTCOMES_ENV)
    if not path or (report.when != "call" and report.passed):
        return
    if report.skipped and isinstance(report.longrepr, tuple):
        text = report.longrepr[2]
    else:
        text = report.longreprtext
    with open(path, "a") as f:
        f.write(json.dumps({"nodeid": report.nodeid, "when": report.when,
                            "outcome": report.outcome, "text": text}) + "\n")


def _cluster_outcomes(session) -> dict:
    """Runs every selected local_cluster test in one child pytest; outcomes by node id."""
    if _outcomes_key in session.stash:
        return session.stash[_outcomes_key]
    nodeids = [item.nodeid for item in session.items if item.get_closest_marker("local_cluster")]
    root = session.config.rootpath
    outcomes: dict = {"__output__": ""}
    fd, name = tempfile.mkstemp(prefix="spark_hvd_cluster_outcomes_", suffix=".jsonl")
    os.close(fd)
    out_file = Path(name)
    env = dict(os.environ, **{LOCAL_CLUSTER_ENV: "1", _OUTCOMES_ENV: str(out_file)})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", *nodeids]
    try:
        proc = subprocess.run(cmd, cwd=str(root), env=env, capture_output=True, text=True,
                              timeout=CLUSTER_SUITE_TIMEOUT_S)
        outcomes["__output__"] = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:  # its output is bytes whatever text= says
        partial = (e.stdout or b"").decode("utf-8", "replace")
        outcomes["__output__"] = (f"the local-cluster pytest process did not finish within "
                                  f"{CLUSTER_SUITE_TIMEOUT_S} s\n{partial}")
    for line in out_file.read_text().splitlines():
        record = json.loads(line)
        outcomes.setdefault(record["nodeid"], []).append(record)
    out_file.unlink()
    session.stash[_outcomes_key] = outcomes
    return outcomes


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Outside the cluster process, a local_cluster test reports its twin's outcome."""
    if in_cluster_process() or pyfuncitem.get_closest_marker("local_cluster") is None:
        return None
    outcomes = _cluster_outcomes(pyfuncitem.session)
    records = outcomes.get(pyfuncitem.nodeid)
    if not records:
        tail = "\n".join(outcomes["__output__"].splitlines()[-60:])
        pytest.fail(f"did not run in the local-cluster pytest process; its output ends:\n{tail}",
                    pytrace=False)
    for record in records:
        if record["outcome"] == "failed":
            pytest.fail(f"[in the local-cluster process, {record['when']}]\n{record['text']}",
                        pytrace=False)
    for record in records:
        if record["outcome"] == "skipped":
            pytest.skip(record["text"])
    return True
