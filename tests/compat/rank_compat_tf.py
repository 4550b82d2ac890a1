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


# -- independent collectives: asynchronous kernels hold no thread -------------------------

def _thread_pools_session(graph, pools):
    """A TF1 session of ``graph`` with one inter-op pool per entry of ``pools`` (threads);
    ``run(..., options=RunOptions(inter_op_thread_pool=i))`` runs on pool i, reusing the
    optimized graph."""
    from tensorflow.core.protobuf import config_pb2

    config = tf.compat.v1.ConfigProto(session_inter_op_thread_pool=[
        config_pb2.ThreadPoolOptionProto(num_threads=k) for k in pools])
    return tf.compat.v1.Session(graph=graph, config=config)


def check_tf_independent_collectives_complete_in_any_order():
    """200 allreduces and 50 allgathers with no data between them, named, each rank
    building them in its own order, in one tf.function (run eagerly on this process's one
    inter-op thread, and in sessions of 1, 2 and 8 threads) and in one TF1 graph (1, 2
    and 8 threads). A collective that held a thread while it waited (a host function)
    hangs here: each rank's threads wait in collectives the others have not started."""
    import random

    import numpy as np

    r, n = hvd.rank(), hvd.size()
    reduces, gathers, pools = 200, 50, (1, 2, 8)
    order = list(range(reduces + gathers))
    random.Random(r).shuffle(order)

    def build(x):
        outs = {}
        for k in order:
            if k < reduces:
                outs[k] = hvd.allreduce(x + float(k), op=hvd.Sum, name=f"compat.many.r{k}")
            else:
                rows = tf.fill([r + 1, 2], x[0] + float(k))
                outs[k] = hvd.allgather(rows, name=f"compat.many.g{k}")
        return [outs[k] for k in range(reduces + gathers)]

    def wrong(values):
        bad = [k for k in range(reduces) if not np.all(values[k] == n * k + n * (n - 1) / 2)]
        for k in range(reduces, reduces + gathers):
            want = np.concatenate([np.full([q + 1, 2], q + k, np.float32) for q in range(n)])
            if not np.array_equal(values[k], want):
                bad.append(k)
        return bad

    fn = tf.function(build)
    mine = np.full([3], r, np.float32)
    results = {"tf.function eager": wrong([v.numpy() for v in fn(tf.constant(mine))])}
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [3])
        fetches = {"tf.function": fn(x), "TF1 graph": build(x)}
        with _thread_pools_session(graph, pools) as session:
            for kind, outs in fetches.items():
                for pool, threads in enumerate(pools):
                    options = tf.compat.v1.RunOptions(inter_op_thread_pool=pool)
                    values = session.run(outs, {x: mine}, options=options)
                    results[f"{kind}, {threads} threads"] = wrong(values)
    assert not any(results.values()), {k: v for k, v in results.items() if v}


# -- Horovod's error classes ----------------------------------------------------------------

def _raised(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test looks at what it is
        return exc
    return None


def check_tf_errors_are_horovods_classes_eager_and_in_graphs():
    """A mismatch between ranks (shape, dtype, root rank, alltoall's trailing dimensions)
    is tf.errors.FailedPreconditionError and a bad argument found inside the op (alltoall
    splits adding up to more rows than the tensor has, a first dimension that does not
    divide evenly)
    tf.errors.InvalidArgumentError, as Horovod's TF ops raise them; eagerly the spark_hvd
    exception is the cause, in a tf.function it travels in the error's payloads; a TF1
    session keeps the class. The ranks go on with collectives afterwards."""
    from spark_hvd.exceptions import InvalidArgumentError, TensorMismatchError
    from spark_hvd.tensorflow._async import spark_error

    r, n = hvd.rank(), hvd.size()
    last = r == n - 1
    failed = tf.errors.FailedPreconditionError
    bad_arg = tf.errors.InvalidArgumentError
    cases = {  # name: (call, TF class, spark_hvd cause)
        "shape": (lambda nm: hvd.allreduce(tf.ones([5 if last else 3]), name=nm), failed,
                  TensorMismatchError),
        "dtype": (lambda nm: hvd.allreduce(tf.ones([3], tf.float64 if last else tf.float32),
                                           name=nm), failed, TensorMismatchError),
        "root": (lambda nm: hvd.broadcast(tf.ones([3]), n - 1 if last else 0, name=nm), failed,
                 TensorMismatchError),
        "a2a_dims": (lambda nm: hvd.alltoall(tf.ones([n, 3 if last else 2]), name=nm),
                     failed, TensorMismatchError),
        "a2a_sum": (lambda nm: hvd.alltoall(tf.ones([n, 2]), splits=[2] + [1] * (n - 1),
                                            name=nm)[0], bad_arg, InvalidArgumentError),
        "a2a_even": (lambda nm: hvd.alltoall(tf.ones([n + 1, 2]), name=nm), bad_arg,
                     InvalidArgumentError),
    }
    if n < 2:
        raise Skip("a mismatch between ranks needs 2 or more")
    problems = []
    for name, (call, tf_class, cause_class) in cases.items():
        eager = _raised(lambda: call(f"compat.err.{name}.eager"))
        if not (isinstance(eager, tf_class) and isinstance(eager.__cause__, cause_class)):
            problems.append(f"{name} eager: {type(eager)} caused by {type(eager.__cause__)}")
        graph = _raised(lambda: tf.function(lambda: call(f"compat.err.{name}.graph"))())
        if not (isinstance(graph, tf_class) and isinstance(spark_error(graph), cause_class)):
            problems.append(f"{name} tf.function: {type(graph)} ({graph})")
        g = tf.Graph()
        with g.as_default(), tf.compat.v1.Session(graph=g) as session:
            session_error = _raised(lambda: session.run(call(f"compat.err.{name}.session")))
        if not isinstance(session_error, tf_class):
            problems.append(f"{name} session: {type(session_error)} ({session_error})")
    after = hvd.allreduce(tf.fill([2], float(r + 1)), op=hvd.Sum, name="compat.err.after")
    assert not problems, problems
    assert after.numpy().tolist() == [n * (n + 1) / 2] * 2, after


def check_tf_sparse_ops_horovod_does_not_support_are_not_implemented():
    """Min, Max, Product and Adasum of tf.IndexedSlices, or a prescale or postscale factor
    with them, are NotImplementedError at the call (nothing reaches the other ranks), for
    allreduce and grouped_allreduce."""
    slices = tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 1]), tf.constant([4, 3]))
    dense = tf.ones([3])
    calls = []
    for op in (hvd.Min, hvd.Max, hvd.Product, hvd.Adasum):
        calls.append((f"op {op.name}", lambda op=op: hvd.allreduce(slices, op=op)))
        calls.append((f"grouped op {op.name}",
                      lambda op=op: hvd.grouped_allreduce([dense, slices], op=op)))
    for kw in ({"prescale_factor": 2.0}, {"postscale_factor": 0.5}):
        calls.append((f"allreduce {kw}", lambda kw=kw: hvd.allreduce(slices, **kw)))
        calls.append((f"grouped {kw}", lambda kw=kw: hvd.grouped_allreduce([slices, dense], **kw)))
    wrong = {what: repr(_raised(call)) for what, call in calls
             if not isinstance(_raised(call), NotImplementedError)}
    assert not wrong, wrong


# -- tf.IndexedSlices as Horovod reduces them -----------------------------------------------

def check_tf_indexed_slices_average_every_dtype_and_mixed_groups():
    """Average of IndexedSlices divides the allgathered values by the size with a true
    division, as Horovod's: integer values (uint8 included) come back as floats. A grouped
    allreduce of IndexedSlices and dense tensors gives each its own result, eagerly, in a
    tf.function and in a TF1 session."""
    import numpy as np

    r, n = hvd.rank(), hvd.size()
    problems = []
    for dtype in (tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64, tf.float16,
                  tf.bfloat16, tf.float32, tf.float64):
        values = tf.cast(tf.fill([2, 3], 2 * (r + 1)), dtype)
        avg = hvd.allreduce(tf.IndexedSlices(values, tf.constant([r, r]), tf.constant([n, 3])))
        want_dtype = (values / tf.cast(n, dtype)).dtype
        want = np.repeat([2.0 * (q + 1) / n for q in range(n)], 2)[:, None] * np.ones([1, 3])
        got = avg.values
        if got.dtype != want_dtype or not np.allclose(got.numpy().astype(np.float64), want,
                                                      rtol=1e-2):
            problems.append(f"{dtype.name}: {got.dtype.name} {got.numpy().tolist()}")
        if avg.indices.numpy().tolist() != [q for q in range(n) for _ in range(2)]:
            problems.append(f"{dtype.name} indices {avg.indices.numpy().tolist()}")

    def mixed(op):
        s = tf.IndexedSlices(tf.fill([1, 2], float(r + 1)), tf.constant([r]), tf.constant([n, 2]))
        d = tf.fill([2], float(r + 1))
        out = hvd.grouped_allreduce([d, s, 2 * d], op=op, name=f"compat.mixed.{op.name}")
        return out[0], out[1].values, out[1].indices, out[2]

    total = n * (n + 1) / 2
    for op in (hvd.Average, hvd.Sum):
        k = n if op == hvd.Average else 1
        want = ([total / k] * 2, [[(q + 1) / k] * 2 for q in range(n)], list(range(n)),
                [2 * total / k] * 2)
        runs = {"eager": mixed(op), "tf.function": tf.function(lambda: mixed(op))()}
        g = tf.Graph()
        with g.as_default(), tf.compat.v1.Session(graph=g) as session:
            runs["session"] = session.run(mixed(op))
        for where, got in runs.items():
            got = [np.asarray(t).tolist() for t in got]
            if not all(np.allclose(a, b) for a, b in zip(got, want)):
                problems.append(f"mixed {op.name} {where}: {got} != {want}")
    assert not problems, problems


# -- broadcast_ on variables ----------------------------------------------------------------

def check_tf_broadcast_inplace_leaves_the_roots_values():
    """hvd.broadcast_(variables, root) on resource variables (eagerly and in a tf.function)
    and on TF1 reference and resource variables (in a session), every dtype (bool and float16 too),
    every root: each rank's variables hold the root's values, and so do the returned
    tensors."""
    import numpy as np

    r, n = hvd.rank(), hvd.size()
    dtypes = (tf.bool, tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.uint8, tf.int8,
              tf.uint16, tf.int16, tf.int32, tf.int64)

    def value(q, dtype):
        return tf.cast(tf.constant([q % 2, q + 1, 3 * q + 2]), dtype)

    problems = []
    for root in range(n):
        want = {d: value(root, d).numpy().tolist() for d in dtypes}
        eager = [tf.Variable(value(r, d)) for d in dtypes]
        returned = hvd.broadcast_(eager, root, name=f"compat.bi.eager.{root}")
        graph_vars = [tf.Variable(value(r, d)) for d in dtypes]
        tf.function(lambda: hvd.broadcast_(graph_vars, root, name=f"compat.bi.fn.{root}"))()
        g = tf.Graph()
        with g.as_default():
            refs = [tf.compat.v1.Variable(value(r, d), use_resource=False) for d in dtypes]
            out = hvd.broadcast_(refs, root, name=f"compat.bi.ref.{root}")
            resources = [tf.compat.v1.Variable(value(r, d), use_resource=True) for d in dtypes]
            res_out = hvd.broadcast_(resources, root, name=f"compat.bi.res.{root}")
            with tf.compat.v1.Session(graph=g) as session:
                session.run(tf.compat.v1.global_variables_initializer())
                ref_out, res_out = session.run([out, res_out])
                ref_vals, res_vals = session.run([refs, resources])
        for i, d in enumerate(dtypes):
            got = {"eager": eager[i].numpy().tolist(), "returned": returned[i].numpy().tolist(),
                   "tf.function": graph_vars[i].numpy().tolist(),
                   "reference": np.asarray(ref_vals[i]).tolist(),
                   "reference returned": np.asarray(ref_out[i]).tolist(),
                   "TF1 resource": np.asarray(res_vals[i]).tolist(),
                   "TF1 resource returned": np.asarray(res_out[i]).tolist()}
            for where, v in got.items():
                if v != want[d]:
                    problems.append(f"root {root} {d.name} {where}: {v} != {want[d]}")
    assert not problems, problems


# -- alltoall: Horovod's splits and return values ----------------------------------------------

def check_tf_alltoall_splits_are_int32_as_horovods():
    """Horovod's alltoall op takes int32 splits only: int32 tensors, lists of ints and numpy
    integer arrays work, eagerly, in a tf.function and in a TF1 session, and the received
    splits are int32; a TensorFlow tensor of any other dtype (float32, int64, int16) and a
    list holding a float are a ValueError on every rank before anything is sent, and the job
    goes on in step. Without splits the result is the received rows alone (Horovod returns the
    pair only with splits), so it passes on as a tensor. As Horovod's, splits may cover fewer
    rows than the tensor has (the rest are not sent; their gradient is zero)."""
    import numpy as np

    r, n = hvd.rank(), hvd.size()
    sent = np.concatenate([np.full([j + 1, 2], 10 * r + j, np.float32) for j in range(n)])
    counts = [j + 1 for j in range(n)]
    want = [[float(10 * q + r)] * 2 for q in range(n) for _ in range(r + 1)]

    def run(where, call):
        if where == "eager":
            return call()
        if where == "tf.function":
            return tf.function(call)()
        g = tf.Graph()
        with g.as_default(), tf.compat.v1.Session(graph=g) as session:
            return session.run(call())

    splits = {"list": lambda: counts, "numpy int64": lambda: np.asarray(counts, np.int64),
              "numpy int32": lambda: np.asarray(counts, np.int32),
              "int32": lambda: tf.constant(counts, tf.int32)}
    refused = {"float32": lambda: tf.constant(counts, tf.float32),
               "int64": lambda: tf.constant(counts, tf.int64),
               "int16": lambda: tf.constant(counts, tf.int16),
               "list with a float": lambda: [float(counts[0])] + counts[1:]}
    problems = []
    for where in ("eager", "tf.function", "session"):
        for kind, s in splits.items():
            name = f"compat.a2a.{kind}.{where}"
            out, received = (np.asarray(t) for t in run(
                where, lambda: hvd.alltoall(tf.constant(sent), splits=s(), name=name)))
            if out.tolist() != want or received.tolist() != [r + 1] * n \
                    or received.dtype != np.int32:
                problems.append(f"{kind} {where}: {out.tolist()} {received!r}")
        for kind, s in refused.items():
            name = f"compat.a2a.refused.{kind}.{where}"
            error = _raised(lambda: run(
                where, lambda: hvd.alltoall(tf.constant(sent), splits=s(), name=name)))
            if not isinstance(error, ValueError) or "splits" not in str(error):
                problems.append(f"{kind} {where}: {type(error)} ({error})")
        alone = run(where, lambda: tf.size(hvd.alltoall(tf.ones([n, 2]) * float(r),
                                                        name=f"compat.a2a.alone.{where}")))
        if int(alone) != 2 * n:
            problems.append(f"without splits {where}: size {alone}")
    after = hvd.allreduce(tf.fill([2], float(r + 1)), op=hvd.Sum, name="compat.a2a.in_step")
    if after.numpy().tolist() != [n * (n + 1) / 2] * 2:
        problems.append(f"out of step after the refusals: {after}")
    # As Horovod's, splits may cover fewer rows than the tensor has: the rest are not sent,
    # and their gradient is zero.
    extra = tf.constant(np.concatenate([sent, np.full([2, 2], -1.0, np.float32)]))

    def short(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            out, received = hvd.alltoall(x, splits=counts, name="compat.a2a.short")
            loss = tf.reduce_sum(out) * float(r + 1)
        return out, received, tape.gradient(loss, x)

    want_grad = [[float(j + 1)] * 2 for j in range(n) for _ in range(j + 1)] + [[0.0] * 2] * 2
    for where, fn in (("eager", short), ("tf.function", tf.function(short))):
        out, received, grad = (np.asarray(t) for t in fn(extra))
        if out.tolist() != want or received.tolist() != [r + 1] * n \
                or grad.tolist() != want_grad:
            problems.append(f"fewer rows than the tensor {where}: {out.tolist()} "
                            f"{received.tolist()} {grad.tolist()}")
    assert not problems, problems


def check_tf_gradients_taken_separately_in_one_graph_have_names_of_their_own():
    """Gradients of one grouped_allgather's, grouped_reducescatter's and alltoall's outputs
    taken by separate tf.gradients calls in one TF1 graph (and by two calls of a persistent
    tape in a tf.function), run in one step: each gradient collective has a name of its own,
    as Horovod derives it from the op, so none is refused as 'already in flight', and each
    is what it would be alone."""
    import numpy as np

    r, n = hvd.rank(), hvd.size()
    mean = (n + 1) / 2  # the average of the ranks' weights r + 1

    def grads(separately):
        a = tf.constant(np.zeros([r + 1, 2], np.float32))
        b = tf.constant(np.zeros([2, 3], np.float32))
        c = tf.constant(np.zeros([2 * n, 2], np.float32))
        w = float(r + 1)

        def losses():
            ya, yb = hvd.grouped_allgather([a, b])
            _, zb = hvd.grouped_reducescatter([c[:n] + 1.0, c], op=hvd.Sum)
            yc, _ = hvd.alltoall(c, splits=[2] * n)
            return (tf.reduce_sum(ya) * w, tf.reduce_sum(yb) * 2 * w,
                    tf.reduce_sum(zb) * w, tf.reduce_sum(yc) * w)
        return separately(losses, (a, b, c))

    def with_tf_gradients(losses, xs):
        la, lb, lz, lc = losses()
        a, b, c = xs
        return (tf.gradients(la, a)[0], tf.gradients(lb, b)[0], tf.gradients(lz, c)[0],
                tf.gradients(lc, c)[0])

    def with_a_tape(losses, xs):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(xs)
            la, lb, lz, lc = losses()
        a, b, c = xs
        return (tape.gradient(la, a), tape.gradient(lb, b), tape.gradient(lz, c),
                tape.gradient(lc, c))

    # reducescatter (Sum): the allgather of the blocks' gradients (rank k's rows weigh k + 1)
    # times the size; alltoall: the rows sent to rank k come back with k's weight
    by_rank = np.repeat(np.arange(1, n + 1, dtype=np.float32), 2)[:, None] * np.ones([1, 2])
    want = [np.full([r + 1, 2], mean), np.full([2, 3], 2 * mean), by_rank * n, by_rank]
    g = tf.Graph()
    with g.as_default(), tf.compat.v1.Session(graph=g) as session:
        got = {"tf.gradients in a session": session.run(grads(with_tf_gradients))}
    got["a persistent tape in a tf.function"] = [
        t.numpy() for t in tf.function(lambda: grads(with_a_tape))()]
    problems = [f"{where} [{i}]: {np.asarray(v).tolist()}" for where, vs in got.items()
                for i, (v, w) in enumerate(zip(vs, want)) if not np.allclose(v, w)]
    assert not problems, problems


# -- allgathers of variable size in one graph --------------------------------------------------

def check_tf_fused_variable_size_allgathers_in_graphs():
    """Several allgathers whose first dimension differs per rank, independent of each other
    (the core fuses what it can), plus a grouped_allgather, in a tf.function and in a TF1
    session on one inter-op thread: every result is the ranks' rows in rank order."""
    import numpy as np

    r, n = hvd.rank(), hvd.size()

    def gathers(x):
        outs = [hvd.allgather(tf.fill([r + k, 2], x + float(k)), name=f"compat.vag.{k}")
                for k in range(4)]
        outs += hvd.grouped_allgather([tf.fill([r + 1], x), tf.fill([2 * r, 3], x + 1.0)],
                                      name="compat.vag.group")
        return outs

    def want(base):
        w = [np.concatenate([np.full([q + k, 2], base(q) + k, np.float32) for q in range(n)])
             for k in range(4)]
        w.append(np.concatenate([np.full([q + 1], base(q), np.float32) for q in range(n)]))
        w.append(np.concatenate([np.full([2 * q, 3], base(q) + 1, np.float32)
                                 for q in range(n)]))
        return w

    expected = want(lambda q: float(q))
    got = {"tf.function": [t.numpy() for t in tf.function(gathers)(tf.constant(float(r)))]}
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [])
        outs = gathers(x)
        with _thread_pools_session(g, (1,)) as session:
            got["TF1 session"] = session.run(outs, {x: float(r)})
    bad = [f"{where} #{i}" for where, vals in got.items()
           for i, (a, b) in enumerate(zip(vals, expected)) if not np.array_equal(a, b)]
    assert not bad, bad
