"""TorchEstimator(use_gpu=True) on a local-cluster Spark with the machine's GPU (part of
run_gpu_checks.sh; CI has no GPU). One executor with one GPU address, found by a
discovery script; the estimator's rank trains on cuda:0 and the fitted model transforms.
Prints ``PASS``/``FAIL``/``SKIP estimator_gpu ...``; exit 1 on FAIL.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time


def main() -> int:
    try:
        import torch
        from pyspark.sql import SparkSession
        from sklearn.datasets import load_digits
    except ImportError as e:
        print(f"SKIP estimator_gpu {e}")
        return 0
    if not torch.cuda.is_available() or shutil.which("java") is None:
        print("SKIP estimator_gpu needs a CUDA device and java")
        return 0
    from spark_hvd.estimators import Store, TorchEstimator

    tmp = tempfile.mkdtemp(prefix="shvd_gpu_est_")
    script = os.path.join(tmp, "gpus.sh")
    with open(script, "w") as f:
        f.write('#!/bin/sh\necho \'{"name": "gpu", "addresses": ["0"]}\'\n')
    os.chmod(script, 0o755)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    builder = (SparkSession.builder.master("local-cluster[1,1,2048]")
               .config("spark.ui.enabled", "false")
               .config("spark.task.resource.gpu.amount", "1"))
    for scope in ("worker", "executor"):
        builder = (builder.config(f"spark.{scope}.resource.gpu.amount", "1")
                   .config(f"spark.{scope}.resource.gpu.discoveryScript", script))
    spark = builder.getOrCreate()
    try:
        digits = load_digits()
        rows = [(digits.data[i].tolist(), int(digits.target[i])) for i in range(len(digits.data))]
        df = spark.createDataFrame(rows, "features array<double>, label long")
        train, test = df.randomSplit([0.8, 0.2], seed=1)
        net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        est = TorchEstimator(num_proc=1, model=net, optimizer=torch.optim.Adam(net.parameters(), 1e-2),
                             loss=torch.nn.functional.cross_entropy, feature_cols=["features"],
                             label_cols=["label"], batch_size=64, epochs=5, use_gpu=True,
                             store=Store.create(os.path.join(tmp, "store")), verbose=1)
        start = time.monotonic()
        model = est.fit(train)
        seconds = time.monotonic() - start
        out = model.transform(test).toPandas()
        pred = out[model.getOutputCols()[0]].map(lambda v: int(max(range(len(v)), key=v.__getitem__)))
        acc = float((pred == out["label"]).mean())
        detail = json.dumps({"accuracy": round(acc, 3), "fit_s": round(seconds, 1)})
        print(f"{'PASS' if acc > 0.85 else 'FAIL'} estimator_gpu {detail}", flush=True)
        return 0 if acc > 0.85 else 1
    except Exception as e:  # noqa: BLE001 - reported
        import traceback

        traceback.print_exc()
        print(f"FAIL estimator_gpu {type(e).__name__}: {e}")
        return 1
    finally:
        spark.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
