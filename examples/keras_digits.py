"""Horovod's classic Keras example on spark_hvd: a small convnet on scikit-learn's 8x8
digits (no download), trained with ``model.fit`` and Horovod's Keras callbacks.

    spark-hvdrun -np 2 python examples/keras_digits.py

A script written for ``import horovod.tensorflow.keras as hvd`` (or ``horovod.keras``)
runs with only that import changed. What makes it distributed:
  1. hvd.init(), and pin each process to one GPU or a share of the CPU;
  2. each rank reads its own shard of the training data;
  3. the learning rate is scaled by the number of ranks, and warmed up to it over the first
     epochs (LearningRateWarmupCallback);
  4. hvd.DistributedOptimizer averages the gradients across ranks;
  5. BroadcastGlobalVariablesCallback(0) starts every rank from rank 0's weights, and
     MetricAverageCallback averages the epoch's metrics over the ranks.
Only rank 0 prints progress and writes checkpoints.
"""

import argparse
import os

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import spark_hvd.tensorflow.keras as hvd


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=12, help="passes over each rank's shard")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.002, help="single-process learning rate")
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="TensorFlow threads per rank (CPU)")
    p.add_argument("--checkpoint-dir", default="./checkpoints-keras-digits")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def main():
    args = parse_args()
    hvd.init()

    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    keras.utils.set_random_seed(args.seed + hvd.rank())  # the broadcast makes them agree

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target.astype(np.int64), test_size=0.25, random_state=0)
    x_shard, y_shard = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]

    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, activation="relu", padding="same"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(args.lr * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=args.lr * hvd.size(),
                                                 warmup_epochs=args.warmup_epochs,
                                                 verbose=1 if hvd.rank() == 0 else 0),
    ]
    if hvd.rank() == 0:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        callbacks.append(keras.callbacks.ModelCheckpoint(
            os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")))

    model.fit(x_shard, y_shard, batch_size=args.batch_size, epochs=args.epochs,
              callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)

    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    # Every rank holds the same weights: the average of their accuracies is each one's.
    mean = float(hvd.allreduce(np.array([accuracy]), name="test_accuracy")[0])
    if hvd.rank() == 0:
        print(f"test accuracy: {mean:.4f} ({hvd.size()} ranks, global batch "
              f"{args.batch_size * hvd.size()})", flush=True)


if __name__ == "__main__":
    main()
