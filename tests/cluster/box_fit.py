"""A TorchEstimator fit on the box: scikit-learn's digits, a small MLP, and a callback
that tells where each rank ran (and can hold every rank after an epoch, so that a test
can take a host away at a known point of the fit).

Executors import this module by name (tests/cluster is on their PYTHONPATH).
"""

import os
import socket
import time

EPOCHS = 3
RANKS = 2  # Spark gives a barrier stage's tasks one per executor first: 2 hosts
PAUSE_TIMEOUT_S = 300.0


def digits_arrays():
    """(x_train, x_test, y_train, y_test): scikit-learn's digits, pixels in [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    return train_test_split(x / 16.0, y, test_size=0.25, random_state=0, stratify=y)


def digits_frames(spark, partitions: int):
    """(train, test) DataFrames of 'features' (64 pixels in [0, 1]) and 'label'."""
    from pyspark.ml.linalg import Vectors

    x_train, x_test, y_train, y_test = digits_arrays()

    def frame(xs, ys):
        rows = [(Vectors.dense(a.tolist()), int(b)) for a, b in zip(xs, ys)]
        return spark.createDataFrame(rows, ["features", "label"]).repartition(partitions)
    return frame(x_train, y_train), frame(x_test, y_test)


def accuracy(output, label):
    return (output.argmax(dim=1) == label).float().mean()


class WhereRanksRun:
    """Each rank, when training begins, writes ``begin-<start epoch>-<rank>@<host>`` in
    ``mark_dir`` and prints where it runs. With ``pause_after=e``, on a first launch
    (start epoch 0) every rank writes ``paused-<rank>`` after epoch ``e`` (rank 0 has
    written its checkpoint by then) and waits for the file ``go``."""

    def __init__(self, mark_dir: str, pause_after=None) -> None:
        self.mark_dir, self.pause_after = mark_dir, pause_after
        self.start = self.rank = 0

    def _mark(self, name: str) -> None:
        open(os.path.join(self.mark_dir, name), "w").close()

    def on_train_begin(self, logs):
        self.start, self.rank = logs["start_epoch"], logs["rank"]
        host = socket.gethostname()
        self._mark(f"begin-{self.start}-{self.rank}@{host}")
        print(f"rank {self.rank} of {logs['size']} runs on {host} (from epoch {self.start})",
              flush=True)

    def on_epoch_end(self, epoch, logs):
        if epoch != self.pause_after or self.start != 0:
            return
        self._mark(f"paused-{self.rank}")
        go, deadline = os.path.join(self.mark_dir, "go"), time.monotonic() + PAUSE_TIMEOUT_S
        while not os.path.exists(go):  # the test's signal, through the shared disk
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {go} within {PAUSE_TIMEOUT_S} s")
            time.sleep(0.05)


def launches(mark_dir: str) -> dict:
    """{start epoch: {rank: host}} from the ``begin-`` marks."""
    out: dict = {}
    for name in os.listdir(mark_dir):
        if name.startswith("begin-"):
            _, start, where = name.split("-", 2)
            rank, host = where.split("@")
            out.setdefault(int(start), {})[int(rank)] = host
    return out


def estimator(store_dir: str, mark_dir: str, num_proc: int, **kw):
    import torch
    import torch.nn.functional as F

    from spark_hvd.estimators import LocalStore, TorchEstimator

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    args = dict(num_proc=num_proc, store=LocalStore(store_dir), model=net,
                optimizer=torch.optim.Adam(net.parameters(), lr=1e-2), loss=F.cross_entropy,
                metrics=[accuracy], feature_cols=["features"], label_cols=["label"],
                batch_size=32, epochs=EPOCHS, validation=0.1, random_seed=1, verbose=1,
                mlflow_log=False,
                callbacks=[WhereRanksRun(mark_dir, kw.pop("pause_after", None))])
    args.update(kw)
    return TorchEstimator(**args)


def local_accuracy(model) -> float:
    """The fitted model's accuracy on the held-out digits, run here (its torch module)."""
    import numpy as np
    import torch

    _, x_test, _, y_test = digits_arrays()
    with torch.no_grad():
        out = model.getModel().eval()(torch.tensor(x_test, dtype=torch.float32))
    return float(np.mean(out.argmax(dim=1).numpy() == y_test))


def accuracy_of(model, test_df) -> float:
    """The fitted model's accuracy on ``test_df`` through ``transform``."""
    import numpy as np

    scored = model.transform(test_df).select("label", "label__output").collect()
    predicted = np.array([np.argmax(r["label__output"].toArray()) for r in scored])
    return float(np.mean(predicted == np.array([r["label"] for r in scored])))
