"""``make demo``: a TorchEstimator trained on scikit-learn's digits with spark_hvd.

A small CNN (the 64 pixels reshaped to 1x8x8 by ``input_shapes``) is trained by two
processes on a local Spark cluster (``local-cluster[2,1,1024]``: two executor JVMs, as on
a real cluster; ``--master 'local[2]'`` runs it inside the driver instead).  The
estimator validates the DataFrame, writes it as Parquet to the Store, trains with
spark_hvd.spark.run (rank 0's progress lines appear prefixed ``[0]``), and returns a
TorchModel that predicts through ``transform``.  The script prints each epoch's metrics
and the test accuracy, and saves the loss curves to demo_out/loss_curve.png.

    python examples/demo.py [--epochs 8] [--master 'local-cluster[2,1,1024]']
"""

import argparse
import os
import shutil
import sys
import time

OUT_DIR = "demo_out"
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def spark_session(master: str):
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession
    spark = (SparkSession.builder.master(master).appName("spark_hvd-demo")
             .config("spark.driver.extraJavaOptions", JVM_OPTIONS)
             .config("spark.executor.extraJavaOptions", JVM_OPTIONS)
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "4")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def digits_frames(spark, seed: int):
    """(train, test) DataFrames: 'features' (a Vector of 64 pixels in [0, 1]), 'label'."""
    from pyspark.ml.linalg import Vectors
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.25,
                                                        random_state=seed, stratify=y)

    def frame(xs, ys):
        rows = [(Vectors.dense(a.tolist()), int(b)) for a, b in zip(xs, ys)]
        return spark.createDataFrame(rows, ["features", "label"]).repartition(2)
    return frame(x_train, y_train), frame(x_test, y_test)


def make_model():
    import torch
    from torch import nn
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 2 * 2, 64), nn.ReLU(), nn.Linear(64, 10))


def accuracy(output, label):
    """Share of rows whose highest score is the label (a metric: averaged over all rows)."""
    return (output.argmax(dim=1) == label).float().mean()


def plot(history, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    epochs = range(1, len(history["loss"]) + 1)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(epochs, history["loss"], "o-", label="training loss")
    if "val_loss" in history:
        ax.plot(epochs, history["val_loss"], "s-", label="validation loss")
    ax.set_xlabel("epoch")
    ax.set_ylabel("cross-entropy")
    ax.set_title("TorchEstimator on digits (2 processes)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def mlflow_experiment() -> "str | None":
    """With MLflow installed and no tracking store configured, the demo's runs go to a
    sqlite store and artifacts under demo_out/ (not MLflow's defaults in the working
    directory); returns the experiment name to log into, None without MLflow."""
    try:
        import mlflow
    except ImportError:
        return None
    name = "spark_hvd-demo"
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        root = os.path.abspath(OUT_DIR)
        mlflow.set_tracking_uri(f"sqlite:///{root}/mlflow.db")
        if mlflow.get_experiment_by_name(name) is None:
            mlflow.create_experiment(name, artifact_location=f"file://{root}/mlruns")
    return name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local-cluster[2,1,1024]")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--num-proc", type=int, default=2)
    args = parser.parse_args(argv)

    start = time.time()
    import numpy as np
    import torch
    import torch.nn.functional as F

    from spark_hvd.estimators import LocalStore, TorchEstimator

    os.makedirs(OUT_DIR, exist_ok=True)
    store_dir = os.path.join(OUT_DIR, "store")
    shutil.rmtree(store_dir, ignore_errors=True)
    spark = spark_session(args.master)
    print(f"Spark {spark.version} on {args.master} ready in {time.time() - start:.1f}s",
          flush=True)
    train_df, test_df = digits_frames(spark, seed=0)

    experiment = mlflow_experiment()
    model = make_model()
    estimator = TorchEstimator(
        num_proc=args.num_proc, store=LocalStore(store_dir), model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=3e-3),
        loss=F.cross_entropy, metrics=[accuracy],
        feature_cols=["features"], label_cols=["label"], input_shapes=[[-1, 1, 8, 8]],
        batch_size=32, epochs=args.epochs, validation=0.1, random_seed=0,
        mlflow_log=experiment is not None, mlflow_experiment=experiment)
    fit_start = time.time()
    fitted = estimator.fit(train_df)
    print(f"fit: {time.time() - fit_start:.1f}s", flush=True)

    history = fitted.getHistory()
    print("\nepoch  " + "  ".join(f"{k:>12}" for k in history))
    for i in range(len(history["loss"])):
        print(f"{i + 1:>5}  " + "  ".join(f"{history[k][i]:>12.4f}" for k in history))

    scored = fitted.transform(test_df).select("label", "label__output").collect()
    predicted = np.array([np.argmax(r["label__output"].toArray()) for r in scored])
    truth = np.array([r["label"] for r in scored])
    test_accuracy = float(np.mean(predicted == truth))
    print(f"\ntest accuracy: {test_accuracy:.4f} on {len(truth)} held-out digits")

    if experiment is not None:
        import mlflow

        print(f"MLflow: experiment '{experiment}' at {mlflow.get_tracking_uri()} (mlflow ui "
              f"--backend-store-uri {mlflow.get_tracking_uri()})")
    png = os.path.join(OUT_DIR, "loss_curve.png")
    plot(history, png)
    print(f"loss curves: {png}")
    spark.stop()
    print(f"total: {time.time() - start:.1f}s")
    return 0 if test_accuracy >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
