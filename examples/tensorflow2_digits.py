"""Horovod's classic TensorFlow 2 example on spark_hvd: a small convnet on scikit-learn's
8x8 digits (bundled with scikit-learn, no download), trained with DistributedGradientTape.

    spark-hvdrun -np 2 python examples/tensorflow2_digits.py

What makes it distributed (the same five steps as with Horovod):
  1. hvd.init(), and pin each process to its share of the machine (one GPU, or threads);
  2. each rank reads its own shard of the training data;
  3. the learning rate is scaled by the number of ranks (the global batch grows with it);
  4. hvd.DistributedGradientTape averages the gradients across ranks;
  5. after the first step (when the optimizer's variables exist) rank 0's model and
     optimizer state are broadcast, so every rank continues from the same state.
Only rank 0 logs and writes checkpoints.
"""

import argparse
import os

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import spark_hvd.tensorflow as hvd


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=12, help="passes over each rank's shard")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.002, help="single-process learning rate")
    p.add_argument("--threads", type=int, default=1, help="TensorFlow threads per rank (CPU)")
    p.add_argument("--checkpoint-dir", default="./checkpoints-tf2-digits")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def main():
    args = parse_args()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    # 1. One GPU per process if there are GPUs, else a fixed share of the CPU.
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    keras.utils.set_random_seed(args.seed + rank)  # ranks start apart; step 5 fixes it

    # 2. This rank's shard of the training data; every rank keeps the whole test set.
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target.astype(np.int64), test_size=0.25, random_state=0)
    x_shard, y_shard = x_train[rank::size], y_train[rank::size]
    steps_per_epoch = len(x_shard) // args.batch_size
    dataset = (tf.data.Dataset.from_tensor_slices((x_shard, y_shard))
               .repeat().shuffle(1000, seed=args.seed + rank).batch(args.batch_size))

    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, activation="relu", padding="same"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # 3. Scale the learning rate by the number of ranks.
    opt = keras.optimizers.Adam(args.lr * size)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)

    @tf.function
    def training_step(x, y, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        # 4. Average the gradients across ranks.
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        # 5. Start every rank from rank 0's state, once the optimizer's variables exist.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    total_steps = args.epochs * steps_per_epoch
    for step, (x, y) in enumerate(dataset.take(total_steps)):
        loss = training_step(x, y, step == 0)
        if step % steps_per_epoch == 0 and rank == 0:
            print(f"step {step:4d}/{total_steps}  epoch {step // steps_per_epoch}  "
                  f"loss {float(loss):.4f}", flush=True)

    logits = model(x_test, training=False)
    correct = np.sum(np.argmax(logits, axis=1) == y_test)
    # Every rank holds the same weights; the allreduce checks that they agree.
    accuracy = float(hvd.allreduce(tf.constant(correct / len(y_test), tf.float64),
                                   op=hvd.Average, name="test_accuracy"))
    if rank == 0:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        path = checkpoint.save(os.path.join(args.checkpoint_dir, "ckpt"))
        print(f"checkpoint: {path}")
        print(f"test accuracy: {accuracy:.4f} ({size} ranks, global batch "
              f"{args.batch_size * size}, {total_steps} steps)", flush=True)


if __name__ == "__main__":
    main()
