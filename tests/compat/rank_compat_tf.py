"""TensorFlow rank functions for test_compat_ranks.py (3 ranks; skip below)."""

import tensorflow as tf

import spark_hvd.tensorflow as hvd


class Skip(Exception):
    pass


def check_tf_process_set_broadcast_root_is_a_global_rank():
    r, n = hvd.rank(), hvd.size()
    if n < 3:
        raise Skip("a process set that leaves rank 0 out needs 3 ranks")
    members, root = [1, n - 1], n - 1
    ps = hvd.add_process_set(members)
    try:
        if r in members:
            want = [float(root * 10)] * 3
            got = hvd.broadcast(tf.fill([3], float(r * 10)), root, name="compat.tf.b",
                                process_set=ps)
            assert got.numpy().tolist() == want, got
            v = tf.Variable(tf.fill([3], float(r * 10)))
            hvd.broadcast_variables([v], root, process_set=ps)
            assert v.numpy().tolist() == want, v
            x = tf.Variable(tf.fill([3], float(r)))
            with tf.GradientTape() as tape:
                y = tf.reduce_sum(hvd.broadcast(x, root, name="compat.tf.g", process_set=ps))
            grad = tape.gradient(y, x).numpy().tolist()
            assert grad == [1.0 if r == root else 0.0] * 3, grad  # the average, on the root
            assert hvd.broadcast_object(r, root, process_set=ps) == root
    finally:
        hvd.remove_process_set(ps)
