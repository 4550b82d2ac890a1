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


def check_tf_partial_distributed_keeps_local_layers_local():
    """PartialDistributedGradientTape / PartialDistributedOptimizer (Horovod's): the shared
    layer's gradient is the average over ranks, the local layer's this rank's own divided
    by the size (scale_local_gradients, the default) or as it is."""
    import numpy as np
    import keras

    import spark_hvd.tensorflow.keras as hvd_keras

    r, n = hvd.rank(), hvd.size()
    shared = keras.layers.Dense(2, use_bias=False, kernel_initializer="ones")
    local = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
    model = keras.Sequential([keras.Input((3,)), shared, local])
    x = tf.fill([1, 3], float((r + 1) ** 2))  # no rank's gradient is the average

    def own_grads():
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(model(x))
        return t, loss

    t, loss = own_grads()
    own = [g.numpy() for g in t.gradient(loss, model.trainable_variables)]
    mean_shared = hvd.allreduce(own[0], op=hvd.Average, name="compat.partial.ref").numpy()
    assert not np.allclose(mean_shared, own[0])  # the ranks' gradients differ
    for scale, want_local in ((True, own[1] / n), (False, own[1])):
        t, loss = own_grads()
        t = hvd.PartialDistributedGradientTape(t, local_layers=[local],
                                               scale_local_gradients=scale)
        got = [g.numpy() for g in t.gradient(loss, model.trainable_variables)]
        assert np.allclose(got[0], mean_shared), (got[0], mean_shared)
        assert np.allclose(got[1], want_local), (scale, got[1], want_local)
    before = [v.numpy() for v in model.trainable_variables]
    opt = hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=local)
    opt.apply([tf.constant(g) for g in own], model.trainable_variables)
    after = [v.numpy() for v in model.trainable_variables]
    assert np.allclose(after[0], before[0] - mean_shared), after[0]
    assert np.allclose(after[1], before[1] - own[1] / n), after[1]


def check_tf_sync_batch_normalization_uses_every_ranks_batch():
    """Training-mode output on each rank is Keras' BatchNormalization of the concatenated
    batch (ranks with batches of one size, as Horovod's averaging of moments assumes)."""
    import numpy as np
    import keras

    r, n = hvd.rank(), hvd.size()
    batches = [np.arange(12, dtype=np.float32).reshape(4, 3) * (q + 1) + q for q in range(n)]
    sync = hvd.SyncBatchNormalization(momentum=0.5)
    plain = keras.layers.BatchNormalization(momentum=0.5)
    got = sync(batches[r], training=True).numpy()
    full = plain(np.concatenate(batches), training=True).numpy()
    assert np.allclose(got, full[4 * r:4 * r + 4], atol=1e-5), (got, full[4 * r:4 * r + 4])
    assert np.allclose(sync.moving_mean.numpy(), plain.moving_mean.numpy(), atol=1e-5)
    assert np.allclose(sync.moving_variance.numpy(), plain.moving_variance.numpy(), rtol=1e-4)
    with tf.GradientTape() as tape:  # differentiable through the allreduce
        x = tf.constant(batches[r])
        tape.watch(x)
        loss = tf.reduce_sum(sync(x, training=True) * float(r + 1))
    assert tape.gradient(loss, x) is not None
