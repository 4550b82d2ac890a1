"""``make demo-cluster``: the demo's TorchEstimator fit on a cluster in a box.

The same digits CNN as ``make demo`` (examples/demo.py), trained by 8 processes on a
real Spark standalone cluster of 4 hosts: network namespaces joined by a bridge, each
with its own host name, address and a Spark Worker with 2 fake GPUs
(tests/cluster/box.py; needs root). The driver runs here, at the bridge's address. The
script prints which rank ran on which host (and GPU), the epochs and the test accuracy,
then removes the box.

    python examples/demo_cluster.py [--hosts 4] [--num-proc 8] [--epochs 12] [--rate 1gbit]
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

import cloudpickle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "cluster"))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import box as box_mod  # noqa: E402
import box_fit  # noqa: E402
import demo  # noqa: E402
from _box_spark import session_on, wait_executors  # noqa: E402

cloudpickle.register_pickle_by_value(demo)  # the executors cannot import examples/


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--num-proc", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--rate", default=None, help="cap each host's link (tc units: 1gbit)")
    args = parser.parse_args(argv)

    start = time.time()
    box = box_mod.up(hosts=args.hosts, rate=args.rate, spark=True)
    work = tempfile.mkdtemp(prefix="spark_hvd_demo_cluster_")
    try:
        print(f"box up in {time.time() - start:.1f}s: " + ", ".join(
            f"{h.name} {h.addr}" for h in box.hosts) + f"; Spark master {box.master_url}",
            flush=True)
        spark = session_on(box, "spark_hvd-demo-cluster")
        wait_executors(spark, box, box.names)
        print(f"driver at {box.driver_addr}, an executor on each of {', '.join(box.names)} "
              f"({time.time() - start:.1f}s)", flush=True)
        train_df, test_df = demo.digits_frames(spark, seed=0)

        import torch
        import torch.nn.functional as F

        from spark_hvd.estimators import LocalStore, TorchEstimator

        model = demo.make_model()
        marks = os.path.join(work, "marks")
        os.makedirs(marks)
        estimator = TorchEstimator(
            num_proc=args.num_proc, store=LocalStore(os.path.join(work, "store")), model=model,
            # the demo's rate at 2 ranks, scaled with the ranks (each step sees their batches)
            optimizer=torch.optim.Adam(model.parameters(), lr=1.5e-3 * args.num_proc),
            loss=F.cross_entropy,
            metrics=[demo.accuracy], feature_cols=["features"], label_cols=["label"],
            input_shapes=[[-1, 1, 8, 8]], batch_size=32, epochs=args.epochs, validation=0.1,
            random_seed=0, mlflow_log=False, callbacks=[box_fit.WhereRanksRun(marks)])
        fit_start = time.time()
        fitted = estimator.fit(train_df)
        print(f"fit: {time.time() - fit_start:.1f}s", flush=True)

        where = box_fit.launches(marks)[0]
        print("\nrank  host")
        for rank in sorted(where):
            print(f"{rank:>4}  {where[rank]}")
        history = fitted.getHistory()
        print("\nepoch  " + "  ".join(f"{k:>12}" for k in history))
        for i in range(len(history["loss"])):
            print(f"{i + 1:>5}  " + "  ".join(f"{history[k][i]:>12.4f}" for k in history))
        accuracy = box_fit.accuracy_of(fitted, test_df)
        print(f"\ntest accuracy: {accuracy:.4f}; {len(set(where.values()))} hosts, "
              f"{len(where)} ranks")
        spark.stop()
    finally:
        box_mod.down()
        shutil.rmtree(work, ignore_errors=True)
    print(f"total: {time.time() - start:.1f}s (the box is down)")
    return 0 if accuracy >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
