"""spark_hvd.spark.run from drivers in processes of their own: ``spark-submit`` of the
digits example on ``local-cluster[2,1,1024]``, and a Spark Connect session (``run``,
``run_elastic`` losing a worker, and TorchDistributor's barrier tasks training a DDP
program)."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SPARK_SUBMIT = Path(sys.executable).parent / "spark-submit"
FAST_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def _driver_env():
    env = dict(os.environ)
    env["PYSPARK_PYTHON"] = sys.executable
    env["PYSPARK_DRIVER_PYTHON"] = sys.executable
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _tail(proc, n=60):
    return "\n".join((proc.stdout + "\n" + proc.stderr).splitlines()[-n:])


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_spark_submit_of_the_digits_example():
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    if not SPARK_SUBMIT.exists():
        pytest.skip(f"no spark-submit next to {sys.executable}")
    env = _driver_env()
    cmd = [str(SPARK_SUBMIT), "--master", "local-cluster[2,1,1024]",
           "--conf", f"spark.executorEnv.PYTHONPATH={env['PYTHONPATH']}",
           "--conf", "spark.ui.enabled=false",
           "--conf", "spark.ui.showConsoleProgress=false",
           "--conf", f"spark.driver.extraJavaOptions={FAST_JVM}",
           "--conf", f"spark.executor.extraJavaOptions={FAST_JVM}",
           str(REPO / "examples" / "spark_run_digits.py"), "--epochs", "10"]
    proc = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True,
                          timeout=840)
    assert proc.returncode == 0, _tail(proc)
    lines = proc.stdout.splitlines()
    epochs = [ln for ln in lines if re.fullmatch(r"\[0\] epoch \d+/10 loss \d+\.\d+", ln)]
    assert len(epochs) == 10, _tail(proc)
    assert not [ln for ln in lines if ln.startswith("[1] epoch")]  # only rank 0 prints
    final = [ln for ln in lines if ln.startswith("ranks [0, 1]: final test accuracy")]
    assert final and float(final[0].split()[-1]) >= 0.9, _tail(proc)


CONNECT_DRIVER = textwrap.dedent("""
    import os
    from pyspark.sql import SparkSession
    import spark_hvd.spark
    from spark_hvd.exceptions import RankFailedError

    def scaled_rank(x):
        rank = int(os.environ["SPARK_HVD_RANK"])
        print("hello from", rank)
        return rank * x

    def fail_on_1():
        if os.environ["SPARK_HVD_RANK"] == "1":
            raise KeyError("no such weight")
        import time
        time.sleep(600)

    spark = SparkSession.builder.remote("local[2]").getOrCreate()
    print("CONNECT", type(spark).__module__)
    print("RESULTS", spark_hvd.spark.run(scaled_rank, args=(10,)))
    try:
        spark_hvd.spark.run(fail_on_1, num_proc=2, verbose=0)
    except RankFailedError as e:
        print("FAILED", str(e).splitlines()[0])

    # run_elastic's plain tasks under Connect: rank 1 SIGKILLs itself at step KILL_AT
    import json, sys
    sys.path.insert(0, {tests!r})
    import test_run_elastic as elastic_test
    marker = os.getcwd()  # the test's temporary directory
    results = spark_hvd.spark.run_elastic(elastic_test._train_losing_rank_1_once,
                                          args=(marker,), num_proc=2, min_num_proc=1,
                                          start_timeout=60, elastic_timeout=30, verbose=0)
    print("ELASTIC", json.dumps(results))

    # TorchDistributor's barrier tasks under Connect: an unchanged DDP program
    import cloudpickle, ddp_program
    cloudpickle.register_pickle_by_value(ddp_program)
    from spark_hvd.spark import TorchDistributor
    ddp = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
        ddp_program.train, 3)
    print("TORCH", json.dumps(ddp))
    spark.stop()
""")


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_spark_connect_session(tmp_path):
    from pyspark.testing.connectutils import connect_requirement_message, should_test_connect

    if not should_test_connect:  # grpcio, grpcio-status, googleapis-common-protos, zstandard
        pytest.skip(f"Spark Connect client dependencies missing: {connect_requirement_message}")
    script = tmp_path / "connect_driver.py"
    script.write_text(CONNECT_DRIVER.replace("{tests!r}", repr(str(Path(__file__).parent))))
    proc = subprocess.run([sys.executable, str(script)], env=_driver_env(), cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, _tail(proc)
    lines = proc.stdout.splitlines()
    assert "CONNECT pyspark.sql.connect.session" in lines, _tail(proc)
    assert "[0] hello from 0" in lines and "[1] hello from 1" in lines
    assert "RESULTS [0, 10]" in lines, _tail(proc)
    assert "FAILED spark_hvd.spark.run: rank 1 failed: KeyError: 'no such weight'" in lines, \
        _tail(proc)
    # the survivor went on alone from its commit at step KILL_AT (as on a classic session)
    from test_run_elastic import KILL_AT, STEPS
    elastic = [json.loads(ln[len("ELASTIC "):]) for ln in lines if ln.startswith("ELASTIC ")]
    import ddp_program  # TorchDistributor: the weights one process reaches on both batches
    ddp = [json.loads(ln[len("TORCH "):]) for ln in lines if ln.startswith("TORCH ")]
    assert ddp and (ddp[0]["rank"], ddp[0]["world"], ddp[0]["sum"]) == (0, 2, 1.0), _tail(proc)
    assert [pytest.approx(w, rel=1e-5, abs=1e-7) for w in ddp_program.reference(3, 2)] == \
        ddp[0]["weights"]
    assert elastic == [[{"rank": 0, "size": 1, "step": STEPS,
                         "total": 2.0 * KILL_AT + (STEPS - KILL_AT),
                         "starts": [[0, 2], [KILL_AT, 1]]}]], _tail(proc)
