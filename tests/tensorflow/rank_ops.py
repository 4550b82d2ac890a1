"""Rank checks: collectives on tf tensors, eager and in tf.function, values and gradients.

Rank r of n builds its inputs from r and compares with closed forms in r and n, so each
check holds at 1, 2 and 3 ranks. Collectives first, assertions last (see tf_harness).
"""

import numpy as np
import tensorflow as tf

import keras
import spark_hvd.tensorflow as hvd
import spark_hvd.tensorflow.keras as khvd
from spark_hvd.exceptions import InvalidArgumentError, TensorMismatchError

DTYPES = [tf.float32, tf.float64, tf.int32, tf.bfloat16, tf.float16]
EXACT_EXTRA = [tf.int64, tf.uint8, tf.int8, tf.bool, tf.uint32]  # bit-exact ops only
FLOATS = [tf.float32, tf.float64]


def rn():
    return hvd.rank(), hvd.size()


def same(actual, expected, what="", tol=0.0):
    actual = tf.convert_to_tensor(actual)
    expected = tf.convert_to_tensor(expected)
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a = actual.numpy().astype(np.float64) if actual.dtype != tf.bool else actual.numpy()
    e = expected.numpy().astype(np.float64) if expected.dtype != tf.bool else expected.numpy()
    if tol:
        np.testing.assert_allclose(a, e, rtol=tol, atol=tol, err_msg=what)
    else:
        np.testing.assert_array_equal(a, e, err_msg=what)


def base(shape, dtype):
    """1s and 2s."""
    n = int(np.prod(shape))
    return tf.cast(tf.reshape(tf.range(n) % 2 + 1, shape), dtype)


def const(value, shape, dtype):
    return tf.cast(tf.fill(shape, value), dtype)


# -- every op, every dtype, eager and graph ------------------------------------------

def run_ops(dtype):
    """Every collective on inputs built from rank; returns a dict of outputs."""
    r, n = rn()
    x = base((3, 4), dtype) * tf.cast(2 * (r + 1), dtype)
    out = {}
    for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max):
        out[f"allreduce_{op.name}"] = hvd.allreduce(x, op=op)
    out["allreduce_product"] = hvd.allreduce(base((3, 4), dtype), op=hvd.Product)
    out["allreduce_scalar"] = hvd.allreduce(tf.cast(r + 1, dtype), op=hvd.Sum)
    out["grouped"] = hvd.grouped_allreduce([x, base((5,), dtype)], op=hvd.Sum)
    rows = tf.reshape(tf.range(r + 1), [-1, 1]) + tf.range(3)
    out["allgather"] = hvd.allgather(tf.cast(rows + 10 * r, dtype))
    out["allgather_scalar"] = hvd.allgather(tf.cast(r, dtype))
    out["allgather_empty"] = hvd.allgather(tf.zeros([0 if r == 0 else 1, 2], dtype))
    out["broadcast"] = hvd.broadcast(x, root_rank=n - 1)
    sent = tf.concat([const(10 * r + j, [j + 1, 2], dtype) for j in range(n)], 0)
    out["alltoall"] = hvd.alltoall(sent, splits=[j + 1 for j in range(n)])
    out["alltoall_even"] = hvd.alltoall(tf.cast(tf.reshape(tf.range(2 * n) + 10 * r, [2 * n, 1]),
                                                dtype))
    m = tf.cast(tf.reshape(tf.range(2 * n + 1) + 1, [-1, 1]) * tf.ones([1, 2], tf.int32), dtype)
    out["reducescatter_avg"] = hvd.reducescatter(m * tf.cast(2 * (r + 1), dtype))
    out["reducescatter_sum"] = hvd.reducescatter(m, op=hvd.Sum)
    out["grouped_allgather"] = hvd.grouped_allgather([tf.cast(rows + 10 * r, dtype),
                                                      tf.cast(r, dtype)])
    out["grouped_reducescatter"] = hvd.grouped_reducescatter([m, m * tf.cast(2, dtype)],
                                                             op=hvd.Sum)
    return out


def expected_ops(dtype):
    r, n = rn()
    b = base((3, 4), dtype)
    c = lambda v: tf.cast(v, dtype)  # noqa: E731
    exp = {
        "allreduce_SUM": b * c(n * (n + 1)),
        "allreduce_AVERAGE": b * c(n + 1),
        "allreduce_MIN": b * c(2),
        "allreduce_MAX": b * c(2 * n),
        "allreduce_product": tf.cast(base((3, 4), tf.float64) ** n, dtype),
        "allreduce_scalar": c(n * (n + 1) // 2),
        "grouped": [b * c(n * (n + 1)), base((5,), dtype) * c(n)],
        "allgather": tf.concat([c(tf.reshape(tf.range(q + 1), [-1, 1]) + tf.range(3) + 10 * q)
                                for q in range(n)], 0),
        "allgather_scalar": c(tf.range(n)),
        "allgather_empty": tf.zeros([n - 1, 2], dtype),
        "broadcast": b * c(2 * n),
        "alltoall": (tf.concat([const(10 * j + r, [r + 1, 2], dtype) for j in range(n)], 0),
                     tf.constant([r + 1] * n, tf.int32)),
        # without splits, as Horovod's: the received rows alone
        "alltoall_even": c(tf.reshape(tf.stack([tf.range(2 * r, 2 * r + 2) + 10 * j
                                                for j in range(n)]), [2 * n, 1])),
    }
    rows = 2 * n + 1
    counts = [rows // n + (1 if q < rows % n else 0) for q in range(n)]
    start = sum(counts[:r])
    mine = tf.reshape(tf.range(start, start + counts[r]) + 1, [-1, 1]) * tf.ones([1, 2], tf.int32)
    exp["reducescatter_avg"] = c(mine) * c(n + 1)
    exp["reducescatter_sum"] = c(mine) * c(n)
    exp["grouped_allgather"] = [exp["allgather"], exp["allgather_scalar"]]
    exp["grouped_reducescatter"] = [c(mine) * c(n), c(mine) * c(2 * n)]
    return exp


def compare_all(got, exp, what):
    assert set(got) == set(exp), f"{what}: {sorted(got)} != {sorted(exp)}"
    for k in exp:
        g, e = got[k], exp[k]
        if isinstance(e, (list, tuple)):
            assert len(g) == len(e), f"{what}/{k}: {len(g)} results"
            for i, (gi, ei) in enumerate(zip(g, e)):
                same(gi, ei, f"{what}/{k}[{i}]")
        else:
            same(g, e, f"{what}/{k}")


def check_every_op_every_dtype_eager():
    got = {d.name: run_ops(d) for d in DTYPES}
    for d in DTYPES:
        compare_all(got[d.name], expected_ops(d), f"eager {d.name}")


def check_every_op_every_dtype_in_tf_function():
    fn = tf.function(run_ops)
    got = {d.name: fn(d) for d in DTYPES}
    again = fn(tf.float32)  # second call of the traced function: same names, cached
    for d in DTYPES:
        compare_all(got[d.name], expected_ops(d), f"graph {d.name}")
    compare_all(again, expected_ops(tf.float32), "graph float32, second call")


def check_graph_shapes_are_static_where_known():
    r, n = rn()
    fn = tf.function(lambda x: (hvd.allreduce(x), hvd.allgather(x), hvd.broadcast(x, 0),
                                hvd.alltoall(x), hvd.reducescatter(x)))
    graph = fn.get_concrete_function(tf.TensorSpec([4 * n, 3], tf.float32)).graph
    shapes = [t.shape.as_list() for t in graph.structured_outputs]
    assert shapes == [[4 * n, 3], [None, 3], [4 * n, 3], [None, 3], [4, 3]], shapes


def check_bit_exact_ops_on_more_dtypes():
    r, n = rn()
    got, exp = {}, {}
    for d in EXACT_EXTRA:
        x = tf.cast(tf.reshape(tf.range(6) % 3 + r, [3, 2]) > 0, d) if d == tf.bool else \
            tf.cast(tf.reshape(tf.range(6) + r, [3, 2]), d)
        got[d.name] = (hvd.broadcast(x, n - 1), hvd.allgather(x), hvd.alltoall(
            tf.concat([x] * n, 0)))
        xs = [tf.cast(tf.reshape(tf.range(6) % 3 + q, [3, 2]) > 0, d) if d == tf.bool else
              tf.cast(tf.reshape(tf.range(6) + q, [3, 2]), d) for q in range(n)]
        exp[d.name] = (xs[n - 1], tf.concat(xs, 0), tf.concat(xs, 0))
    for k in exp:
        for i in range(3):
            same(got[k][i], exp[k][i], f"{k}[{i}]")


def check_unsupported_dtype_is_a_clear_error():
    try:
        hvd.allreduce(tf.constant(["a"]))
    except InvalidArgumentError as exc:
        assert "not supported" in str(exc), str(exc)
    else:
        raise AssertionError("a string tensor was accepted")
    try:
        hvd.allreduce(tf.constant([1], tf.uint32))
    except InvalidArgumentError:
        pass
    else:
        raise AssertionError("allreduce of uint32 was accepted")


def check_prescale_postscale_and_average_flag():
    r, n = rn()
    x = tf.constant([1.0, 2.0]) * (r + 1)
    scaled = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    avg_flag = hvd.allreduce(x, average=True)
    sum_flag = hvd.allreduce(x, average=False)
    total = n * (n + 1) / 2
    same(scaled, tf.constant([1.0, 2.0]) * total * 1.5, "pre/post")
    same(avg_flag, tf.constant([1.0, 2.0]) * total / n, "average=True", tol=1e-6)
    same(sum_flag, tf.constant([1.0, 2.0]) * total, "average=False")


def _adasum_tree(vectors):
    """Adasum by definition: pairwise up a binary tree, in float64."""
    def pair(a, b):
        dot = float(a @ b)
        return (1 - dot / (2 * float(a @ a))) * a + (1 - dot / (2 * float(b @ b))) * b

    level = [np.asarray(v, np.float64).reshape(-1) for v in vectors]
    while len(level) > 1:
        level = [pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def check_adasum():
    r, n = rn()
    vecs = [np.random.default_rng(q).standard_normal((2, 3)) for q in range(n)]
    mine = tf.constant(vecs[r], tf.float32)
    eager = hvd.allreduce(mine, op=hvd.Adasum)
    graph = tf.function(lambda t: hvd.allreduce(t, op=hvd.Adasum, name="tf.adasum.graph"))(mine)
    grouped = hvd.grouped_allreduce([mine, tf.ones([4], tf.float64)], op=hvd.Adasum)
    try:  # refused inside the op: TensorFlow's class, as Horovod's ops raise it
        hvd.allreduce(tf.constant([1, 2], tf.int32), op=hvd.Adasum)
    except tf.errors.InvalidArgumentError as exc:
        assert isinstance(exc.__cause__, InvalidArgumentError), repr(exc.__cause__)
        assert "floating-point" in str(exc.__cause__), str(exc)
    else:
        raise AssertionError("Adasum of int32 was accepted")
    want = tf.constant(_adasum_tree(vecs).reshape(2, 3), tf.float32)
    same(eager, want, "eager", tol=1e-6)
    same(graph, want, "tf.function", tol=1e-6)
    same(grouped[0], want, "grouped", tol=1e-6)
    same(grouped[1], tf.ones([4], tf.float64), "identical vectors: the vector")


def check_compression():
    r, n = rn()
    x = tf.constant([0.1, 1.5, -3.25], tf.float32) * (r + 1)
    exp = tf.constant([0.1, 1.5, -3.25], tf.float32) * (n + 1) / 2
    fp16 = hvd.allreduce(x, compression=hvd.Compression.fp16)
    bf16 = hvd.allreduce(x, compression=hvd.Compression.bf16)
    grouped = hvd.grouped_allreduce([x, tf.cast(x, tf.float64)], compression=hvd.Compression.fp16)
    same(fp16, exp, "fp16", tol=1e-2)
    same(bf16, exp, "bf16", tol=2e-2)
    same(grouped[0], exp, "grouped fp16", tol=1e-2)
    same(grouped[1], tf.cast(exp, tf.float64), "grouped fp16 f64", tol=1e-2)


def check_sparse_allreduce():
    r, n = rn()
    slices = tf.IndexedSlices(tf.fill([1, 3], float(r + 1)), tf.constant([r]), tf.constant([n, 3]))
    avg = hvd.allreduce(slices)
    summed = hvd.allreduce(slices, op=hvd.Sum)
    dense_avg = tf.convert_to_tensor(avg)
    assert isinstance(avg, tf.IndexedSlices)
    same(avg.indices, tf.range(n), "indices")
    same(summed.values, tf.repeat(tf.reshape(tf.range(1.0, n + 1), [-1, 1]), 3, axis=1), "sum")
    same(dense_avg, tf.repeat(tf.reshape(tf.range(1.0, n + 1) / n, [-1, 1]), 3, axis=1), "avg",
         tol=1e-6)


# -- gradients ------------------------------------------------------------------------

def op_gradients(dtype):
    """Gradients of each op's loss sum_r <w_r, y_r>; closed forms in expected_gradients."""
    r, n = rn()
    w = float(r + 1)
    grads = {}
    x = tf.ones([2, 3], dtype)
    for name, op in (("sum", hvd.Sum), ("average", hvd.Average), ("max", hvd.Max)):
        with tf.GradientTape() as tape:
            tape.watch(x)
            xi = x * tf.cast(r + 1, dtype) if op == hvd.Max else x
            loss = tf.reduce_sum(hvd.allreduce(xi, op=op) * w)
        grads[f"allreduce_{name}"] = tape.gradient(loss, x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        ys = hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum)
        loss = tf.reduce_sum(ys[0] * w) + tf.reduce_sum(ys[1])
    grads["grouped"] = tape.gradient(loss, x)
    xg = tf.ones([r + 1, 2], dtype)
    total_rows = n * (n + 1) // 2
    coef = tf.cast(tf.reshape(tf.range(1, total_rows + 1), [-1, 1]) * tf.ones([1, 2], tf.int32),
                   dtype) * w
    with tf.GradientTape() as tape:
        tape.watch(xg)
        loss = tf.reduce_sum(hvd.allgather(xg) * coef)
    grads["allgather"] = tape.gradient(loss, xg)
    with tf.GradientTape() as tape:
        tape.watch(xg)
        ys = hvd.grouped_allgather([xg, 2 * xg])
        loss = tf.reduce_sum(ys[0] * coef) + tf.reduce_sum(ys[1] * coef)
    grads["grouped_allgather"] = tape.gradient(loss, xg)
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(hvd.broadcast(x, 0) * w)
    grads["broadcast"] = tape.gradient(loss, x)
    xr = tf.ones([2 * n, 3], dtype)
    for name, op in (("sum", hvd.Sum), ("average", hvd.Average)):
        with tf.GradientTape() as tape:
            tape.watch(xr)
            loss = tf.reduce_sum(hvd.reducescatter(xr, op=op) * w)
        grads[f"reducescatter_{name}"] = tape.gradient(loss, xr)
    with tf.GradientTape() as tape:
        tape.watch(xr)
        ys = hvd.grouped_reducescatter([xr, 3 * xr], op=hvd.Sum)
        loss = tf.reduce_sum(ys[0] * w) + tf.reduce_sum(ys[1] * w)
    grads["grouped_reducescatter"] = tape.gradient(loss, xr)
    xa = tf.ones([n * (n + 1) // 2, 2], dtype)
    with tf.GradientTape() as tape:
        tape.watch(xa)
        out, _ = hvd.alltoall(xa, splits=[j + 1 for j in range(n)])
        loss = tf.reduce_sum(out * w)
    grads["alltoall"] = tape.gradient(loss, xa)
    return grads


def expected_gradients(dtype):
    r, n = rn()
    c = lambda v: tf.cast(v, dtype)  # noqa: E731
    tri = n * (n + 1) / 2
    ones = tf.ones([2, 3], dtype)
    offset = r * (r + 1) // 2
    rows = tf.reshape(tf.range(offset + 1, offset + r + 2), [-1, 1]) * tf.ones([1, 2], tf.int32)
    rs_rows = tf.reshape(tf.range(2 * n) // 2 + 1, [-1, 1]) * tf.ones([1, 3], tf.int32)
    a2a = tf.concat([tf.fill([j + 1, 2], j + 1) for j in range(n)], 0)
    return {
        "allreduce_sum": ones * c(tri),
        "allreduce_average": ones * c(tri / n),
        # Horovod's: the Max-allreduce of the weights (n), times this rank's scale
        "allreduce_max": ones * c(n * (r + 1)),
        "grouped": ones * c(tri + 2 * n),
        # Horovod's: Average-allreduce of the gradient, this rank's rows
        "allgather": c(rows) * c(tri / n),
        "broadcast": ones * c(tri / n if r == 0 else 0),
        # Horovod's: allgather of the gradient, times the size for Sum
        "reducescatter_sum": c(rs_rows) * c(n),
        "reducescatter_average": c(rs_rows),
        "grouped_allgather": c(rows) * c(3 * tri / n),
        "grouped_reducescatter": c(rs_rows) * c(4 * n),
        "alltoall": c(a2a),
    }


def check_eager_ops_without_a_tape_skip_custom_gradient():
    """Eagerly with no GradientTape active, allreduce, broadcast and allgather give the same
    result without tf.custom_gradient (~115 us a call); under a tape the gradient is
    still Horovod's."""
    r, n = rn()
    x = tf.fill([3], float(r + 1))
    real = tf.custom_gradient

    def refused(f):
        raise AssertionError("went through tf.custom_gradient")

    tf.custom_gradient = refused
    try:
        same(hvd.allreduce(x, op=hvd.Sum, name="notape.ar"), tf.fill([3], n * (n + 1) / 2))
        same(hvd.broadcast(x, n - 1, name="notape.bc"), tf.fill([3], float(n)))
        same(hvd.allgather(x, name="notape.ag"),
             tf.concat([tf.fill([3], float(j + 1)) for j in range(n)], 0))
    finally:
        tf.custom_gradient = real
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = hvd.allreduce(x, op=hvd.Sum, name="notape.tape") * (r + 1)
    same(tape.gradient(loss, x), tf.fill([3], n * (n + 1) / 2))


def check_gradients_match_closed_forms_eager():
    got = {d.name: op_gradients(d) for d in FLOATS}
    for d in FLOATS:
        exp = expected_gradients(d)
        for k in exp:
            same(got[d.name][k], exp[k], f"eager {d.name} {k}", tol=1e-6)


def check_gradients_match_closed_forms_in_tf_function():
    fn = tf.function(op_gradients)
    got = {d.name: fn(d) for d in FLOATS}
    for d in FLOATS:
        exp = expected_gradients(d)
        for k in exp:
            same(got[d.name][k], exp[k], f"graph {d.name} {k}", tol=1e-6)


def check_grouped_mismatch_fails_every_member_and_frees_the_names():
    """A member that differs on the last rank fails the whole group on every rank (not a
    hang), and the group's names are free again at once."""
    r, n = rn()
    if n == 1:
        return
    odd = r == n - 1
    ops = {
        "allreduce": lambda nm: hvd.grouped_allreduce(
            [tf.ones([3]), tf.ones([2], tf.float64 if odd else tf.float32)], name=nm),
        "allgather": lambda nm: hvd.grouped_allgather(
            [tf.ones([2, 3]), tf.ones([1, 4 if odd else 3])], name=nm),
        "reducescatter": lambda nm: hvd.grouped_reducescatter(
            [tf.ones([6, 2]), tf.ones([7 if odd else 6, 2])], name=nm),
    }
    errors = {}
    for kind, call in ops.items():
        try:  # Horovod's class; the spark_hvd exception is its cause
            errors[kind] = call(f"tf.mm.{kind}")
        except tf.errors.FailedPreconditionError as e:
            errors[kind] = e.__cause__
    again = hvd.grouped_allreduce([tf.ones([2]), tf.ones([3])], op=hvd.Sum, name="tf.mm.allreduce")
    for kind, e in errors.items():
        assert isinstance(e, TensorMismatchError), f"grouped {kind}: no mismatch error: {e}"
        assert f"grouped op 'tf.mm.{kind}'" in str(e) and e.ranks == [0, n - 1], str(e)
    same(again[1], tf.fill([3], float(n)), "a failed group's names used again")


def check_xla_function_is_a_clear_error():
    plain = tf.function(lambda x: hvd.allreduce(x), jit_compile=True, autograph=False)
    try:
        plain(tf.ones([2]))
    except InvalidArgumentError as exc:
        assert "XLA" in str(exc) and "jit_compile=False" in str(exc), str(exc)
    else:
        raise AssertionError("allreduce under jit_compile=True did not raise")
    # AutoGraph re-raises errors from converted user code as StagingError (it only keeps
    # exception types whose constructor is (*args)); the message stays ours.
    converted = tf.function(lambda x: hvd.allreduce(x), jit_compile=True)
    try:
        converted(tf.ones([2]))
    except Exception as exc:  # noqa: BLE001
        assert "cannot run inside an XLA-compiled function" in str(exc), str(exc)
    else:
        raise AssertionError("allreduce under jit_compile=True did not raise")


def check_gpu_kernels_take_device_tensors():
    """What a CPU build of TensorFlow can show of the GPU path: each collective has a GPU
    kernel, whose data inputs and outputs stay in device memory (TensorFlow hands the
    kernel device pointers, which go to the core with TensorFlow's stream: no host copy)
    and whose scale factors, names and splits are read on the host. That a GPU run
    orders the core's stream after TensorFlow's and ends in NCCL is for a GPU to show."""
    from tensorflow.python.framework import kernels

    from spark_hvd.tensorflow import _kernels

    assert _kernels.ops() is not None, _kernels.reason()
    host_args = {"SparkHvdAllreduce": ["prescale", "postscale", "tensor_name"],
                 "SparkHvdReducescatter": ["prescale", "postscale", "tensor_name"],
                 "SparkHvdAllgather": ["tensor_name"], "SparkHvdBroadcast": ["tensor_name"],
                 "SparkHvdAlltoall": ["splits", "tensor_name", "received_splits"]}
    got = {}
    for op, want in host_args.items():
        found = {k.device_type: sorted(k.host_memory_arg)
                 for k in kernels.get_registered_kernels_for_op(op).kernel}
        got[op] = (found, sorted(want))
    wrong = {op: found for op, (found, want) in got.items()
             if found.get("GPU") != want or found.get("CPU") != []}
    assert not wrong, wrong


# -- variables, objects, Keras value ops ----------------------------------------------

def check_broadcast_variables():
    r, n = rn()
    root = n - 1
    tv = tf.Variable(tf.fill([2, 3], float(r)))
    iv = tf.Variable(tf.constant([r, r], tf.int64))
    uv = tf.Variable(tf.constant([r + 7], tf.uint32))
    kv = keras.Variable(np.full([4], float(r), np.float32))
    hvd.broadcast_variables([tv, iv, uv, kv], root_rank=root)
    eager = [v.numpy().tolist() for v in (tv, iv, uv)] + [np.asarray(kv).tolist()]
    gv = tf.Variable(tf.fill([3], float(r) + 0.5))

    @tf.function
    def in_graph():
        hvd.broadcast_variables([gv], root_rank=0)
        return gv.read_value()

    graph = in_graph().numpy().tolist()
    assert eager == [[[float(root)] * 3] * 2, [root, root], [root + 7], [float(root)] * 4], eager
    assert graph == [0.5] * 3, graph


def check_objects():
    r, n = rn()
    got = hvd.broadcast_object({"rank": r, "tag": "x" * r}, root_rank=n - 1)
    gathered = hvd.allgather_object((r, [r] * r))
    assert got == {"rank": n - 1, "tag": "x" * (n - 1)}, got
    assert gathered == [(q, [q] * q) for q in range(n)], gathered


def check_keras_value_ops_return_numpy():
    r, n = rn()
    a = khvd.allreduce(np.array([1.0, 2.0]) * (r + 1), op=khvd.Sum)
    g = khvd.allgather(np.array([[r]], np.int32))
    b = khvd.broadcast(np.array([r], np.int64), root_rank=0)
    assert isinstance(a, np.ndarray) and a.tolist() == [n * (n + 1) / 2, n * (n + 1)], a
    assert g.tolist() == [[q] for q in range(n)], g
    assert b.tolist() == [0], b


def check_join_and_barrier():
    r, n = rn()
    hvd.barrier()
    last = hvd.join()
    assert 0 <= last < n, last


def check_process_set():
    """Unnamed ops on a set only some ranks are in, then unnamed global ops, eagerly and
    in a tf.function: the set's ops shift no global op's name (otherwise a hang)."""
    r, n = rn()
    evens = hvd.add_process_set(list(range(0, n, 2)))

    def step():
        out = None
        if evens.included():
            x = tf.constant([1.0, 2.0]) * (r + 1)
            out = (hvd.allreduce(x, op=hvd.Sum, process_set=evens),
                   hvd.allgather(tf.constant([r]), process_set=evens))
        return out, hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)

    try:
        got = [step(), tf.function(step)()]
    finally:
        hvd.remove_process_set(evens)
    members = list(range(0, n, 2))
    total = sum(q + 1 for q in members)
    for (out, everyone), mode in zip(got, ("eager", "tf.function")):
        assert everyone.numpy().tolist() == [float(n)], (mode, everyone)
        if r in members:
            out = (out[0].numpy().tolist(), out[1].numpy().tolist())
            assert out == ([1.0 * total, 2.0 * total], members), (mode, out)


def size_dependent_step():
    """A tf.function whose factors depend on the set's size: gradient_predivide_factor's
    postscale, averaging of IndexedSlices, the scaling of local gradients, size_op and
    rank_op."""
    from spark_hvd.tensorflow._reducer import GradientReducer
    r, n = rn()
    dense = tf.constant([4.0, 8.0])
    slices = tf.IndexedSlices(tf.constant([[4.0, 8.0]]), tf.constant([r]), tf.constant([n, 2]))
    predivide = GradientReducer(gradient_predivide_factor=2.0, prefix="predivide")
    sparse = GradientReducer(prefix="sparse")
    local = GradientReducer(prefix="local")
    key = object()

    @tf.function
    def step():
        (d,) = predivide([dense])
        (s,) = sparse([slices])
        (g,) = local([dense], variables=[key], local={id(key)})
        return d, s.values, g, hvd.size_op(), hvd.rank_op()

    return step


def same_size_dependent_values(values, shown):
    """``values`` (of size_dependent_step) are those of a set of size ``shown``."""
    r, n = rn()
    d, s, g, size, rank = values
    same(d, tf.constant([4.0, 8.0]) * n / shown, f"predivide at {shown}")
    same(s, tf.fill([n, 2], 1.0) * tf.constant([4.0, 8.0]) / shown, f"sparse at {shown}")
    same(g, tf.constant([4.0, 8.0]) / shown, f"local at {shown}")
    assert (int(size), int(rank)) == (shown, r), (int(size), int(rank), shown)


def check_size_dependent_factors_are_read_when_the_graph_runs():
    """A traced graph reads the size at each run (an elastic job's size changes between
    runs): each size-dependent factor comes from a stateful query of the core's process
    set (SparkHvdProcessSetQuery, never folded into a constant), and a query reads the
    core when it runs: a traced query of a process set removed since answers so.
    (rank_host.py checks the host functions' reading by changing the size Python sees.)"""
    r, n = rn()
    step = size_dependent_step()
    values = step()
    ps = hvd.add_process_set(list(range(n)))
    probe = tf.function(lambda: (hvd.size_op(ps), hvd.rank_op(ps),
                                 hvd.process_set_included_op(ps)))
    before = [int(v) for v in probe()]
    hvd.remove_process_set(ps)
    after = [int(v) for v in probe()]
    same_size_dependent_values(values, n)
    queries = [op.get_attr("query") for op in step.get_concrete_function().graph.get_operations()
               if op.type == "SparkHvdProcessSetQuery"]
    assert sorted(queries) == [b"rank", b"size", b"size", b"size", b"size"], queries
    assert probe.experimental_get_tracing_count() == 1
    assert before == [n, r, 1] and after == [0, -1, 0], (before, after)
