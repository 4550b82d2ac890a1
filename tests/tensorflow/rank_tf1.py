"""Rank checks: TensorFlow 1 graph mode (tf.compat.v1) with ``spark_hvd.tensorflow``.

Every check builds its own ``tf.Graph`` and runs it in a v1 Session or a
MonitoredTrainingSession, with different data on each rank. The model is a quadratic,
loss ``0.5 * |v - t|^2`` with this rank's targets ``t``, so a gradient is ``v - t`` and the
average over the ranks is ``v - mean(t)``: the expected values are worked out here in numpy.
"""

import os
import shutil
import tempfile

import numpy as np
import tensorflow as tf

import spark_hvd.tensorflow as hvd

v1 = tf.compat.v1
V0 = np.array([1.0, -2.0, 3.0], np.float32)
LR = 0.1


def rn():
    return hvd.rank(), hvd.size()


def targets(rank, step):
    """This rank's targets at a step: no rank's gradient is the average."""
    return np.array([rank + 1.0, -2.0 * rank, 0.5 * step + rank * rank], np.float32)


def mean_targets(step, size):
    return np.mean([targets(q, step) for q in range(size)], axis=0)


def assert_same_on_every_rank(value, what):
    values = hvd.allgather_object(np.asarray(value))
    for q, other in enumerate(values):
        np.testing.assert_array_equal(other, values[0], err_msg=f"{what}: rank {q} != rank 0")


def train_quadratic(optimizer, steps, v0=V0, **dist):
    """Trains v on this rank's targets in a TF1 graph with hvd.DistributedOptimizer;
    returns (v after each step, global_step)."""
    with tf.Graph().as_default():
        v = v1.get_variable("v", initializer=tf.constant(v0))
        t = v1.placeholder(tf.float32, [3])
        loss = 0.5 * tf.reduce_sum(tf.square(v - t))
        step_var = v1.train.get_or_create_global_step()
        train_op = hvd.DistributedOptimizer(optimizer(), **dist).minimize(
            loss, global_step=step_var)
        with v1.Session() as sess:
            sess.run([v1.global_variables_initializer(), v1.local_variables_initializer()])
            values = []
            for step in range(steps):
                sess.run(train_op, {t: targets(hvd.rank(), step)})
                values.append(sess.run(v))
            return values, int(sess.run(step_var))


def reference(optimizer, steps, size, grad=lambda v, m, n: v - m):
    """The same training alone, on the gradient the ranks' reduction gives."""
    with tf.Graph().as_default():
        v = v1.get_variable("v", initializer=tf.constant(V0))
        m = v1.placeholder(tf.float32, [3])
        g = grad(v, m, size)
        train_op = optimizer().apply_gradients([(g, v)])
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            values = []
            for step in range(steps):
                sess.run(train_op, {m: mean_targets(step, size)})
                values.append(sess.run(v))
            return values


def check_v1_gradient_descent_averages_gradients():
    r, n = rn()
    values, step = train_quadratic(lambda: v1.train.GradientDescentOptimizer(LR), 4)
    v = V0.astype(np.float64)
    for s in range(4):  # by hand: v -= lr * mean over ranks of (v - t)
        v = v - LR * (v - mean_targets(s, n))
        np.testing.assert_allclose(values[s], v, rtol=1e-5, err_msg=f"step {s}")
    assert step == 4, step
    assert_same_on_every_rank(values[-1], "v")


def check_v1_momentum_sum_and_adam_predivide_match_a_single_process():
    r, n = rn()
    # op=Sum: the gradient is n * v - sum(t)
    momentum = lambda: v1.train.MomentumOptimizer(0.05, momentum=0.9)  # noqa: E731
    got, _ = train_quadratic(momentum, 3, op=hvd.Sum)
    want = reference(momentum, 3, n, grad=lambda v, m, k: k * (v - m))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_same_on_every_rank(got[-1], "momentum v")
    # gradient_predivide_factor splits the averaging: the same result as Average
    adam = lambda: v1.train.AdamOptimizer(0.1)  # noqa: E731
    got, _ = train_quadratic(adam, 3, gradient_predivide_factor=2.0,
                             compression=hvd.Compression.none)
    np.testing.assert_allclose(got, reference(adam, 3, n), rtol=1e-5)
    assert_same_on_every_rank(got[-1], "adam v")


def check_v1_sparse_gradients_with_a_dense_one_in_one_step():
    """An embedding's tf.IndexedSlices gradient (allgathered, or reduced as dense) next to a
    dense one: every collective of the step runs in order in the session."""
    r, n = rn()
    ids = np.array([r % 4, (r + 1) % 4, 3], np.int32)
    results = []
    for sparse_as_dense in (False, True):
        with tf.Graph().as_default():
            table = v1.get_variable("table", initializer=tf.ones([4, 2]))
            w = v1.get_variable("w", initializer=tf.constant([1.0, -1.0]))
            rows = tf.gather(table, ids)
            loss = tf.reduce_sum(rows * w * float(r + 1)) + tf.reduce_sum(w * w) * float(r)
            opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(LR),
                                           sparse_as_dense=sparse_as_dense)
            grads_and_vars = opt.compute_gradients(loss)
            assert isinstance(grads_and_vars[0][0], tf.IndexedSlices) != sparse_as_dense
            train_op = opt.apply_gradients(grads_and_vars)
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                sess.run(train_op)
                results.append(sess.run([table, w]))
    want_table = np.ones((4, 2))
    for q in range(n):  # d loss / d table row i = (q + 1) * w for every id q looks up
        for i in (q % 4, (q + 1) % 4, 3):
            want_table[i] -= LR * (q + 1) * np.array([1.0, -1.0]) / n
    want_w = np.array([1.0, -1.0]) - LR * np.mean(
        [3 * (q + 1) * np.ones(2) + 2 * q * np.array([1.0, -1.0]) for q in range(n)], axis=0)
    for table_value, w_value in results:
        np.testing.assert_allclose(table_value, want_table, rtol=1e-5)
        np.testing.assert_allclose(w_value, want_w, rtol=1e-5)
    assert_same_on_every_rank(results[0][0], "table")


def check_v1_backward_passes_per_step_accumulates():
    r, n = rn()
    gd = lambda: v1.train.GradientDescentOptimizer(LR)  # noqa: E731
    for average in (False, True):
        values, step = train_quadratic(gd, 4, backward_passes_per_step=2,
                                       average_aggregated_gradients=average)
        v = V0.astype(np.float64)
        for s in (0, 2):  # passes s and s+1 see the same v; applied on the second
            total = (v - mean_targets(s, n)) + (v - mean_targets(s + 1, n))
            np.testing.assert_allclose(values[s], v, rtol=1e-5, err_msg=f"pass {s} applied")
            v = v - LR * total / (2 if average else 1)
            np.testing.assert_allclose(values[s + 1], v, rtol=1e-5, err_msg=f"pass {s + 1}")
        assert step == 4, step  # global_step counts every pass, as in Horovod
        assert_same_on_every_rank(values[-1], "v")
    try:
        hvd.DistributedOptimizer(gd(), backward_passes_per_step=2)  # eager
    except ValueError as exc:
        assert "graph mode" in str(exc), exc
    else:
        raise AssertionError("backward_passes_per_step=2 eagerly did not raise")


def check_v1_collective_and_its_gradient_in_one_run():
    """tf.gradients through each collective, fetched with the collective's own output: the
    gradient's collective runs after the forward one in the session."""
    r, n = rn()
    weights = [float(q + 2) for q in range(n)]
    cases = {  # expected gradient of sum(op(x)) * weight: Horovod's rules
        "allreduce": (lambda x: hvd.allreduce(x, op=hvd.Sum), sum(weights)),
        "allgather": (lambda x: hvd.allgather(tf.reshape(x, [1, 2])), np.mean(weights)),
        "broadcast": (lambda x: hvd.broadcast(x, root_rank=n - 1),
                      np.mean(weights) if r == n - 1 else 0.0)}
    for kind, (op, want) in cases.items():
        with tf.Graph().as_default():
            x = v1.get_variable("x", initializer=tf.fill([2], float(r + 1)))
            loss = tf.reduce_sum(op(x)) * weights[r]
            (grad,) = tf.gradients(loss, [x])
            nodes = [op for op in v1.get_default_graph().get_operations()
                     if op.type in ("PyFunc", "EagerPyFunc")]
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                _, got = sess.run([loss, grad])
        np.testing.assert_allclose(got, [want, want], rtol=1e-6, err_msg=kind)
        for before, node in zip(nodes, nodes[1:]):  # each collective waits for the last
            assert before in node.control_inputs, (kind, node.name, node.control_inputs)


def check_v1_model_with_collectives_trained_in_a_session():
    """Collectives inside the model (one after another); DistributedOptimizer reduces after
    their gradients, the loss is fetched in the same run."""
    r, n = rn()
    weights = [float(q + 2) for q in range(n)]
    root, lr = n - 1, 0.01
    with tf.Graph().as_default():
        x = v1.get_variable("x", initializer=tf.ones([2]))
        summed = hvd.allreduce(x * weights[r], op=hvd.Sum)  # sum(w) * x on every rank
        gathered = hvd.allgather(tf.reshape(summed, [1, 2]))  # n such rows
        from_root = hvd.broadcast(gathered * weights[r], root_rank=root)
        loss = tf.reduce_sum(from_root) * weights[r]
        train_op = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(lr)).minimize(loss)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            first_loss = sess.run(loss)
            sess.run([train_op, loss])
            got = sess.run(x)
    w_root, w_mean = weights[root], np.mean(weights)
    np.testing.assert_allclose(first_loss, weights[r] * w_root * n * 2 * sum(weights),
                               rtol=1e-6)
    # by hand, backwards: broadcast -> mean(w) at the root; allgather -> its average over
    # the ranks (w_root * mean(w) / n); Sum-allreduce -> n times that, times this rank's
    # weight; the optimizer averages over the ranks: w_root * mean(w) ** 2
    np.testing.assert_allclose(got, 1.0 - lr * w_root * w_mean ** 2, rtol=1e-5)
    assert_same_on_every_rank(got, "x")


def check_broadcast_global_variables_in_a_graph():
    r, n = rn()
    root = n - 1
    with tf.Graph().as_default():
        a = v1.get_variable("a", initializer=tf.fill([3], float(r + 1)))
        b = v1.Variable(tf.fill([2, 2], 10.0 * (r + 1)), use_resource=False, name="b")
        c = v1.get_variable("c", initializer=tf.constant(r, tf.int64))
        bcast = hvd.broadcast_global_variables(root)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(bcast)
            got = sess.run([a, b, c])
    np.testing.assert_array_equal(got[0], [root + 1.0] * 3)
    np.testing.assert_array_equal(got[1], np.full((2, 2), 10.0 * (root + 1)))
    assert got[2] == root, got[2]
    try:
        hvd.broadcast_global_variables(0)  # eager: says what to use instead
    except RuntimeError as exc:
        assert "broadcast_variables(" in str(exc), exc
    else:
        raise AssertionError("broadcast_global_variables eagerly did not raise")


def check_hook_starts_every_rank_from_rank_0_under_monitored_training_session():
    r, n = rn()
    ckpt = tempfile.mkdtemp(prefix="tf1-ckpt-") if r == 0 else None
    v_start = V0 + 10.0 * r  # each rank initializes its own values
    try:
        with tf.Graph().as_default():
            v = v1.get_variable("v", initializer=tf.constant(v_start))
            t = v1.placeholder(tf.float32, [3])
            loss = 0.5 * tf.reduce_sum(tf.square(v - t))
            step_var = v1.train.get_or_create_global_step()
            opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(LR))
            train_op = opt.minimize(loss, global_step=step_var)
            final = v1.train.FinalOpsHook([v, step_var])
            hooks = [hvd.BroadcastGlobalVariablesHook(0), v1.train.StopAtStepHook(last_step=3),
                     final]
            steps = 0
            with v1.train.MonitoredTrainingSession(checkpoint_dir=ckpt, hooks=hooks,
                                                   save_summaries_steps=None,
                                                   save_summaries_secs=None) as sess:
                start = sess.run(v)
                while not sess.should_stop():
                    sess.run(train_op, {t: targets(r, steps)})
                    steps += 1
        final_v, final_step = final.final_ops_values
        np.testing.assert_array_equal(start, V0)  # rank 0's initial values
        v = V0.astype(np.float64)
        for s in range(3):
            v = v - LR * (v - mean_targets(s, n))
        np.testing.assert_allclose(final_v, v, rtol=1e-5)
        assert steps == 3 and final_step == 3, (steps, final_step)
        assert_same_on_every_rank(final_v, "v")
        if r == 0:
            saved = tf.train.latest_checkpoint(ckpt)
            assert saved is not None and saved.endswith("-3"), os.listdir(ckpt)
    finally:
        if ckpt:
            shutil.rmtree(ckpt, ignore_errors=True)
