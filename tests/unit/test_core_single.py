"""Every op in a single process: ``init()`` without a launcher is rank 0 of 1.

At size 1 every reduction returns its input (integer Average divides by 1), so the
expectations are the inputs themselves, with scale factors applied.
"""

import json
import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import spark_hvd as hvd

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(t) for t in (np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16)] \
    + [BF16] + [np.dtype(t) for t in (np.float32, np.float64, np.bool_)]
FLOATS = {np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)}
OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max,
       "Product": hvd.Product}
SHAPES = [(0,), (1,), (7,), (3, 5), (0, 4)]  # 0-d: test_zero_dim_keeps_its_shape


def ids(dt):
    return "bfloat16" if np.dtype(dt) == BF16 else np.dtype(dt).name


def sample(dt, shape, salt=0):
    n = int(np.prod(shape, dtype=np.int64))
    base = (np.arange(n) * 7 + salt) % 5
    dt = np.dtype(dt)
    if dt == np.bool_:
        raw = base % 2 == 1
    elif dt.kind == "u":
        raw = base + 1
    elif dt in FLOATS:
        raw = (base - 2) * 0.5
    else:
        raw = base - 2
    return np.asarray(raw).astype(dt).reshape(shape)


def same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.array_equal(got.astype(np.float64) if want.dtype in FLOATS else got,
                          want.astype(np.float64) if want.dtype in FLOATS else want), (got, want)


def run_python(code: str, env_extra=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARK_HVD_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module", autouse=True)
def single():
    """hvd.init() with no launcher environment: a one-rank job in this process."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SPARK_HVD_")}
    if hvd.is_initialized():
        hvd.shutdown()
    hvd.init()
    try:
        yield
    finally:
        hvd.shutdown()
        os.environ.update(saved)


# -- topology -------------------------------------------------------------------------

def test_rank_0_of_1():
    assert hvd.is_initialized()
    assert (hvd.rank(), hvd.size()) == (0, 1)
    assert (hvd.local_rank(), hvd.local_size()) == (0, 1)
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    assert hvd.is_homogeneous()
    assert hvd.gloo_enabled() and not hvd.mpi_enabled()


def test_init_twice_is_a_no_op():
    hvd.init()
    assert hvd.size() == 1
    same(hvd.allreduce(np.ones(2), op=hvd.Sum, name="single.init_twice"), np.ones(2))


# -- allreduce ------------------------------------------------------------------------

@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dt", DTYPES, ids=ids)
def test_allreduce_returns_the_input(dt, op):
    for k, shape in enumerate(SHAPES):
        x = sample(dt, shape, k)
        name = f"single.ar.{ids(dt)}.{op}.{k}"
        if dt == np.bool_ and op == "Average":
            with pytest.raises(hvd.InvalidArgumentError, match="bool"):
                hvd.allreduce(x, op=OPS[op], name=name)
            continue
        got = hvd.allreduce(x, op=OPS[op], name=name)
        same(got, x)
        assert got is not x and not np.shares_memory(got, x)


@pytest.mark.parametrize("dt", [d for d in DTYPES if d != np.bool_], ids=ids)
def test_allreduce_scale_factors(dt):
    x = sample(dt, (9,))
    pre, post = (0.5, 4.0) if dt in FLOATS else (2.0, 3.0)
    for op in ("Sum", "Average"):
        got = hvd.allreduce(x, op=OPS[op], prescale_factor=pre, postscale_factor=post,
                            name=f"single.scaled.{ids(dt)}.{op}")
        want = (x.astype(np.float64) * pre * post).astype(dt)
        same(got, want)


def test_allreduce_default_op_is_average():
    x = np.array([1, -3, 5], np.int32)
    same(hvd.allreduce(x, name="single.default"), x)


def test_allreduce_accepts_non_contiguous_and_python_lists():
    x = np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2]
    same(hvd.allreduce(x, op=hvd.Sum, name="single.strided"), np.ascontiguousarray(x))
    same(hvd.allreduce([1.0, 2.0], op=hvd.Sum, name="single.list"), np.array([1.0, 2.0]))


def test_async_poll_synchronize():
    x = np.arange(100, dtype=np.float64)
    h = hvd.allreduce_async(x, op=hvd.Sum, name="single.async")
    got = hvd.synchronize(h)
    assert hvd.poll(h)
    same(got, x)
    same(hvd.synchronize(h), x)  # a second synchronize returns the same value


@pytest.mark.parametrize("dt", DTYPES, ids=ids)
def test_grouped_allreduce(dt):
    xs = [sample(dt, s, i) for i, s in enumerate([(0,), (5,), (2, 3), (1,)])]
    op = hvd.Max if dt == np.bool_ else hvd.Sum
    got = hvd.grouped_allreduce(xs, op=op, name=f"single.group.{ids(dt)}")
    assert len(got) == len(xs)
    for g, x in zip(got, xs):
        same(g, x)


def test_grouped_allgather_and_reducescatter():
    xs = [np.arange(6, dtype=np.float32).reshape(3, 2), np.int32(7), np.zeros((0, 4))]
    got = hvd.grouped_allgather(xs, name="single.group.ag")
    for g, x in zip(got, xs):
        same(g, np.reshape(x, (-1,) + np.shape(x)[1:]))  # a 0-d tensor gathers as 1-d
    ys = [np.arange(4, dtype=np.float64), np.ones((2, 3), np.int64)]
    for g, y in zip(hvd.grouped_reducescatter(ys, op=hvd.Sum, name="single.group.rs"), ys):
        same(g, y)


def test_many_async_allreduces_in_flight():
    xs = [sample(np.float32, (i % 13,), i) for i in range(200)]
    hs = [hvd.allreduce_async(x, op=hvd.Sum, name=f"single.many.{i}") for i, x in enumerate(xs)]
    for h, x in zip(reversed(hs), reversed(xs)):
        same(hvd.synchronize(h), x)


def test_steady_steps_allocate_no_op_state_or_queue_entry():
    """Issue 24's rule "no allocation per op in steady state", on the engine's own objects:
    the op states, queue entries and queue nodes it heap-allocates grow with the most ops
    alive at once (a free list's high-water mark: the engine may drop a step's entries
    after the next step is submitted), never with the number of ops run. Without reuse
    the count grows by 3 per op (5,400 here)."""
    from spark_hvd import _core

    x = np.ones(4, np.float32)

    def step():
        hs = [hvd.allreduce_async(x, op=hvd.Sum, name=f"single.steady.{j}") for j in range(8)]
        for h in hs:
            same(hvd.synchronize(h), x)
        same(hvd.allreduce(x, op=hvd.Sum, name="single.steady.loss"), x)

    for _ in range(20):
        step()
    before = _core.op_allocations()
    before_engine = _core.engine_allocations()
    for _ in range(200):
        step()
    grown = _core.op_allocations() - before
    # At most two steps' ops (18) alive at once, each with a state, an entry and a node.
    assert grown <= 54, (
        f"{grown} op states/queue entries/nodes allocated over 1800 steady ops: the "
        "engine's free lists (csrc/common/free_list.h) are not reused")
    # Nor anything else on the engine thread (tests/multiproc/test_mp_alloc.py: 2 ranks),
    # but for its kept lists growing once to a new high-water mark of responses per cycle
    # (timing decides how the async ops fall into cycles).
    engine_grown = _core.engine_allocations() - before_engine
    assert engine_grown <= 64, (
        f"the engine thread made {engine_grown} heap allocations over 1800 steady ops")


def test_a_caller_that_waits_runs_the_cycle_itself():
    """Engine::Drive: a blocking op enqueued with wake=False is negotiated and executed on
    the waiting thread (tcp and shm allow calls from any thread), not handed to the
    engine thread, which is not even woken. Without Drive each op would wait for the
    engine's idle tick (up to SPARK_HVD_IDLE_CYCLE_TIME_MS) and driven_cycles stays 0."""
    from spark_hvd import _core
    from spark_hvd._types import DataType, OpType

    before = _core.driven_cycles()
    for i in range(100):
        x = np.full(4, float(i), np.float32)
        op = _core.Op(op=OpType.ALLREDUCE, name="single.drive", dtype=DataType.FLOAT32,
                      shape=[4], input=x.ctypes.data, output=x.ctypes.data, owner=x)
        (work,) = _core.enqueue([op], wake=False)
        assert work.wait()
        work.result()
        assert np.all(x == float(i))
    driven = _core.driven_cycles() - before
    # The engine's idle timer may take a few of the cycles; the caller runs the rest.
    assert driven >= 50, f"only {driven} of 100 blocking ops' cycles ran on the caller"


def test_repeated_steps_with_changing_shape_and_op():
    for s in range(20):
        x = sample(np.float32, (4,), s)
        same(hvd.allreduce(x, op=hvd.Sum, name="single.cache"), x)
    same(hvd.allreduce(sample(np.float32, (6,)), op=hvd.Sum, name="single.cache"),
         sample(np.float32, (6,)))
    same(hvd.allreduce(sample(np.int64, (6,)), op=hvd.Max, name="single.cache"),
         sample(np.int64, (6,)))


@pytest.mark.parametrize("op", ["allreduce", "broadcast", "grouped_allreduce"])
@pytest.mark.parametrize("dt", [np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.bool_)],
                         ids=ids)
def test_zero_dim_keeps_its_shape(dt, op):
    x = sample(dt, (), 1)
    name = f"single.0d.{op}.{ids(dt)}"
    if op == "allreduce":
        got = hvd.allreduce(x, op=hvd.Max, name=name)
    elif op == "broadcast":
        got = hvd.broadcast(x, 0, name=name)
    else:
        got = hvd.grouped_allreduce([x], op=hvd.Max, name=name)[0]
    same(got, x)


# -- allgather, broadcast, alltoall, reducescatter -------------------------------------

@pytest.mark.parametrize("dt", DTYPES, ids=ids)
def test_allgather(dt):
    for k, shape in enumerate([(0, 3), (4, 3), (1,), (6,)]):
        x = sample(dt, shape, k)
        same(hvd.allgather(x, name=f"single.ag.{ids(dt)}.{k}"), x)
    same(hvd.allgather(sample(dt, ()), name=f"single.ag.{ids(dt)}.0d"), sample(dt, (1,)))


@pytest.mark.parametrize("dt", DTYPES, ids=ids)
def test_broadcast(dt):
    for k, shape in enumerate(SHAPES):
        x = sample(dt, shape, k)
        same(hvd.broadcast(x, root_rank=0, name=f"single.bc.{ids(dt)}.{k}"), x)


@pytest.mark.parametrize("dt", DTYPES, ids=ids)
def test_alltoall(dt):
    x = sample(dt, (5, 2))
    out, splits = hvd.alltoall(x, splits=[5], name=f"single.a2a.{ids(dt)}")
    same(out, x)
    assert list(splits) == [5]
    out, splits = hvd.alltoall(x, name=f"single.a2a.{ids(dt)}.nosplits")
    same(out, x)
    assert list(splits) == [5]
    out, splits = hvd.alltoall(sample(dt, (0,)), splits=[0], name=f"single.a2a.{ids(dt)}.0")
    same(out, sample(dt, (0,)))
    assert list(splits) == [0]


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dt", DTYPES, ids=ids)
def test_reducescatter(dt, op):
    for rows in (0, 1, 7):
        x = sample(dt, (rows, 3), rows)
        name = f"single.rs.{ids(dt)}.{op}.{rows}"
        if dt == np.bool_ and op == "Average":
            with pytest.raises(hvd.InvalidArgumentError):
                hvd.reducescatter(x, op=OPS[op], name=name)
            continue
        same(hvd.reducescatter(x, op=OPS[op], name=name), x)


# -- barrier, join, objects, process sets -------------------------------------------------

def test_barrier_and_join():
    hvd.barrier()
    assert hvd.join() == 0
    same(hvd.allreduce(np.ones(3), op=hvd.Sum, name="single.after_join"), np.ones(3))


def test_objects():
    obj = {"a": [1, 2, 3], "b": ("x", None), "c": b"\x00\x01"}
    assert hvd.broadcast_object(obj, root_rank=0) == obj
    assert hvd.allgather_object(obj) == [obj]
    assert hvd.allgather_object(None) == [None]


def test_process_set_of_rank_0():
    ps = hvd.add_process_set([0])
    assert ps.process_set_id not in (None, 0) and ps.included() and ps.rank() == 0
    same(hvd.allreduce(np.arange(3.0), op=hvd.Sum, name="single.ps", process_set=ps),
         np.arange(3.0))
    same(hvd.allgather(np.ones((2, 2)), name="single.ps.ag", process_set=ps), np.ones((2, 2)))
    hvd.barrier(process_set=ps)
    assert hvd.remove_process_set(ps) is True
    assert hvd.remove_process_set(ps) is False
    with pytest.raises(hvd.InvalidArgumentError):
        hvd.allreduce(np.ones(1), name="single.ps.removed", process_set=ps)
    with pytest.raises(hvd.InvalidArgumentError):
        hvd.add_process_set([0, 1])
    assert hvd.remove_process_set(hvd.global_process_set) is False


# -- timeline ------------------------------------------------------------------------------

def test_timeline_start_stop_writes_chrome_trace(tmp_path):
    path = tmp_path / "timeline.json"
    hvd.start_timeline(str(path))
    hvd.allreduce(np.ones(8, np.float32), name="single.tl.grad")
    hvd.allgather(np.ones(2, np.int32), name="single.tl.gather")
    hvd.stop_timeline()
    trace = json.loads(path.read_text())
    names = {str(e.get("args", {}).get(k)) for e in trace["traceEvents"]
             for k in ("tensor", "name")}
    assert {"single.tl.grad", "single.tl.gather"} <= names
    assert all({"name", "ph", "pid"} <= set(e) for e in trace["traceEvents"])


def test_timeline_at_an_unwritable_path_raises(tmp_path):
    with pytest.raises(hvd.InvalidArgumentError):
        hvd.start_timeline(str(tmp_path / "no" / "such" / "dir" / "t.json"))


# -- errors -------------------------------------------------------------------------------

# A duplicate in-flight name across cycles is tested with 2-3 ranks in tests/multiproc
# (cases_lifetime.py): a lone rank starts a cycle as soon as an op arrives. Ops
# submitted together reach the core in one call, so here a duplicate is certain.


def test_duplicate_name_in_one_submission_is_refused_whole():
    from spark_hvd import _ops

    x = np.arange(3, dtype=np.float32)
    with pytest.raises(hvd.InvalidArgumentError, match="'single.dup' is already in flight"):
        with _ops.submit_together():
            first = hvd.allreduce_async(x, name="single.dup")
            hvd.allreduce_async(x, name="single.dup")
    assert first.work is None  # nothing was submitted
    same(hvd.allreduce(x, name="single.dup"), x)


def test_part_of_a_group_is_refused():
    """The controller relies on a rank submitting a group whole (csrc/engine/groups.h)."""
    from spark_hvd import _ops
    from spark_hvd._types import OpType, numpy_code

    x = np.ones(2, np.float32)
    with pytest.raises(hvd.InvalidArgumentError, match="'single.part'.* 1 of its tensors.* 2"):
        _ops.submit(OpType.ALLREDUCE, "single.part.0", numpy_code(x.dtype), x.shape,
                    x.ctypes.data, x.ctypes.data, (x,), lambda r: x, group="single.part",
                    group_size=2)


def test_submit_takes_numpy_arrays_for_addresses():
    """_core.submit (one op, positional) and Op take a C-contiguous array for an
    address, and refuse any other array rather than read it in the wrong order."""
    from spark_hvd import _core
    from spark_hvd._types import DataType, OpType, ReduceOp

    x = np.arange(6, dtype=np.float32)
    out = np.zeros_like(x)
    work = _core.submit(OpType.ALLREDUCE, "single.addr", DataType.FLOAT32, x.shape, x, out,
                        ReduceOp.SUM, 2.0, 1.0, 0, 0, -1, (), "", 0, (x, out), 0)
    assert work.wait(-1.0)
    work.result()
    same(out, x * 2)
    (work,) = _core.enqueue([_core.Op(op=OpType.ALLREDUCE, name="single.addr.op",
                                      dtype=DataType.FLOAT32, shape=x.shape, input=x,
                                      output=out.ctypes.data, owner=(x, out))])
    assert work.wait(-1.0)
    work.result()
    same(out, x)
    strided = np.arange(12, dtype=np.float32)[::2]
    with pytest.raises(hvd.InvalidArgumentError, match="C-contiguous"):
        _core.submit(OpType.ALLREDUCE, "single.addr.strided", DataType.FLOAT32, strided.shape,
                     strided, strided, ReduceOp.SUM, 1.0, 1.0, 0, 0, -1, (), "", 0, strided, 0)


def test_one_op_goes_positional_and_a_batch_through_op(monkeypatch):
    """Outside a submit_together block an op skips Op's keyword parsing (the per-call
    cost of small blocking ops); inside one, every op is an Op enqueued together."""
    from spark_hvd import _core

    def refused(*args, **kwargs):
        raise AssertionError("not on this path")

    x = np.arange(3, dtype=np.float32)
    with monkeypatch.context() as m:
        m.setattr(_core, "Op", refused)
        same(hvd.allreduce(x, name="single.path.one", op=hvd.Sum), x)
        same(hvd.broadcast(x, 0, name="single.path.bcast"), x)
        same(hvd.allgather(x, name="single.path.gather"), x)
    with monkeypatch.context() as m:
        m.setattr(_core, "submit", refused)
        got = hvd.grouped_allreduce([x, x + 1], name="single.path.group", op=hvd.Sum)
    same(got[0], x)
    same(got[1], x + 1)


def test_generated_names_are_distinct_across_threads():
    import threading

    from spark_hvd._runtime import RUNTIME

    got, threads = [], []
    for _ in range(4):
        threads.append(threading.Thread(
            target=lambda: got.extend(RUNTIME.auto_name("single.threads", 7) for _ in range(500))))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == sorted(f"single.threads.noname.ps7.{n}" for n in range(2000))


def test_group_with_an_invalid_member_submits_nothing():
    x = np.arange(3, dtype=np.float32)
    with pytest.raises(hvd.InvalidArgumentError, match="bool"):
        hvd.grouped_allreduce([x, x, np.ones(2, bool)], name="single.grp")
    got = hvd.grouped_allreduce([x, x], name="single.grp")
    same(got[0], x)
    same(hvd.allreduce(x, name="single.grp.0"), x)


def test_adasum_of_one_rank_is_the_scaled_tensor():
    for dt in (np.float16, np.float32, np.float64):
        x = np.linspace(-1, 1, 9).astype(dt).reshape(3, 3)
        got = hvd.allreduce(x, name=f"single.adasum.{np.dtype(dt).name}", op=hvd.Adasum,
                            prescale_factor=2.0, postscale_factor=0.5)
        same(got, x)
    got = hvd.grouped_allreduce([np.ones(3), np.zeros(0), np.full(2, 2.0)], op=hvd.Adasum,
                                name="single.adasum.grouped")
    same(got[0], np.ones(3))
    same(got[2], np.full(2, 2.0))


def test_dropped_handles_are_safe_and_leave_no_result_behind():
    import gc

    for i in range(200):
        a = np.full(1 << 14, i, np.float32)
        hvd.allgather_async(a, name=f"single.drop.{i}")
        hvd.allreduce_async(a, name=f"single.drop.ar.{i}")
        del a
        gc.collect(1)  # the dropped handles are young: collecting the young generations finds them
        np.full(1 << 14, -1, np.float32)  # reuses the freed memory
    same(hvd.allreduce(np.ones(2, np.float32), name="single.drop.after"),
         np.ones(2, np.float32))


@pytest.mark.parametrize("call", [
    lambda: hvd.allreduce(np.zeros(2, np.complex64), name="single.bad.dtype"),
    lambda: hvd.allreduce(np.ones(2, np.int32), name="single.bad.adasum", op=hvd.Adasum),
    lambda: hvd.reducescatter(np.ones(2), name="single.bad.adasum_rs", op=hvd.Adasum),
    lambda: hvd.allreduce(np.ones(2), name="single.bad.both", op=hvd.Sum, average=True),
    lambda: hvd.broadcast(np.ones(2), root_rank=1, name="single.bad.root"),
    lambda: hvd.alltoall(np.ones(4), splits=[5], name="single.bad.splits"),
    lambda: hvd.alltoall(np.ones(4), splits=[2, 2], name="single.bad.nsplits"),
    lambda: hvd.alltoall(np.float32(1), name="single.bad.a2a0d"),
    lambda: hvd.reducescatter(np.float32(1), name="single.bad.rs0d"),
    lambda: hvd.allreduce(np.ones(2, bool), op=hvd.Sum, prescale_factor=2.0,
                          name="single.bad.boolscale"),
], ids=["complex", "adasum_int", "adasum_reducescatter", "op_and_average", "root", "splits_sum",
        "splits_count", "alltoall_0d", "reducescatter_0d", "bool_scale"])
def test_invalid_arguments(call):
    with pytest.raises(hvd.InvalidArgumentError):
        call()


def test_an_op_the_engine_refuses_names_its_tensor():
    """The failure's evidence arrives as fields: here the engine refuses an op on a
    device no backend of this job serves."""
    from spark_hvd import _ops
    from spark_hvd._types import DataType, OpType

    if hvd.nccl_built():
        pytest.skip("this build has a GPU backend")
    x = np.ones(3, np.float32)
    with pytest.raises(hvd.InvalidArgumentError, match="device 0") as info:
        _ops.submit(OpType.ALLREDUCE, "single.gpu", DataType.FLOAT32, x.shape, x.ctypes.data,
                    x.ctypes.data, (x,), lambda r: x, device=0)
    assert info.value.tensor == "single.gpu" and info.value.ranks == []


def test_the_codes_are_the_cores_enums():
    import enum
    import pickle

    from spark_hvd import _core, _types

    for name in ("DataType", "ReduceOp", "OpType", "StatusCode"):
        cls = getattr(_types, name)
        assert cls is getattr(_core, name) and issubclass(cls, enum.IntEnum)
    assert hvd.ReduceOp is _core.ReduceOp and hvd.Sum is hvd.ReduceOp.SUM
    assert hvd.Sum == 0 and hvd.Average == 1 and hvd.Adasum == 5
    assert {0: "sum"}[hvd.Sum] == "sum" and hash(hvd.Max) == hash(3)
    assert hvd.ReduceOp(2) is hvd.Min and hvd.ReduceOp["PRODUCT"] is hvd.Product
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert pickle.loads(pickle.dumps(hvd.Average, protocol=protocol)) is hvd.Average
    assert _types.OpType.ADD_PROCESS_SET == 100 and _types.OpType.REMOVE_PROCESS_SET == 101
    assert _types.numpy_code(np.float32) is _types.DataType.FLOAT32


def test_native_errors_are_the_picklable_taxonomy():
    import pickle

    with pytest.raises(hvd.InvalidArgumentError) as info:
        hvd.allreduce(np.ones(2, bool), name="single.bool.avg")
    e = pickle.loads(pickle.dumps(info.value))
    assert type(e) is type(info.value) and str(e) == str(info.value)


# -- before init, after shutdown, re-init (fresh interpreters) ---------------------------

BEFORE_AND_AFTER = """
    import json, numpy as np, spark_hvd as hvd
    def probe():
        out = {}
        for what, fn in [
            ("allreduce", lambda: hvd.allreduce(np.ones(2), name="p.ar")),
            ("allgather", lambda: hvd.allgather(np.ones(2), name="p.ag")),
            ("broadcast", lambda: hvd.broadcast(np.ones(2), 0, name="p.bc")),
            ("alltoall", lambda: hvd.alltoall(np.ones(2), splits=[2], name="p.a2a")),
            ("reducescatter", lambda: hvd.reducescatter(np.ones(2), name="p.rs")),
            ("grouped_allreduce", lambda: hvd.grouped_allreduce([np.ones(2)], name="p.g")),
            ("barrier", hvd.barrier), ("join", hvd.join),
            ("broadcast_object", lambda: hvd.broadcast_object(1)),
            ("rank", hvd.rank), ("size", hvd.size), ("local_rank", hvd.local_rank),
        ]:
            try:
                fn()
                out[what] = "no error"
            except Exception as e:
                out[what] = type(e).__name__
        return out
    before = probe()
    hvd.init()
    ok = hvd.allreduce(np.ones(2), op=hvd.Sum, name="ok").tolist()
    hvd.shutdown()
    after = probe()
    hvd.init()
    again = hvd.allreduce(np.ones(2), op=hvd.Sum, name="again").tolist()
    hvd.shutdown()
    print(json.dumps({"before": before, "ok": ok, "after": after, "again": again}))
"""


@pytest.fixture(scope="module")
def lifecycle():
    proc = run_python(BEFORE_AND_AFTER)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("when", ["before", "after"])
def test_ops_outside_init_raise_not_initialized(lifecycle, when):
    wrong = {k: v for k, v in lifecycle[when].items() if v != "NotInitializedError"}
    assert not wrong, f"{when} init/shutdown, these did not raise NotInitializedError: {wrong}"


def test_init_again_after_shutdown(lifecycle):
    assert lifecycle["ok"] == [1.0, 1.0] and lifecycle["again"] == [1.0, 1.0]


def init_error(env_extra) -> str:
    """What init() raises (as InvalidArgumentError) in a fresh process with env_extra."""
    proc = run_python("""
        import spark_hvd as hvd
        try:
            hvd.init()
        except hvd.InvalidArgumentError as e:
            print("InvalidArgumentError", e)
    """, env_extra)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("InvalidArgumentError"), proc.stdout + proc.stderr
    return proc.stdout


def test_size_without_rendezvous_is_a_clear_error():
    assert "spark-hvdrun" in init_error({"SPARK_HVD_RANK": "0", "SPARK_HVD_SIZE": "2"})


@pytest.mark.parametrize("var", ["SPARK_HVD_CPU_OPERATIONS", "SPARK_HVD_GLOO_DATA_PLANE"])
def test_unknown_cpu_backend_is_a_clear_error(var):
    out = init_error({var: "udp"})
    assert var in out and "'udp' is not a CPU backend" in out, out
    assert "use one of: mpi, gloo, shm, tcp" in out, out


@pytest.mark.parametrize("backend", ["mpi"])
def test_cpu_backend_that_needs_mpirun_is_a_clear_error(backend):
    out = init_error({"SPARK_HVD_CPU_OPERATIONS": backend})
    assert "mpirun" in out and "--mpi" in out, out


def test_cpu_operations_gloo_runs_a_one_rank_job():
    code = textwrap.dedent("""
        import numpy as np, spark_hvd as hvd
        hvd.init()
        print(hvd.allreduce(np.arange(4.0), name="x").tolist())
        hvd.shutdown()
    """)
    env = dict(os.environ, SPARK_HVD_CPU_OPERATIONS="gloo", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[0.0, 1.0, 2.0, 3.0]", proc.stderr
