"""Rank functions: spark_hvd.mxnet at any number of ranks (run by mxnet_harness).

The op matrix compares every MXNet op with the numpy path (spark_hvd._ops) on the same
inputs, bit for bit: same result, or the same error class (which on the MXNet side is
also an MXNetError). The training checks compare DistributedTrainer and
DistributedOptimizer with one process applying every rank's gradients.
"""

import ctypes

import mxnet as mx
import numpy as np
from mxnet.base import MXNetError, _LIB, check_call

import spark_hvd.mxnet as hvd
from spark_hvd import _ops
from spark_hvd.exceptions import SparkHvdError

DTYPES = ["float32", "float64", "float16", "uint8", "int8", "int32", "int64", "bool"]
OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product, hvd.Adasum]
SHAPES = [(1,), (7,), (3, 5), (2, 3, 4)]


class Skip(Exception):
    pass


def rn():
    return hvd.rank(), hvd.size()


def data_address(arr) -> int:
    address = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(arr.handle, ctypes.byref(address)))
    return int(address.value)


def pattern(shape, dtype, r):
    """1s and 2s shifted by rank (a product over 3 ranks fits int8); a bool pattern."""
    n = int(np.prod(shape))
    if dtype == "bool":
        return ((np.arange(n) + r) % 3 == 0).reshape(shape)
    return ((np.arange(n) + r) % 2 + 1).reshape(shape).astype(dtype)


def outcome(fn):
    """(result as numpy, None) or (None, error class name), the MXNet one checked to be an
    MXNetError too."""
    try:
        out = fn()
    except SparkHvdError as exc:
        return None, exc
    if isinstance(out, mx.nd.NDArray):
        return out.asnumpy(), None
    if isinstance(out, (list, tuple)):
        return [o.asnumpy() if isinstance(o, mx.nd.NDArray) else np.asarray(o) for o in out], \
            None
    return np.asarray(out), None


def same_outcome(mx_fn, np_fn, what):
    got, got_err = outcome(mx_fn)
    want, want_err = outcome(np_fn)
    if want_err is not None or got_err is not None:
        assert got_err is not None and want_err is not None, \
            f"{what}: mxnet {got_err!r}, numpy {want_err!r}"
        assert type(got_err).__mro__[1] is type(want_err), \
            f"{what}: mxnet raised {type(got_err).__mro__}, numpy {type(want_err)}"
        assert isinstance(got_err, MXNetError), f"{what}: {type(got_err)} is no MXNetError"
        return "error"
    for g, w in zip(got if isinstance(got, list) else [got],
                    want if isinstance(want, list) else [want]):
        assert g.dtype == w.dtype and g.shape == w.shape, \
            f"{what}: {g.dtype}{g.shape} != {w.dtype}{w.shape}"
        assert np.array_equal(g, w), f"{what}: {g} != {w}"
    return "ok"


# -- the op matrix ------------------------------------------------------------------------

def check_allreduce_matrix():
    r, n = rn()
    counts = {"ok": 0, "error": 0}
    for dtype in DTYPES:
        for op in OPS:
            scales = [(1.0, 1.0), (0.5, 3.0)] if dtype.startswith("float") else [(1.0, 1.0)]
            for pre, post in scales:
                for shape in SHAPES:
                    x = pattern(shape, dtype, r)
                    what = f"allreduce {dtype} {op!r} {shape} pre={pre} post={post}"
                    kw = dict(op=op, prescale_factor=pre, postscale_factor=post)
                    counts[same_outcome(lambda: hvd.allreduce(mx.nd.array(x, dtype=dtype), **kw),
                                        lambda: _ops.allreduce(x, **kw), what)] += 1
                    t = mx.nd.array(x, dtype=dtype)
                    res = same_outcome(lambda: hvd.allreduce_(t, **kw),
                                       lambda: _ops.allreduce(x, **kw), what + " in place")
                    counts[res] += 1
                    if res == "ok":  # in place: the result is in the caller's NDArray
                        assert np.array_equal(t.asnumpy(), _ops.allreduce(x, **kw)), what
    assert counts["ok"] > 200, counts
    return counts


def check_average_keyword_and_0d_and_empty():
    r, n = rn()
    x = mx.nd.array([1.0, 2.0]) * (r + 1)
    assert np.allclose(hvd.allreduce(x, average=False).asnumpy(),
                       np.array([1.0, 2.0]) * n * (n + 1) / 2)
    with mx.util.np_shape(True):
        s = hvd.allreduce(mx.nd.array(np.float32(r + 1)), op=hvd.Sum)
        assert s.shape == () and float(s.asscalar()) == n * (n + 1) / 2
        e = hvd.allreduce(mx.nd.zeros((0, 3)))
        assert e.shape == (0, 3)
        assert hvd.allgather(mx.nd.zeros((0, 2))).shape == (0, 2)


def check_grouped_allreduce():
    r, n = rn()
    xs = [pattern((3,), "float32", r), pattern((2, 2), "int32", r), pattern((5,), "float64", r)]
    same_outcome(lambda: hvd.grouped_allreduce([mx.nd.array(x, dtype=x.dtype) for x in xs],
                                               op=hvd.Sum, prescale_factor=2.0),
                 lambda: _ops.grouped_allreduce(xs, op=hvd.Sum, prescale_factor=2.0),
                 "grouped_allreduce")
    ts = [mx.nd.array(x, dtype=x.dtype) for x in xs]
    out = hvd.grouped_allreduce_(ts, op=hvd.Max)
    assert all(o is t for o, t in zip(out, ts)), "grouped_allreduce_ returns its inputs"
    for t, w in zip(ts, _ops.grouped_allreduce(xs, op=hvd.Max)):
        assert np.array_equal(t.asnumpy(), w)
    assert hvd.grouped_allreduce([]) == []


def check_allgather_and_grouped():
    r, n = rn()
    for dtype in DTYPES:
        x = pattern((r + 1, 3), dtype, r)
        same_outcome(lambda: hvd.allgather(mx.nd.array(x, dtype=dtype)),
                     lambda: _ops.allgather(x), f"allgather {dtype}")
    xs = [pattern((r + 1,), "int64", r), pattern((2, 2), "float32", r)]
    same_outcome(lambda: hvd.grouped_allgather([mx.nd.array(x, dtype=x.dtype) for x in xs]),
                 lambda: [_ops.allgather(x) for x in xs], "grouped_allgather")


def check_broadcast_every_root():
    r, n = rn()
    for root in range(n):
        for dtype in DTYPES:
            x = pattern((2, 3), dtype, r)
            want = pattern((2, 3), dtype, root)
            got = hvd.broadcast(mx.nd.array(x, dtype=dtype), root)
            assert np.array_equal(got.asnumpy(), want), (root, dtype)
            t = mx.nd.array(x, dtype=dtype)
            assert hvd.broadcast_(t, root) is t
            assert np.array_equal(t.asnumpy(), want), (root, dtype, "in place")


def check_alltoall():
    r, n = rn()
    splits = [(r + i) % 2 + 1 for i in range(n)]
    x = np.arange(sum(splits) * 2, dtype=np.float32).reshape(-1, 2) + 100 * r
    got, got_splits = hvd.alltoall(mx.nd.array(x), splits=mx.nd.array(splits, dtype="int32"))
    want, want_splits = _ops.alltoall(x, splits=splits)
    assert np.array_equal(got.asnumpy(), want) and got_splits.dtype == np.int32
    assert np.array_equal(got_splits.asnumpy(), want_splits)
    even = mx.nd.array(np.arange(2 * n, dtype=np.int64) + 10 * r, dtype="int64")
    got = hvd.alltoall(even)  # without splits, as Horovod's: the rows alone
    assert np.array_equal(got.asnumpy(), _ops.alltoall(even.asnumpy())[0])
    # Horovod's rule: an NDArray of splits must be int32; any other dtype is refused on
    # every rank before anything is sent (MXNetError and ValueError), and the job goes on
    for bad in (mx.nd.ones([n], dtype="float32"), mx.nd.ones([n], dtype="int64"),
                mx.nd.ones([1, n], dtype="int32")):
        try:
            hvd.alltoall(mx.nd.array(x), splits=bad)
        except mx.base.MXNetError as exc:
            assert isinstance(exc, ValueError) and "splits" in str(exc), exc
        else:
            raise AssertionError(f"alltoall took splits of {bad.dtype}, shape {bad.shape}")
    total = hvd.allreduce(mx.nd.array([float(r + 1)]), op=hvd.Sum, name="mx.a2a.in_step")
    assert total.asnumpy().tolist() == [n * (n + 1) / 2], total


def check_reducescatter_and_grouped():
    r, n = rn()
    for dtype in ["float32", "float64", "int32"]:
        for op in [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Adasum]:
            x = pattern((2 * n + 1, 2), dtype, r)
            kw = dict(op=op, prescale_factor=2.0) if dtype != "int32" else dict(op=op)
            same_outcome(lambda: hvd.reducescatter(mx.nd.array(x, dtype=dtype), **kw),
                         lambda: _ops.reducescatter(x, **kw), f"reducescatter {dtype} {op!r}")
    xs = [pattern((n, 3), "float32", r), pattern((n + 2,), "int64", r)]
    same_outcome(lambda: hvd.grouped_reducescatter([mx.nd.array(x, dtype=x.dtype) for x in xs],
                                                   op=hvd.Sum),
                 lambda: [_ops.reducescatter(x, op=hvd.Sum) for x in xs],
                 "grouped_reducescatter")


def check_process_set():
    r, n = rn()
    if n < 2:
        raise Skip("a process set smaller than the job needs 2 ranks")
    ps = hvd.add_process_set([0, 1])
    try:
        if r in (0, 1):
            x = mx.nd.array([1.0, 2.0]) * (r + 1)
            assert np.array_equal(hvd.allreduce(x, op=hvd.Sum, process_set=ps).asnumpy(),
                                  np.array([3.0, 6.0], dtype=np.float32))
            assert hvd.allgather(mx.nd.array([r]), process_set=ps).asnumpy().tolist() == [0, 1]
            assert hvd.broadcast(mx.nd.array([r + 5.0]), 1, process_set=ps).asscalar() == 6.0
    finally:
        hvd.remove_process_set(ps)


def check_objects():
    r, n = rn()
    assert hvd.broadcast_object({"rank": r, "a": [1, 2]}, root_rank=n - 1) == \
        {"rank": n - 1, "a": [1, 2]}
    assert hvd.allgather_object(("r", r)) == [("r", i) for i in range(n)]


# -- the bridge to MXNet's engine -----------------------------------------------------------

def check_zero_copy():
    seen = []
    real = _ops.submit

    def spy(op, name, dtype, shape, in_ptr, out_ptr, owner, finish, **kw):
        seen.append((in_ptr, out_ptr))
        return real(op, name, dtype, shape, in_ptr, out_ptr, owner, finish, **kw)

    _ops.submit = spy
    try:
        t = mx.nd.arange(12).reshape((3, 4))
        hvd.allreduce_(t)
        src = mx.nd.ones((5,))
        out = hvd.allreduce(src)
        big = mx.nd.arange(20)
        view = big[5:10]  # a slice: its address is inside its parent's buffer
        hvd.allreduce_(view, op=hvd.Sum)
    finally:
        _ops.submit = real
    assert seen[0] == (data_address(t), data_address(t)), "allreduce_ works on t's memory"
    assert seen[1] == (data_address(src), data_address(out)), "allreduce reads src in place"
    assert seen[2][0] == data_address(big) + 5 * 4 == seen[2][1], "slice address"


def check_engine_order():
    """An op waits for the engine's pending writes to its input, and for pending reads of
    the NDArray it overwrites; later MXNet ops see its result."""
    r, n = rn()
    a = mx.nd.ones((400, 400))
    total = 400.0 * n * (n + 1) / 2
    for _ in range(2):
        c = mx.nd.dot(a, a) * (r + 1)  # queued: every entry 400 * (r + 1) once it has run
        big = mx.nd.ones((500, 500))
        slow = mx.nd.dot(mx.nd.dot(big, big), big).sum() * 0  # long, queued
        reader = mx.nd.broadcast_add(c, slow.reshape((1, 1)))  # reads c after slow ends
        hvd.allreduce_(c, op=hvd.Sum)  # must wait for reader before overwriting c
        later = c + 1  # queued after: must see the sum
        assert np.all(c.asnumpy() == total), c.asnumpy()[0, :3]
        assert np.all(later.asnumpy() == total + 1)
        assert np.all(reader.asnumpy() == 400.0 * (r + 1)), reader.asnumpy()[0, :3]


def check_errors_then_continue():
    r, n = rn()
    try:
        hvd.allreduce(np.zeros(3))
        raise AssertionError("a numpy array was accepted")
    except MXNetError as exc:
        assert isinstance(exc, hvd.InvalidArgumentError) and "NDArray" in str(exc)
    if n > 1:
        try:
            hvd.allreduce(mx.nd.ones((r + 2,)), name="mismatch")
            raise AssertionError("shapes differing across ranks were reduced")
        except MXNetError as exc:
            assert isinstance(exc, hvd.TensorMismatchError), type(exc).__mro__
            assert isinstance(exc, hvd.HorovodInternalError)
    sparse = mx.nd.ones((2, 2)).tostype("csr")
    try:
        hvd.allreduce(sparse)
        raise AssertionError("a sparse NDArray was accepted")
    except MXNetError as exc:
        assert "tostype('default')" in str(exc)
    out = hvd.allreduce(mx.nd.ones((2,)) * (r + 1), op=hvd.Sum)  # the job goes on
    assert out.asnumpy().tolist() == [n * (n + 1) / 2] * 2


# -- parameters, trainer, optimizer --------------------------------------------------------

def _net(in_units=None):
    net = mx.gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(mx.gluon.nn.Dense(4, activation="relu", in_units=in_units or 0))
        net.add(mx.gluon.nn.Dense(3, in_units=4))
    return net


def _gathered_equal(arr, what):
    every = hvd.allgather(arr.expand_dims(0)).asnumpy()
    assert all(np.array_equal(every[0], e) for e in every), f"{what} differs across ranks"


def check_broadcast_parameters_deferred_and_module():
    r, n = rn()
    mx.random.seed(100 + r)  # different weights on every rank
    net = _net()  # the first layer's input size is unknown: initialisation is deferred
    net.initialize(mx.init.Uniform())
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0, prefix="bp.")
    net(mx.nd.ones((2, 6)))  # the first forward completes the init, then broadcasts
    for name, p in sorted(params.items()):
        _gathered_equal(p.data(), name)
    module_args = {"w": mx.nd.ones((2, 2)) * r, "b": mx.nd.arange(3) + r}
    hvd.broadcast_parameters(module_args, root_rank=n - 1)
    assert np.all(module_args["w"].asnumpy() == n - 1)
    try:
        hvd.broadcast_parameters([mx.nd.ones(2)])
        raise AssertionError("a list was accepted")
    except ValueError as exc:
        assert "invalid params of type" in str(exc)


def _grads(shape, r, seed):
    return (np.random.RandomState(seed + r).randn(*shape)).astype(np.float32)


def check_trainer_known_gradients():
    """Gradients chosen by the test (the loss sum(w * G) has gradient G, exactly):
    DistributedTrainer.step(b) on every rank equals one Trainer stepping the sum of every
    rank's gradients with batch size b * size; with fp16 compression, the sum of the
    float16-rounded gradients (at size 1 nothing is reduced, so nothing is rounded)."""
    r, n = rn()
    for kw in [{}, {"gradient_predivide_factor": 2.0}, {"num_groups": 2},
               {"compression": hvd.Compression.fp16}]:
        nets = []
        for distributed in (True, False):
            net = _net(in_units=5)
            net.initialize(mx.init.Constant(0.5))
            params = net.collect_params()
            opt = {"learning_rate": 0.1, "momentum": 0.9}
            trainer = hvd.DistributedTrainer(params, "sgd", opt, prefix="t.", **kw) \
                if distributed else mx.gluon.Trainer(params, "sgd", opt, kvstore=None)
            for step in range(2):
                chosen = []
                for i, (name, p) in enumerate(sorted(params.items())):
                    gs = [_grads(p.shape, k, 10 * step + i)
                          for k in ([r] if distributed else range(n))]
                    if kw.get("compression") is not None and not distributed and n > 1:
                        g = np.sum([g.astype(np.float16) for g in gs], axis=0,
                                   dtype=np.float16).astype(np.float32)
                    else:
                        g = np.sum(gs, axis=0)
                    chosen.append((p, mx.nd.array(g)))
                with mx.autograd.record():
                    loss = mx.nd.add_n(*[(p.data() * g).sum() for p, g in chosen])
                loss.backward()
                trainer.step(4 * (1 if distributed else n))
            nets.append(params)
        for (name, p), (_, q) in zip(sorted(nets[0].items()), sorted(nets[1].items())):
            assert np.allclose(p.data().asnumpy(), q.data().asnumpy(), rtol=1e-5, atol=1e-6), \
                (kw, name)


def check_trainer_training_equivalence():
    """Autograd and a loss: 2+ ranks, each on its own batch, train as one process on the
    concatenation of every rank's batch."""
    r, n = rn()
    rs = np.random.RandomState(7)
    x_all = rs.randn(4 * n, 5).astype(np.float32)
    y_all = rs.randint(0, 3, size=4 * n).astype(np.float32)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    results = []
    for distributed in (True, False):
        mx.random.seed(5)
        net = _net(in_units=5)
        net.initialize(mx.init.Xavier())
        params = net.collect_params()
        if distributed:
            hvd.broadcast_parameters(params, root_rank=0, prefix="eq.")
            trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": 0.5})
            x, y = x_all[4 * r:4 * r + 4], y_all[4 * r:4 * r + 4]
        else:
            trainer = mx.gluon.Trainer(params, "sgd", {"learning_rate": 0.5}, kvstore=None)
            x, y = x_all, y_all
        for _ in range(3):
            with mx.autograd.record():
                loss = loss_fn(net(mx.nd.array(x)), mx.nd.array(y))
            loss.backward()
            trainer.step(len(x))
        results.append([p.data().asnumpy() for _, p in sorted(params.items())])
    for a, b in zip(*results):
        assert np.allclose(a, b, rtol=1e-5, atol=1e-6), np.abs(a - b).max()


def check_distributed_optimizer_updater():
    """The Module API's path: an updater over DistributedOptimizer averages gradients."""
    r, n = rn()
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=1.0))
    updater = mx.optimizer.get_updater(opt)
    w = mx.nd.zeros((3,))
    g = mx.nd.array([1.0, 2.0, 3.0]) * (r + 1)
    updater(0, g, w)
    mean = (n + 1) / 2
    assert np.allclose(w.asnumpy(), -np.array([1.0, 2.0, 3.0]) * mean), w.asnumpy()
    ws = [mx.nd.zeros((2,)), mx.nd.zeros((4,))]
    gs = [mx.nd.ones((2,)) * (r + 1), mx.nd.ones((4,)) * 2 * (r + 1)]
    grouped = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=1.0), num_groups=1)
    grouped.update([1, 2], ws, gs, [None, None])
    assert np.allclose(ws[0].asnumpy(), -mean) and np.allclose(ws[1].asnumpy(), -2 * mean)
