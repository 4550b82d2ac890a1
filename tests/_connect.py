"""Runs a Spark Connect driver in a process of its own (``remote("local[2]")`` starts a
local Connect server, which a process cannot hold beside a classic session) and returns
the dict ``out`` it printed as its last ``RESULT <json>`` line; the test asserts on it.

The driver is ``PRELUDE`` (the session, whether transform relabels Vectors there, the
digits DataFrame ``df``, a 64-row ``probe`` of its features, a Store under ``tmp``,
``outputs(model, frame=probe)`` and the torch module's ``forward``), then the test's own
body, then ``spark.stop()`` and the RESULT line."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HELPERS = REPO / "tests" / "estimators"  # est_helpers, lightning_net

PRELUDE = """\
import json, sys
import numpy as np
sys.path.insert(0, {helpers!r})
from pyspark.ml.linalg import Vectors
from pyspark.sql import SparkSession
from sklearn.datasets import load_digits

import est_helpers
from spark_hvd.estimators import Store

tmp = {tmp!r}
spark = SparkSession.builder.remote("local[2]").getOrCreate()
out = {{"session": type(spark).__module__, "version": spark.version}}
# No driver JVM: transform keeps vector_to_array and array_to_vector (VectorColumns).
from spark_hvd.estimators._predict_udf import VectorColumns
out["relabels"] = VectorColumns(spark.range(1)).relabels
x, y = load_digits(return_X_y=True)
rows = [(Vectors.dense((a / 16.0).tolist()), int(b)) for a, b in zip(x[:720], y[:720])]
df = spark.createDataFrame(rows, ["features", "label"]).repartition(2)
feats = np.array([r["features"].toArray() for r in
                  df.orderBy("label").limit(64).select("features").collect()])
probe = spark.createDataFrame([(Vectors.dense(f.tolist()),) for f in feats], ["features"])
store = Store.create(tmp + "/store")


def outputs(model, frame=probe):
    return np.array([r["label__output"] for r in model.transform(frame).collect()])


def forward(module):
    import torch
    with torch.no_grad():
        return module.eval()(torch.tensor(feats, dtype=torch.float32)).numpy()

"""

EPILOGUE = """
spark.stop()
print("RESULT " + json.dumps(out))
"""


def run_driver(body: str, tmp: Path, timeout_s: float, **env_extra: str) -> dict:
    """Writes PRELUDE + ``body`` (dedented) + EPILOGUE to ``tmp`` and runs it there."""
    script = tmp / "connect_driver.py"
    script.write_text(PRELUDE.format(helpers=str(HELPERS), tmp=str(tmp))
                      + textwrap.dedent(body) + EPILOGUE)
    from pyspark.testing.connectutils import connect_requirement_message, should_test_connect
    assert should_test_connect, f"Spark Connect client dependencies: {connect_requirement_message}"
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               **env_extra)
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=str(tmp),
                          capture_output=True, text=True, timeout=timeout_s)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
    assert proc.returncode == 0, tail
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, tail
    return json.loads(lines[-1][len("RESULT "):])
