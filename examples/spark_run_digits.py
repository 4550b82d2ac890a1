"""Train a small MLP on scikit-learn's digits with spark_hvd.spark.run (2 ranks).

Each rank trains on its shard of the training set; after every backward pass the
ranks average their gradients with ``spark_hvd.allreduce`` on numpy arrays, so every
rank takes the same optimizer step.  Rank 0 prints the loss of each epoch and the
accuracy on the held-out test set.

    spark-submit --master local-cluster[2,1,1024] examples/spark_run_digits.py
    spark-submit --master 'local[2]' examples/spark_run_digits.py --epochs 20

The executors need torch, scikit-learn and spark_hvd importable (same Python, or
PYTHONPATH through ``--conf spark.executorEnv.PYTHONPATH=...``).
"""

import argparse
import sys


def train(epochs: int, lr: float, batch_size: int, seed: int) -> dict:
    """One rank's training; returns its final loss and the test accuracy."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import spark_hvd as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(1)
    torch.manual_seed(seed)  # the same initial weights on every rank

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25,
                                                        random_state=seed, stratify=y)
    x_shard = torch.from_numpy(x_train[rank::size])
    y_shard = torch.from_numpy(y_train[rank::size]).long()

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    # Every rank takes the same number of steps: the shards differ by at most one row.
    steps = -(-(len(x_train) // size) // batch_size)
    generator = torch.Generator().manual_seed(seed + rank)

    for epoch in range(epochs):
        order = torch.randperm(len(x_shard), generator=generator)
        total = 0.0
        for step in range(steps):
            idx = order[step * batch_size:(step + 1) * batch_size]
            optimizer.zero_grad()
            loss = loss_fn(model(x_shard[idx]), y_shard[idx])
            loss.backward()
            for i, p in enumerate(model.parameters()):
                grad = hvd.allreduce(p.grad.numpy(), op=hvd.Average, name=f"grad.{i}")
                p.grad.copy_(torch.from_numpy(grad))
            optimizer.step()
            total += loss.item()
        epoch_loss = float(hvd.allreduce(np.array([total / steps]), op=hvd.Average,
                                         name="epoch_loss")[0])
        if rank == 0:
            print(f"epoch {epoch + 1}/{epochs} loss {epoch_loss:.4f}", flush=True)

    with torch.no_grad():
        predicted = model(torch.from_numpy(x_test)).argmax(dim=1).numpy()
    accuracy = float((predicted == y_test).mean())
    if rank == 0:
        print(f"test accuracy {accuracy:.4f}", flush=True)
    return {"rank": rank, "loss": epoch_loss, "accuracy": accuracy}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from pyspark.sql import SparkSession

    import spark_hvd.spark

    spark = SparkSession.builder.appName("spark_hvd digits").getOrCreate()
    try:
        results = spark_hvd.spark.run(train, args=(args.epochs, args.lr, args.batch_size,
                                                   args.seed), num_proc=args.num_proc)
    finally:
        spark.stop()
    accuracy = results[0]["accuracy"]
    print(f"ranks {[r['rank'] for r in results]}: final test accuracy {accuracy:.4f}")
    return 0 if accuracy >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
