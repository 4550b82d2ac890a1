"""Horovod's MXNet MNIST example, on scikit-learn's bundled 8x8 digits (no download).

In the compat environment (`make compat`: MXNet 1.9.1 needs numpy < 1.24):

    .venv-compat/bin/spark-hvdrun -np 2 .venv-compat/bin/python examples/mxnet_digits.py
    .venv-compat/bin/python examples/mxnet_digits.py --spark 2     # spark_hvd.spark.run

The classic shape: init, a Gluon network, the learning rate scaled by the number of ranks,
DistributedTrainer, parameters broadcast from rank 0 (after their deferred initialisation),
each rank on its shard of the data, metrics averaged across ranks with allreduce.
"""

import argparse
import sys

parser = argparse.ArgumentParser(description="MXNet digits example")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank")
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--fp16-allreduce", action="store_true", help="fp16 compression")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--spark", type=int, default=0, metavar="N",
                    help="run N ranks with spark_hvd.spark.run on a local[N] SparkSession")


def train(args) -> dict:
    """One rank's training; returns its rank and the test accuracy averaged over ranks."""
    import mxnet as mx
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import spark_hvd.mxnet as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    mx.random.seed(args.seed + rank)  # different initial weights: the broadcast aligns them
    np.random.seed(args.seed)

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target.astype(np.float32), test_size=0.2, random_state=args.seed,
        stratify=digits.target)
    # Each rank trains on its shard; every rank takes the same number of steps.
    steps = len(x_train) // size // args.batch_size
    shard_x, shard_y = x_train[rank::size], y_train[rank::size]
    test_x, test_y = x_test[rank::size], y_test[rank::size]

    net = mx.gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(mx.gluon.nn.Conv2D(16, kernel_size=3, padding=1, activation="relu"))
        net.add(mx.gluon.nn.MaxPool2D(pool_size=2))
        net.add(mx.gluon.nn.Conv2D(32, kernel_size=3, padding=1, activation="relu"))
        net.add(mx.gluon.nn.MaxPool2D(pool_size=2))
        net.add(mx.gluon.nn.Flatten())
        net.add(mx.gluon.nn.Dense(64, activation="relu"))
        net.add(mx.gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier(magnitude=2.24))  # deferred: the input shape comes later
    net.hybridize()
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)  # at the first forward, after init

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    trainer = hvd.DistributedTrainer(
        params, "sgd", {"learning_rate": args.lr * size, "momentum": args.momentum},
        compression=compression, gradient_predivide_factor=args.gradient_predivide_factor)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()

    def accuracy(xs, ys):
        correct = (net(mx.nd.array(xs)).argmax(axis=1) == mx.nd.array(ys)).sum()
        total = hvd.allreduce(mx.nd.array([correct.asscalar(), len(ys)]), op=hvd.Sum,
                              name="accuracy")
        return float(total[0].asscalar() / total[1].asscalar())

    for epoch in range(args.epochs):
        order = np.random.RandomState(args.seed + epoch).permutation(len(shard_x))
        total_loss = 0.0
        for step in range(steps):
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            data, label = mx.nd.array(shard_x[idx]), mx.nd.array(shard_y[idx])
            with mx.autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(args.batch_size)
            total_loss += loss.mean().asscalar()
        epoch_loss = hvd.allreduce(mx.nd.array([total_loss / steps]), name="loss")
        train_acc = accuracy(shard_x, shard_y)
        if rank == 0:
            print(f"Epoch [{epoch}] loss {epoch_loss.asscalar():.4f} "
                  f"train accuracy {train_acc:.4f}", flush=True)

    test_acc = accuracy(test_x, test_y)
    if rank == 0:
        print(f"test accuracy {test_acc:.4f}", flush=True)
    hvd.shutdown()
    return {"rank": rank, "accuracy": test_acc}


def main(argv=None) -> int:
    args = parser.parse_args(argv)
    if not args.spark:
        train(args)
        return 0
    import os

    from pyspark.sql import SparkSession

    import spark_hvd.spark

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (SparkSession.builder.master(f"local[{args.spark}]")
             .appName("spark_hvd mxnet digits").config("spark.ui.enabled", "false")
             .getOrCreate())
    try:
        results = spark_hvd.spark.run(train, args=(args,), num_proc=args.spark)
    finally:
        spark.stop()
    accuracy = results[0]["accuracy"]
    print(f"ranks {[r['rank'] for r in results]}: test accuracy {accuracy:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
