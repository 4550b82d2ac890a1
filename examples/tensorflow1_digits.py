"""Horovod's classic TensorFlow 1 example on spark_hvd: graph mode through tf.compat.v1, a
small convnet on scikit-learn's 8x8 digits (bundled with scikit-learn, no download), trained
in a MonitoredTrainingSession with a tf.compat.v1.train optimizer.

    spark-hvdrun -np 2 python examples/tensorflow1_digits.py

What makes it distributed (the same steps as with Horovod):
  1. hvd.init(), and pin each process to its share of the machine (one GPU, or threads);
  2. each rank reads its own shard of the training data;
  3. the learning rate is scaled by the number of ranks (the global batch grows with it);
  4. hvd.DistributedOptimizer averages the gradients across ranks in minimize();
  5. hvd.BroadcastGlobalVariablesHook(0) starts every rank from rank 0's variables once
     the session is created (after initialization, or a restore from a checkpoint);
  6. StopAtStepHook stops after steps // size steps: each step trains size batches;
  7. only rank 0 writes checkpoints (checkpoint_dir is None elsewhere).
"""

import argparse

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import spark_hvd.tensorflow as hvd

v1 = tf.compat.v1


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600,
                   help="training steps of a single process (each rank runs steps // size)")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.002, help="single-process learning rate")
    p.add_argument("--threads", type=int, default=1, help="TensorFlow threads per rank (CPU)")
    p.add_argument("--checkpoint-dir", default="./checkpoints-tf1-digits")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def conv_model(images, labels):
    """conv 3x3 (32) -> max-pool -> dense 64 -> dense 10, from tf.compat.v1 variables."""
    def weight(name, shape):
        return v1.get_variable(name, shape, initializer=v1.glorot_uniform_initializer())

    def bias(name, size):
        return v1.get_variable(name, [size], initializer=v1.zeros_initializer())

    h = tf.nn.relu(tf.nn.conv2d(images, weight("conv_w", [3, 3, 1, 32]), 1, "SAME")
                   + bias("conv_b", 32))
    h = tf.reshape(tf.nn.max_pool2d(h, 2, 2, "VALID"), [-1, 4 * 4 * 32])
    h = tf.nn.relu(tf.matmul(h, weight("fc_w", [4 * 4 * 32, 64])) + bias("fc_b", 64))
    logits = tf.matmul(h, weight("out_w", [64, 10])) + bias("out_b", 10)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), labels), tf.float32))
    return loss, accuracy


def batches(x, y, batch_size, seed):
    """Endless shuffled batches of this rank's shard."""
    rng = np.random.RandomState(seed)
    while True:
        order = rng.permutation(len(x))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            idx = order[i:i + batch_size]
            yield x[idx], y[idx]


def main():
    args = parse_args()
    v1.disable_eager_execution()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    # 1. One GPU per process if there are GPUs, else a fixed share of the CPU.
    config = v1.ConfigProto(intra_op_parallelism_threads=args.threads,
                            inter_op_parallelism_threads=args.threads)
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        config.gpu_options.allow_growth = True
        config.gpu_options.visible_device_list = str(hvd.local_rank() % len(gpus))
    v1.set_random_seed(args.seed + rank)  # ranks start apart; step 5 fixes it

    # 2. This rank's shard of the training data; every rank keeps the whole test set.
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target.astype(np.int64), test_size=0.25, random_state=0)
    x_shard, y_shard = x_train[rank::size], y_train[rank::size]

    image = v1.placeholder(tf.float32, [None, 8, 8, 1], name="image")
    label = v1.placeholder(tf.int64, [None], name="label")
    loss, accuracy = conv_model(image, label)

    # 3. Scale the learning rate by the number of ranks.
    opt = v1.train.AdamOptimizer(args.lr * size)
    # 4. Average the gradients across ranks.
    opt = hvd.DistributedOptimizer(opt)
    global_step = v1.train.get_or_create_global_step()
    train_op = opt.minimize(loss, global_step=global_step)
    # Every rank holds the same weights at the end; the allreduce checks that they agree.
    test_accuracy = hvd.allreduce(accuracy, op=hvd.Average, name="test_accuracy")

    last_step = args.steps // size
    final = v1.train.FinalOpsHook(test_accuracy, {image: x_test, label: y_test})
    hooks = [
        hvd.BroadcastGlobalVariablesHook(0),         # 5.
        v1.train.StopAtStepHook(last_step=last_step),  # 6.
        final,
    ]
    checkpoint_dir = args.checkpoint_dir if rank == 0 else None  # 7.
    log_every = max(1, last_step // 10)
    train_batches = batches(x_shard, y_shard, args.batch_size, args.seed + rank)
    with v1.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir, hooks=hooks,
                                           config=config, save_summaries_steps=None,
                                           save_summaries_secs=None,
                                           log_step_count_steps=None) as sess:
        while not sess.should_stop():
            x, y = next(train_batches)
            _, step, loss_value = sess.run([train_op, global_step, loss],
                                           feed_dict={image: x, label: y})
            if rank == 0 and step % log_every == 0:
                print(f"step {step:4d}/{last_step}  loss {loss_value:.4f}", flush=True)

    if rank == 0:
        saved = tf.train.latest_checkpoint(checkpoint_dir)
        print(f"checkpoint: {saved}")
        print(f"test accuracy: {final.final_ops_values:.4f} ({size} ranks, global batch "
              f"{args.batch_size * size}, {last_step} steps)", flush=True)


if __name__ == "__main__":
    main()
