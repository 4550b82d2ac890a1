"""Fit time of TorchEstimator, with MLflow logging on and off, against the same training
written by hand with pyspark's TorchDistributor + DDP, on the same Parquet.

Both train the same MLP (64 -> 128 -> 10, Adam, batch 128 per process, ``--epochs``
epochs, one torch thread per process) with 2 processes in one ``local-cluster[2,1,1024]``
session (two executor JVMs of one core) on the same rows:

* ``TorchEstimator.fit(df)``: validation, the driver's dry run, materialization, the
  spark.run launch, training with DistributedOptimizer, per-epoch metrics, checkpoints to
  the Store, the model back from the Store and, with ``mlflow_log=True`` (the default
  whenever mlflow is installed), the MLflow record (params, metrics, the model).  MLflow
  logs to a SQLite store in a temporary directory, created before the first fit (as a
  tracking server would exist).  A *cold* fit writes the Parquet (a new Store each time);
  a *warm* fit reuses it (the cache is keyed by the DataFrame's plan).  The first cold fit
  of the process also imports mlflow.
* ``TorchDistributor(num_processes=2, local_mode=False).run(train)``: ``train`` is what a
  user writes by hand: ``init_process_group("gloo")``, read this rank's share of the very
  Parquet files the estimator materialized with pyarrow, a DataLoader, DDP, the same loop;
  rank 0 returns the state_dict and its own timings.

Each repetition runs, in this order: a cold fit, a warm fit with MLflow, a warm fit without,
the distributor; min and median of each are printed, with where the time went (the fit's
``fit_seconds``; for the distributor the launch, rank 0's set-up and its training).
Targets: warm fit (MLflow on) <= 0.35x TorchDistributor, cold fit <= 0.6x.

    .venv/bin/python bench/fit_e2e.py [--rows 60000] [--epochs 3] [--reps 3]
"""

import argparse
import glob
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _spark import mlp, session

WIDTH, HIDDEN, CLASSES = 64, 128, 10


def data(spark, rows: int):
    """64 uniform features as array<float>; the label is a function of the first two."""
    from pyspark.sql import functions as F
    feats = F.array(*[F.rand(i).cast("float") for i in range(WIDTH)])
    df = (spark.range(rows, numPartitions=4).select(feats.alias("features"))
          .withColumn("label", (F.floor(F.col("features")[0] * 5) * 2
                                + F.floor(F.col("features")[1] * 2)).cast("long")))
    df = df.cache()
    df.count()
    return df


def distributor_train(files, epochs: int, batch_size: int):
    """Hand-written DDP training on the Parquet files (runs in each TorchDistributor rank);
    rank 0 returns (state_dict, {"setup": s, "training": s})."""
    import time

    import numpy as np
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    started = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    table = pq.read_table(files, columns=["features", "label"])
    n = table.num_rows
    lo, hi = rank * n // world, (rank + 1) * n // world   # this rank's contiguous share
    table = table.slice(lo, hi - lo)
    x = np.asarray(table.column("features").combine_chunks().flatten()).reshape(-1, 64)
    y = table.column("label").to_numpy()
    loader = DataLoader(TensorDataset(torch.from_numpy(x.astype(np.float32)),
                                      torch.from_numpy(y)),
                        batch_size=batch_size, shuffle=True, drop_last=False)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 10)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ready = time.perf_counter()
    for epoch in range(epochs):
        total = torch.zeros(2)
        for xb, yb in loader:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item() * len(yb), len(yb)])
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {total[0] / total[1]:.4f}", flush=True)
    seconds = {"setup": ready - started, "training": time.perf_counter() - ready}
    state = {k: v.clone() for k, v in model.module.state_dict().items()} if rank == 0 else None
    dist.destroy_process_group()
    return (state, seconds) if rank == 0 else None


def summary(times):
    """``min / median`` of a list of seconds."""
    return f"min {min(times):6.1f}s  median {statistics.median(times):6.1f}s"


def breakdown(parts):
    """The median of each phase over the runs' ``{phase: seconds}``."""
    keys = [k for k in parts[0] if k != "total"]
    return ", ".join(f"{k} {statistics.median(p.get(k, 0.0) for p in parts):.1f}"
                     for k in keys)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=60_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--master", default="local-cluster[2,1,1024]")
    args = parser.parse_args(argv)

    import logging

    root = tempfile.mkdtemp(prefix="spark_hvd_bench_fit_")
    # MLflow's store in the temporary directory (never ./mlflow.db), made before timing.
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{os.path.join(root, 'mlflow.db')}"
    os.environ["_MLFLOW_SERVER_ARTIFACT_ROOT"] = os.path.join(root, "artifacts")

    import torch
    import torch.nn.functional as F
    from pyspark.ml.torch.distributor import TorchDistributor

    from spark_hvd.estimators import LocalStore, TorchEstimator

    logging.getLogger("TorchDistributor").setLevel(logging.ERROR)
    logging.getLogger("mlflow").setLevel(logging.ERROR)
    spark = session(args.master, "fit")
    df = data(spark, args.rows)
    warm_store = LocalStore(os.path.join(root, "store"))
    mlflow_on = importlib.util.find_spec("mlflow") is not None
    if mlflow_on:
        subprocess.run([sys.executable, "-c", "import mlflow; mlflow.search_experiments()"],
                       check=True, capture_output=True)  # creates the tables, in a child
    print(f"{args.rows} rows x {WIDTH} features, MLP {WIDTH}-{HIDDEN}-{CLASSES}, "
          f"{args.epochs} epochs, batch {args.batch_size}, 2 processes on {args.master}; "
          f"MLflow {'installed' if mlflow_on else 'not installed'}; load "
          f"{os.getloadavg()[0]:.1f}", flush=True)

    def fit(run_id: str, store, mlflow_log: bool):
        net = mlp(WIDTH, HIDDEN, CLASSES)
        est = TorchEstimator(num_proc=2, store=store, model=net,
                             optimizer=torch.optim.Adam(net.parameters(), lr=1e-3),
                             loss=F.cross_entropy, feature_cols=["features"],
                             label_cols=["label"], batch_size=args.batch_size,
                             epochs=args.epochs, run_id=run_id, verbose=0,
                             mlflow_log=mlflow_log)
        start = time.perf_counter()
        model = est.fit(df)
        took = time.perf_counter() - start
        print(f"  fit {run_id:<14} {took:6.1f}s  ({breakdown([model.fit_seconds])})  loss "
              f"{model.getHistory()['loss'][-1]:.4f}", flush=True)
        return took, model.fit_seconds

    def distributor():
        files = sorted(glob.glob(os.path.join(warm_store.prefix, "intermediate_train_data",
                                              "*", "*=train", "*.parquet")))
        start = time.perf_counter()
        state, seconds = TorchDistributor(num_processes=2, local_mode=False,
                                          use_gpu=False).run(
            distributor_train, files, args.epochs, args.batch_size)
        took = time.perf_counter() - start
        assert state is not None and "0.weight" in state
        parts = dict(launch=took - seconds["setup"] - seconds["training"], **seconds)
        print(f"  TorchDistributor.run   {took:6.1f}s  ({breakdown([parts])})", flush=True)
        return took, parts

    runs = {"cold": [], "warm": [], "warm, MLflow off": [], "TorchDistributor": []}
    try:
        first_cold = fit("cold_0", warm_store, mlflow_on)  # imports, workers, page cache
        distributor()  # warm-up of the distributor's path
        for i in range(args.reps):
            cold_store = LocalStore(os.path.join(root, f"cold_store_{i + 1}"))
            runs["cold"].append(fit(f"cold_{i + 1}", cold_store, mlflow_on))
            runs["warm"].append(fit(f"warm_{i}", warm_store, mlflow_on))
            runs["warm, MLflow off"].append(fit(f"warm_off_{i}", warm_store, False))
            runs["TorchDistributor"].append(distributor())
        base = statistics.median(t for t, _ in runs["TorchDistributor"])
        base_min = min(t for t, _ in runs["TorchDistributor"])
        print(f"first fit of the process (cold, imports mlflow): {first_cold[0]:6.1f}s "
              f"({breakdown([first_cold[1]])})")
        for name, found in runs.items():
            times = [t for t, _ in found]
            ratio = statistics.median(times) / base
            print(f"{name:<17} {summary(times)}  median/median {ratio:5.2f}"
                  f"  min/min {min(times) / base_min:5.2f}   ({breakdown([p for _, p in found])})")
        for name, target in (("warm", 0.35), ("cold", 0.6)):
            ratio = statistics.median(t for t, _ in runs[name]) / base
            print(f"{name} fit (MLflow {'on' if mlflow_on else 'not installed'}) / "
                  f"TorchDistributor = {ratio:.3f} median (target <= {target}): "
                  f"{'met' if ratio <= target else 'NOT met'}")
        print(f"load at the end {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
