"""The GPU backends' cases, run by case_worker.py on 1, 2 and 3 ranks with the CUDA
runtime and NCCL of tests/fakes (test_mp_nccl.py sets SPARK_HVD_CUDA_LIBRARY and
SPARK_HVD_NCCL_LIBRARY): GPU tensors go through the numpy-level API with a device id.
On NCCL each rank has its own (fake) GPU, hvd.local_rank(); with
SPARK_HVD_GPU_OPERATIONS=tcp the tensors are staged through host memory and every rank
shares GPU 0 (SHVD_TEST_SHARED_GPU=1), which NCCL would refuse; where NCCL does not
load (SHVD_TEST_NO_NCCL=1) they are staged too, each rank on its own GPU.

"Device" memory comes from the fake cudaMalloc, which the host cannot touch (as on a GPU):
these cases fill and read it with copies on a stream of their own (``copy``), waited for
through an event, which is no device-wide synchronization; on a real GPU tests/gpu/ runs
the same ops through torch.
"""

from __future__ import annotations

# The core before numpy, so that engine_allocations() sees the C++ library's allocations
# too (csrc/common/alloc_count.h).
from spark_hvd import _core

import ctypes  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402

import numpy as np  # noqa: E402

import spark_hvd as hvd  # noqa: E402
from harness import Registry, Skip, expect_error, wait_for  # noqa: E402
from refdata import BF16, Checks, assert_same, dname, is_bool, reduce, values  # noqa: E402
from spark_hvd import _ops  # noqa: E402
from spark_hvd._types import OpType, numpy_code

CASES = Registry()
HANG_S = 20.0
OP = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max,
      "Product": hvd.Product}
NCCL_DTYPES = [np.dtype(t) for t in (np.uint8, np.int8, np.int32, np.int64, np.float16)] \
    + [BF16] + [np.dtype(t) for t in (np.float32, np.float64, np.bool_)]
SHAPES = [(0,), (1,), (7,), (3, 5), (129,)]
_cudart = None
_helpers = {}  # device -> (stream, event) of this process's own copies


def _lib():
    global _cudart
    if _cudart is None:
        _cudart = ctypes.CDLL(os.environ["SPARK_HVD_CUDA_LIBRARY"])  # the core's instance too
        _cudart.shvd_fake_sync_calls.restype = ctypes.c_ulonglong
    return _cudart


def _helper():
    d = device()
    if d not in _helpers:
        lib, s, e = _lib(), ctypes.c_void_p(), ctypes.c_void_p()
        assert lib.cudaSetDevice(d) == 0
        assert lib.cudaStreamCreateWithFlags(ctypes.byref(s), 1) == 0
        assert lib.cudaEventCreateWithFlags(ctypes.byref(e), 2) == 0
        _helpers[d] = (s, e)
    return _helpers[d]


def _wait_helper(s, e) -> None:
    assert _lib().cudaEventRecord(e, s) == 0
    assert _lib().cudaEventSynchronize(e) == 0


def copy(dst: int, src: int, nbytes: int, kind: int) -> None:
    """Copies between host and (fake) GPU memory on this process's own stream and waits
    for it through an event: no device-wide synchronizing call."""
    if nbytes:
        s, e = _helper()
        assert _lib().cudaMemcpyAsync(ctypes.c_void_p(dst), ctypes.c_void_p(src),
                                      ctypes.c_size_t(nbytes), kind, s) == 0
        _wait_helper(s, e)


class DeviceArray:
    """A (fake) GPU buffer holding an array's bytes; freed when the last reference goes,
    which for an op's buffers is when the core is done with the op."""

    def __init__(self, arr: np.ndarray) -> None:
        self.dtype, self.shape, self.nbytes = arr.dtype, arr.shape, arr.nbytes
        ptr = ctypes.c_void_p()
        assert _lib().cudaSetDevice(device()) == 0
        rc = _lib().cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(arr.nbytes))
        assert rc == 0, f"cudaMalloc failed: {rc}"
        self.ptr = ptr.value or 0
        self.write(arr)

    def write(self, arr: np.ndarray) -> None:
        host = np.ascontiguousarray(arr)
        copy(self.ptr, host.ctypes.data, self.nbytes, 1)  # host to device

    def fill(self, byte: int) -> None:
        s, e = _helper()
        assert _lib().cudaMemsetAsync(ctypes.c_void_p(self.ptr), byte,
                                      ctypes.c_size_t(self.nbytes), s) == 0
        _wait_helper(s, e)

    def numpy(self) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        copy(out.ctypes.data, self.ptr, self.nbytes, 2)  # device to host
        return out

    def __del__(self) -> None:
        if self.ptr:
            _lib().cudaFree(ctypes.c_void_p(self.ptr))


def sync_calls() -> int:
    """Device-synchronizing CUDA calls of this process since the last reset_sync_calls()."""
    return int(_lib().shvd_fake_sync_calls())


def sync_report() -> str:
    buf = ctypes.create_string_buffer(8192)
    _lib().shvd_fake_sync_report(buf, len(buf))
    return buf.value.decode()


def reset_sync_calls() -> None:
    _lib().shvd_fake_sync_reset()


# Staged through host memory on a CPU backend: asked for, or NCCL does not load (the
# staged_without_nccl mode of test_mp_nccl.py points SPARK_HVD_NCCL_LIBRARY nowhere).
NO_NCCL = bool(os.environ.get("SHVD_TEST_NO_NCCL"))
STAGED = bool(os.environ.get("SPARK_HVD_GPU_OPERATIONS")) or NO_NCCL


def device() -> int:
    return 0 if os.environ.get("SHVD_TEST_SHARED_GPU") else hvd.local_rank()


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_DL_CODE = {"i": 0, "u": 1, "f": 2, "b": 6}


def from_capsule(capsule, dt) -> np.ndarray:
    """A core-allocated GPU output (a DLPack capsule) read back: checks it says CUDA,
    this rank's device, the dtype; then copies the (fake device = host) bytes."""
    dt = np.dtype(dt)
    t = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    assert (t.device_type, t.device_id) == (2, device()), (t.device_type, t.device_id)
    assert t.bits == 8 * dt.itemsize and t.code == (4 if dt == BF16 else _DL_CODE[dt.kind]), \
        (t.code, t.bits, dt)
    assert not t.strides, "a compact tensor has no strides"
    shape = tuple(t.shape[i] for i in range(t.ndim))
    out = np.empty(shape, dt)
    copy(out.ctypes.data, t.data or 0, out.nbytes, 2)  # device to host
    return out


def _submit(op, arr: np.ndarray, name: str, inplace: bool = False, **kw) -> _ops.Handle:
    src = DeviceArray(arr)
    dst = src if inplace else DeviceArray(np.zeros_like(arr))
    return _ops.submit(op, name, numpy_code(arr.dtype), arr.shape, src.ptr, dst.ptr, (src, dst),
                       lambda r: dst.numpy(), device=device(), **kw)


def _gather_like(op, arr, name, **kw) -> _ops.Handle:
    src = DeviceArray(arr)
    return _ops.submit(op, name, numpy_code(arr.dtype), arr.shape, src.ptr, 0, src,
                       lambda r: (from_capsule(r[0], arr.dtype), list(r[2])), device=device(),
                       **kw)


def allreduce_async(arr, name, op="Sum", **kw):
    return _submit(OpType.ALLREDUCE, arr, name, reduce_op=OP[op], **kw)


def broadcast_async(arr, root, name, **kw):
    return _submit(OpType.BROADCAST, arr, name, inplace=True, root=root, **kw)


# -- allreduce: every NCCL dtype x op, several shapes in flight (fused) -------------------

def _allreduce_case(dt, op):
    def fn(ctx):
        if is_bool(dt) and op == "Average":
            err = expect_error(hvd.InvalidArgumentError, allreduce_async,
                               values(dt, ctx.rank, (3,)), f"g.ar.{dname(dt)}.{op}", op)
            assert "bool" in str(err), str(err)
            return
        chk = Checks()
        hs = [allreduce_async(values(dt, ctx.rank, shape, salt=k), f"g.ar.{dname(dt)}.{op}.{k}",
                              op) for k, shape in enumerate(SHAPES)]
        for k, shape in enumerate(SHAPES):
            want = reduce([values(dt, r, shape, salt=k) for r in range(ctx.size)], op, dt)
            chk.same(wait_for(hs[k], HANG_S, f"shape {shape}", ctx), want, f"shape {shape}")
        chk.done()
    return fn


for _dt in NCCL_DTYPES:
    for _op in OP:
        CASES.add(f"nccl_allreduce/{dname(_dt)}/{_op}", _allreduce_case(_dt, _op))


@CASES.case("nccl_setup/the_libraries_the_mode_says")
def _(ctx):
    """The mode tests what it says: without NCCL only the CUDA runtime loads (so the
    staged backend is the only one for GPU tensors); otherwise both load."""
    assert hvd.cuda_built(), "the fake CUDA runtime did not load"
    assert hvd.nccl_built() is not NO_NCCL, (hvd.nccl_built(), NO_NCCL)
    if NO_NCCL:
        assert "NCCL" in _core.nccl_unavailable_reason(), _core.nccl_unavailable_reason()


@CASES.case("nccl_allreduce/scale_factors")
def _(ctx):
    """Pre/postscale: PreMulSum for float Sum/Average, host staging for the rest."""
    chk = Checks()
    for dt in (np.float32, np.float16, BF16, np.float64, np.int32):
        for op in ("Sum", "Average", "Max", "Product"):
            for pre, post in ((2.0, 1.0), (1.0, 0.5), (2.0, 0.5)):
                name = f"g.sc.{dname(dt)}.{op}.{pre}.{post}"
                x = values(dt, ctx.rank, (11,))
                got = wait_for(allreduce_async(x, name, op, prescale=pre, postscale=post),
                               HANG_S, name, ctx)
                want = reduce([values(dt, r, (11,)) for r in range(ctx.size)], op, dt,
                              prescale=pre, postscale=post)
                chk.same(got, want, name)
    chk.done()


@CASES.case("nccl_allreduce/200_small_tensors_in_flight")
def _(ctx):
    chk = Checks()
    hs = [allreduce_async(values(np.float32, ctx.rank, (i % 17 + 1,), salt=i), f"g.many.{i}")
          for i in range(200)]
    for i, h in enumerate(hs):
        want = reduce([values(np.float32, r, (i % 17 + 1,), salt=i) for r in range(ctx.size)],
                      "Sum", np.float32)
        chk.same(wait_for(h, HANG_S, f"tensor {i}", ctx), want, f"tensor {i}")
    chk.done()


@CASES.case("nccl_allreduce/repeated_steps_cached")
def _(ctx):
    """The same names every step (response cache), and the fusion buffer reused."""
    chk = Checks()
    for step in range(20):
        hs = [allreduce_async(values(np.float32, ctx.rank, (64 * (j + 1),), salt=step + j),
                              f"g.step.{j}", "Average") for j in range(4)]
        for j, h in enumerate(hs):
            want = reduce([values(np.float32, r, (64 * (j + 1),), salt=step + j)
                           for r in range(ctx.size)], "Average", np.float32)
            chk.same(wait_for(h, HANG_S, f"step {step} tensor {j}", ctx), want,
                     f"step {step} tensor {j}")
    chk.done()


@CASES.case("nccl_allreduce/device_ops_stay_on_the_engine_thread_beside_blocking_cpu_ops")
def _(ctx):
    """A thread waiting for a blocking CPU op runs the engine's cycles itself (Engine::Drive)
    but never one that holds a GPU op: while a second thread makes blocking CPU allreduces,
    GPU allreduces submitted here all run on the engine thread (a cycle that ran one on an
    API thread stops the engine with an internal error: every op here would fail)."""
    import threading

    errors = []

    def cpu_loop():
        try:
            for i in range(150):
                got = hvd.allreduce(np.full(3, float(ctx.rank + i), np.float32), op=hvd.Sum,
                                    name="g.drive.cpu")
                want = sum(float(r + i) for r in range(ctx.size))
                assert np.all(got == want), (i, got, want)
        except Exception as exc:  # reported below, on the case's thread
            errors.append(exc)

    t = threading.Thread(target=cpu_loop)
    t.start()
    chk = Checks()
    for step in range(30):
        hs = [allreduce_async(values(np.float32, ctx.rank, (8,), salt=step + j),
                              f"g.drive.gpu.{j}", "Sum") for j in range(3)]
        for j, h in enumerate(hs):
            want = reduce([values(np.float32, r, (8,), salt=step + j) for r in range(ctx.size)],
                          "Sum", np.float32)
            chk.same(wait_for(h, HANG_S, f"step {step} gpu tensor {j}", ctx), want,
                     f"step {step} gpu tensor {j}")
    t.join(HANG_S)
    assert not t.is_alive(), "the CPU allreduce thread hangs"
    assert not errors, errors[0]
    chk.done()


# -- ops with core-allocated GPU outputs ---------------------------------------------------

@CASES.case("nccl_allgather/ragged_every_dtype")
def _(ctx):
    chk = Checks()
    for dt in NCCL_DTYPES:
        name = f"g.ag.{dname(dt)}"
        got, _ = wait_for(_gather_like(OpType.ALLGATHER, values(dt, ctx.rank, (ctx.rank + 1, 3)),
                                       name), HANG_S, name, ctx)
        want = np.concatenate([values(dt, r, (r + 1, 3)) for r in range(ctx.size)])
        chk.same(got, want, name)
    chk.done()


@CASES.case("nccl_allgather/equal_blocks_every_dtype")
def _(ctx):
    """Equal first dimensions: one ncclAllGather instead of a group of broadcasts."""
    chk = Checks()
    for dt in NCCL_DTYPES:
        for rows in (0, 2):
            name = f"g.age.{dname(dt)}.{rows}"
            got, _ = wait_for(_gather_like(OpType.ALLGATHER, values(dt, ctx.rank, (rows, 3)),
                                           name), HANG_S, name, ctx)
            want = np.concatenate([values(dt, r, (rows, 3)) for r in range(ctx.size)])
            chk.same(got, want, name)
    chk.done()


@CASES.case("nccl_alltoall/uneven_splits")
def _(ctx):
    n, me = ctx.size, ctx.rank
    splits = [(me + j) % 3 for j in range(n)]  # rows this rank sends to rank j (some 0)
    x = values(np.float32, me, (sum(splits), 2))
    got, received = wait_for(_gather_like(OpType.ALLTOALL, x, "g.a2a", splits=splits), HANG_S,
                             "alltoall", ctx)
    parts = []
    for r in range(n):
        theirs = [(r + j) % 3 for j in range(n)]
        start = sum(theirs[:me])
        parts.append(values(np.float32, r, (sum(theirs), 2))[start:start + theirs[me]])
    assert_same(got, np.concatenate(parts))
    assert received == [(r + me) % 3 for r in range(n)], received


@CASES.case("nccl_reducescatter/sum_and_average")
def _(ctx):
    chk = Checks()
    n, me = ctx.size, ctx.rank
    rows = 2 * n + 1
    base, rem = divmod(rows, n)
    mine = base + (1 if me < rem else 0)
    start = me * base + min(me, rem)
    for dt, op in ((np.float32, "Sum"), (np.float32, "Average"), (np.int64, "Max")):
        name = f"g.rs.{dname(dt)}.{op}"
        got, _ = wait_for(_gather_like(OpType.REDUCESCATTER, values(dt, me, (rows, 4)), name,
                                       reduce_op=OP[op]), HANG_S, name, ctx)
        full = reduce([values(dt, r, (rows, 4)) for r in range(n)], op, dt)
        chk.same(got, full[start:start + mine], name)
    chk.done()


@CASES.case("nccl_reducescatter/equal_blocks_every_dtype_op_and_scale")
def _(ctx):
    """Rows that split evenly: one ncclReduceScatter where NCCL has the reduction (scale
    factors with float Sum/Average as a premultiplied sum), the whole-tensor reduction
    for the rest (integer Average, scaled Min/Max/Product)."""
    chk = Checks()
    n, me = ctx.size, ctx.rank
    rows = 3 * n
    for dt in NCCL_DTYPES:
        for op in OP:
            if is_bool(dt) and op == "Average":
                continue
            # scaled 8-bit products wrap around (which the reference does not model)
            small = is_bool(dt) or dt.itemsize == 1
            scales = ((1.0, 1.0),) if small else ((1.0, 1.0), (2.0, 0.5))
            for pre, post in scales:
                name = f"g.rse.{dname(dt)}.{op}.{pre}.{post}"
                got, _ = wait_for(_gather_like(OpType.REDUCESCATTER, values(dt, me, (rows, 3)),
                                               name, reduce_op=OP[op], prescale=pre,
                                               postscale=post), HANG_S, name, ctx)
                full = reduce([values(dt, r, (rows, 3)) for r in range(n)], op, dt,
                              prescale=pre, postscale=post)
                chk.same(got, full[3 * me:3 * me + 3], name)
    chk.done()


# -- broadcast -----------------------------------------------------------------------------

@CASES.case("nccl_broadcast/every_root_every_dtype")
def _(ctx):
    chk = Checks()
    for root in range(ctx.size):
        for dt in NCCL_DTYPES + [np.dtype(np.int16)]:
            name = f"g.bc.{root}.{dname(dt)}"
            x = values(dt, ctx.rank, (5, 3), salt=root)
            if dt == np.int16 and not STAGED:  # no NCCL type: refused at submit
                err = expect_error(hvd.InvalidArgumentError, broadcast_async, x, root, name)
                assert "int16" in str(err), str(err)
                continue
            got = wait_for(broadcast_async(x, root, name), HANG_S, name, ctx)
            chk.same(got, values(dt, root, (5, 3), salt=root), name)
    chk.done()


# -- process sets, CPU and GPU together, errors -------------------------------------------------

@CASES.case("nccl_process_set/first_and_last")
def _(ctx):
    if ctx.size < 2:
        raise Skip("a process set smaller than the job needs 2 ranks")
    ranks = [0, ctx.size - 1]
    ps = hvd.add_process_set(ranks)
    try:
        if ctx.rank in ranks:
            got = wait_for(allreduce_async(values(np.float32, ctx.rank, (9,)), "g.ps", "Sum",
                                           process_set=ps), HANG_S, "set allreduce", ctx)
            assert_same(got, reduce([values(np.float32, r, (9,)) for r in ranks], "Sum",
                                    np.float32))
        hvd.barrier()
    finally:
        hvd.remove_process_set(ps)


# -- streams: the op waits for the stream that produced its input ---------------------------

def _produced_late(arr: np.ndarray, stream: int):
    """A device buffer that holds zeros until `stream` has run about 300 queued items
    (60 ms at the fake's 200 us each) and then a copy of `arr`: an op that reads it
    without waiting for `stream` reads zeros. Returns what must stay alive meanwhile."""
    lib = _lib()
    buf = DeviceArray(np.zeros_like(arr))
    busy = DeviceArray(np.zeros(64, np.uint8))
    for _ in range(300):
        assert lib.cudaMemsetAsync(ctypes.c_void_p(busy.ptr), 0, ctypes.c_size_t(64),
                                   ctypes.c_void_p(stream)) == 0
    host = np.ascontiguousarray(arr)
    assert lib.cudaMemcpyAsync(ctypes.c_void_p(buf.ptr), ctypes.c_void_p(host.ctypes.data),
                               ctypes.c_size_t(host.nbytes), 1, ctypes.c_void_p(stream)) == 0
    return buf, (buf, host, busy)


def _waits_for(stream: int, ctx, label: str) -> None:
    x = values(np.float32, ctx.rank, (1000,))
    buf, keep = _produced_late(x, stream)
    h = _ops.submit(OpType.ALLREDUCE, f"g.stream.{label}", numpy_code(x.dtype), x.shape, buf.ptr,
                    buf.ptr, keep, lambda r: buf.numpy(), reduce_op=hvd.Sum, device=device(),
                    stream=stream)
    got = wait_for(h, HANG_S, f"allreduce after work on the {label} stream", ctx)
    assert_same(got, reduce([values(np.float32, r, (1000,)) for r in range(ctx.size)], "Sum",
                            np.float32))


@CASES.case("nccl_streams/the_default_stream_is_waited_for")
def _(ctx):
    """Stream 0 is the legacy default stream, where torch's default stream queues its
    kernels: the core's own (non-blocking) stream must wait for it."""
    _waits_for(0, ctx, "default")


@CASES.case("nccl_streams/a_side_stream_is_waited_for")
def _(ctx):
    lib = _lib()
    stream = ctypes.c_void_p()
    assert lib.cudaSetDevice(device()) == 0
    assert lib.cudaStreamCreateWithFlags(ctypes.byref(stream), 1) == 0
    try:
        _waits_for(stream.value, ctx, "side")
    finally:
        assert lib.cudaStreamDestroy(stream) == 0


@CASES.case("nccl_streams/work_queued_after_submit_is_not_waited_for")
def _(ctx):
    """The op waits only for what its producer stream had queued when it was submitted
    (the ready event recorded at submit), not for compute queued there afterwards (here
    a 0.5 s kernel queued inside the submit block, before the op reaches the engine): it
    completes while that kernel still runs, so communication overlaps the backward pass."""
    lib = _lib()
    stream, chain = ctypes.c_void_p(), ctypes.c_void_p()
    assert lib.cudaSetDevice(device()) == 0
    assert lib.cudaStreamCreateWithFlags(ctypes.byref(stream), 1) == 0
    assert lib.cudaEventCreateWithFlags(ctypes.byref(chain), 2) == 0
    x = values(np.float32, ctx.rank, (300,))
    buf = DeviceArray(x)
    try:
        with _ops.submit_together():
            h = _ops.submit(OpType.ALLREDUCE, "g.overlap", numpy_code(x.dtype), x.shape, buf.ptr,
                            buf.ptr, buf, lambda r: None, reduce_op=hvd.Sum, device=device(),
                            stream=stream.value)
            assert lib.shvd_fake_launch_kernel(stream, ctypes.c_uint(500000)) == 0
            assert lib.cudaEventRecord(chain, stream) == 0
        wait_for(h, HANG_S, "allreduce submitted before the kernel", ctx)
        still_running = lib.cudaEventQuery(chain) == 600
        assert_same(buf.numpy(), reduce([values(np.float32, r, (300,)) for r in range(ctx.size)],
                                        "Sum", np.float32))
        assert still_running, ("the allreduce completed only after the kernel queued on its "
                               "producer stream after its submit: it waited for that work")
    finally:
        assert lib.cudaEventSynchronize(chain) == 0
        assert lib.cudaStreamDestroy(stream) == 0
        assert lib.cudaEventDestroy(chain) == 0


@CASES.case("nccl_mixed/cpu_and_gpu_ops_in_flight")
def _(ctx):
    n = ctx.size
    g = allreduce_async(values(np.float64, ctx.rank, (33,)), "g.mixed.gpu")
    c = hvd.allreduce_async(values(np.float64, ctx.rank, (33,)), name="g.mixed.cpu", op=hvd.Sum)
    want = reduce([values(np.float64, r, (33,)) for r in range(n)], "Sum", np.float64)
    assert_same(wait_for(g, HANG_S, "GPU allreduce", ctx), want)
    assert_same(wait_for(c, HANG_S, "CPU allreduce", ctx), want)


@CASES.case("nccl_errors/int16_refused_at_submit")
def _(ctx):
    if STAGED:  # staged through host memory, int16 is a dtype like the others
        got = wait_for(allreduce_async(np.ones(3, np.int16), "g.err.int16"), HANG_S, "int16", ctx)
        assert_same(got, np.full(3, ctx.size, np.int16))
        return
    for op in (OpType.ALLREDUCE, OpType.ALLGATHER):
        err = expect_error(hvd.InvalidArgumentError, _submit, op, np.ones(3, np.int16),
                           f"g.err.int16.{op}")
        assert "int16" in str(err) and "device" in str(err), str(err)
    # and the engine works on
    assert_same(wait_for(allreduce_async(np.ones(2, np.float32), "g.err.after"), HANG_S,
                         "allreduce after the refusals", ctx),
                np.full(2, float(ctx.size), np.float32))


@CASES.case("nccl_errors/cpu_on_one_rank_gpu_on_others")
def _(ctx):
    if ctx.size < 2:
        raise Skip("a mismatch needs 2 ranks")
    x = np.ones(4, np.float32)
    if ctx.rank == ctx.size - 1:
        h = hvd.allreduce_async(x, name="g.mm.device", op=hvd.Sum)
    else:
        h = allreduce_async(x, "g.mm.device")
    err = expect_error(hvd.TensorMismatchError, wait_for, h, HANG_S, "mismatched device", ctx)
    assert "device" in str(err) and "GPU" in str(err) and "CPU" in str(err), str(err)


@CASES.case("nccl_lifetime/dropped_handles")
def _(ctx):
    """Handles dropped at once on all but one rank a round; the keeper checks the results,
    which are right only if every dropping rank's (device) buffers stayed alive."""
    if ctx.size < 2:
        raise Skip("a dropping rank needs a peer that checks")
    chk = Checks()
    for i in range(60):
        keeper = i % ctx.size
        hs = [allreduce_async(values(np.float32, ctx.rank, (300,), salt=i + k), f"g.drop.{i}.{k}")
              for k in range(3)]
        hs.append(broadcast_async(values(np.int32, ctx.rank, (40,), salt=i), keeper,
                                  f"g.drop.{i}.bc"))
        if ctx.rank != keeper:
            del hs
            gc.collect()
            junk = [DeviceArray(np.full(300, -7.0, np.float32)) for _ in range(3)]  # noqa: F841
            continue
        for k in range(3):
            want = reduce([values(np.float32, r, (300,), salt=i + k) for r in range(ctx.size)],
                          "Sum", np.float32)
            chk.same(wait_for(hs[k], HANG_S, f"round {i} op {k}", ctx), want, f"round {i} op {k}")
        chk.same(wait_for(hs[3], HANG_S, f"round {i} broadcast", ctx),
                 values(np.int32, keeper, (40,), salt=i), f"round {i} broadcast")
    hvd.barrier()
    chk.done()


# -- steady state: no device-wide synchronization per op ---------------------------------

STEADY_STEPS = 100  # at 2 ranks; 10 at 1 and 3 (CI time)


class _SteadyStep:
    """Every GPU op a training step may run, on buffers allocated once: allreduce (alone,
    fused in a group with Average, prescaled, integer Average), broadcast, allgather (equal
    and ragged), a sparse allreduce's int64 indices and values (ragged allgathers
    submitted together, as sparse_allreduce_async does), alltoall, reducescatter (equal
    and uneven blocks) and a grouped reducescatter. run() submits them
    all, waits, reads every output back (core-allocated ones through their DLPack
    capsules, which are then dropped, as a framework frees a tensor) and, when asked,
    checks the values."""

    def __init__(self, ctx) -> None:
        n, me = ctx.size, ctx.rank
        self.n, self.me = n, me
        f32 = np.dtype(np.float32)
        self.reduce = [  # (name, dtype, shape, op, prescale, group)
            ("s.ar", f32, (1000,), "Sum", 1.0, ""),
            ("s.grp.0", f32, (64,), "Average", 1.0, "s.grp"),
            ("s.grp.1", f32, (7, 3), "Average", 1.0, "s.grp"),
            ("s.half", np.dtype(np.float16), (33,), "Sum", 1.0, ""),
            ("s.pre", np.dtype(np.float64), (50,), "Sum", 2.0, ""),
            ("s.iavg", np.dtype(np.int32), (40,), "Average", 1.0, ""),
        ]
        self.bufs = {}
        for name, dt, shape, _, _, _ in self.reduce:
            self.bufs[name] = (DeviceArray(values(dt, me, shape)), DeviceArray(np.zeros(shape, dt)))
        self.bc = DeviceArray(values(np.dtype(np.int64), me, (5, 2)))
        self.splits = [(me + j) % 3 for j in range(n)]
        self.gather_inputs = {
            "s.age": values(f32, me, (2, 3)), "s.agr": values(f32, me, (me + 1, 3)),
            "s.a2a": values(f32, me, (sum(self.splits), 2)),
            "s.rse": values(f32, me, (3 * n, 2)), "s.rsu": values(f32, me, (2 * n + 1, 2)),
            "s.sp.idx": values(np.dtype(np.int64), me, (me + 2, 2)),
            "s.sp.val": values(f32, me, (me + 2,)),
            "s.grs.0": values(f32, me, (2 * n, 3)), "s.grs.1": values(f32, me, (n, 5))}
        self.gather_bufs = {k: DeviceArray(v) for k, v in self.gather_inputs.items()}

    def _on(self, op, name, src, dst, arr, **kw):
        return _ops.submit(op, name, numpy_code(arr.dtype), arr.shape, src.ptr,
                           dst.ptr if dst is not None else 0, (src, dst), lambda r: r,
                           device=device(), **kw)

    def run(self, ctx, check: bool) -> None:
        n, me = self.n, self.me
        hs = {}
        # One batch, so that every step is negotiated, fused and allocated alike (ops
        # submitted apart may fall into one engine cycle or two, as timing has it).
        with _ops.submit_together():
            for name, dt, shape, op, pre, group in self.reduce:
                src, dst = self.bufs[name]
                hs[name] = self._on(OpType.ALLREDUCE, name, src, dst, np.empty(shape, dt),
                                    reduce_op=OP[op], prescale=pre, group=group,
                                    group_size=2 if group else 0)
            bc_arr = np.empty((5, 2), np.int64)
            hs["s.bc"] = self._on(OpType.BROADCAST, "s.bc", self.bc, self.bc, bc_arr,
                                  root=n - 1)
            for name, arr in self.gather_inputs.items():
                op = OpType.ALLTOALL if name == "s.a2a" else \
                    OpType.REDUCESCATTER if name.startswith(("s.rs", "s.grs")) else \
                    OpType.ALLGATHER
                kw = {"splits": self.splits} if op == OpType.ALLTOALL else \
                    {"reduce_op": hvd.Sum} if op == OpType.REDUCESCATTER else {}
                if name.startswith("s.grs"):
                    kw.update(group="s.grs", group_size=2)
                hs[name] = self._on(op, name, self.gather_bufs[name], None, arr, **kw)
        got = {}
        for name, h in hs.items():
            r = wait_for(h, HANG_S, name, ctx)
            if name in self.bufs:
                got[name] = self.bufs[name][1].numpy()
            elif name == "s.bc":
                got[name] = self.bc.numpy()
            else:
                got[name] = from_capsule(r[0], self.gather_inputs[name].dtype)
            del r  # the capsule: its memory goes back to the core
        if not check:
            return
        chk = Checks()
        for name, dt, shape, op, pre, _ in self.reduce:
            chk.same(got[name], reduce([values(dt, r, shape) for r in range(n)], op, dt,
                                       prescale=pre), name)
        chk.same(got["s.bc"], values(np.dtype(np.int64), n - 1, (5, 2)), "s.bc")
        f32 = np.dtype(np.float32)
        chk.same(got["s.age"], np.concatenate([values(f32, r, (2, 3)) for r in range(n)]),
                 "s.age")
        chk.same(got["s.agr"], np.concatenate([values(f32, r, (r + 1, 3)) for r in range(n)]),
                 "s.agr")
        parts = []
        for r in range(n):
            theirs = [(r + j) % 3 for j in range(n)]
            start = sum(theirs[:me])
            parts.append(values(f32, r, (sum(theirs), 2))[start:start + theirs[me]])
        chk.same(got["s.a2a"], np.concatenate(parts), "s.a2a")
        full = reduce([values(f32, r, (3 * n, 2)) for r in range(n)], "Sum", f32)
        chk.same(got["s.rse"], full[3 * me:3 * me + 3], "s.rse")
        rows = 2 * n + 1
        base, rem = divmod(rows, n)
        first = me * base + min(me, rem)
        full = reduce([values(f32, r, (rows, 2)) for r in range(n)], "Sum", f32)
        chk.same(got["s.rsu"], full[first:first + base + (1 if me < rem else 0)], "s.rsu")
        i64 = np.dtype(np.int64)
        chk.same(got["s.sp.idx"], np.concatenate([values(i64, r, (r + 2, 2)) for r in range(n)]),
                 "s.sp.idx")
        chk.same(got["s.sp.val"], np.concatenate([values(f32, r, (r + 2,)) for r in range(n)]),
                 "s.sp.val")
        for name, rows, cols in (("s.grs.0", 2, 3), ("s.grs.1", 1, 5)):
            full = reduce([values(f32, r, (rows * n, cols)) for r in range(n)], "Sum", f32)
            chk.same(got[name], full[rows * me:rows * (me + 1)], name)
        chk.done()


@CASES.case("nccl_steady/no_device_wide_sync_in_steady_steps_of_every_op", timeout_s=90.0)
def _(ctx):
    """After a warm-up, 100 steps (at 2 ranks; 10 at 1 and 3) of every GPU op make no
    device-synchronizing CUDA call in this process (cudaMalloc/cudaFree,
    cudaMallocHost/cudaFreeHost, cudaDeviceSynchronize, a cudaStreamSynchronize of a stream
    the core does not own): the core reuses its device and pinned memory across steps, and a
    dropped output goes back to it, not to cudaFree.
    The fake's streams run each item 20 us late here (200 elsewhere), to keep 100 steps
    short."""
    lib = _lib()
    lib.shvd_fake_set_delay_us(20)
    try:
        step = _SteadyStep(ctx)
        for i in range(3):  # warm-up: communicators, pools, caches
            step.run(ctx, check=i == 0)
        hvd.barrier()
        gc.collect()  # earlier cases' garbage (its buffers' cudaFree) is not this test's
        gc.disable()
        steps = STEADY_STEPS if ctx.size == 2 else 10
        reset_sync_calls()
        try:
            for i in range(steps):
                step.run(ctx, check=i == steps - 1)
            calls, report = sync_calls(), sync_report()
        finally:
            gc.enable()
        hvd.barrier()
        assert calls == 0, (f"{calls} device-synchronizing CUDA calls in {steps} steady steps: "
                            f"{report}")
    finally:
        lib.shvd_fake_set_delay_us(200)


@CASES.case("nccl_steady/no_heap_allocation_per_op_on_the_core_threads", timeout_s=90.0)
def _(ctx):
    """After a warm-up, steady steps of GPU allreduces (fused and not) and a broadcast into
    buffers the caller owns make no heap allocation on the engine's thread nor on the
    thread that completes device work (InFlight), counted as in cases_alloc.py: the GPU
    path's per-op state (the inputs' ready events and streams, the pending work, the
    entries handed to InFlight) is kept and reused, never allocated per op."""
    import cases_alloc

    n, me = ctx.size, ctx.rank
    f32 = np.dtype(np.float32)
    shapes = [(64,), (7, 3), (1000,), (5,), (33,), (2, 2), (17,), (128,)]
    bufs = [(DeviceArray(values(f32, me, s, salt=k)), DeviceArray(np.zeros(s, f32)))
            for k, s in enumerate(shapes)]
    bc = DeviceArray(values(f32, me, (6,)))
    root = n - 1
    wants = [reduce([values(f32, r, s, salt=k) for r in range(n)], "Sum", f32)
             for k, s in enumerate(shapes)]
    name = "nccl.steady.alloc.a.name.longer.than.the.inline.buffer"

    def on(op, i, src, dst, shape, **kw):
        return _ops.submit(op, f"{name}.{i}", numpy_code(f32), shape, src.ptr, dst.ptr,
                           (src, dst), lambda r: r, device=device(), **kw)

    def step(i):
        with _ops.submit_together():
            hs = [on(OpType.ALLREDUCE, k, src, dst, shapes[k], reduce_op=hvd.Sum)
                  for k, (src, dst) in enumerate(bufs)]
            hs.append(on(OpType.BROADCAST, "bc", bc, bc, (6,), root=root))
        for h in hs:
            wait_for(h, HANG_S, "a steady GPU op", ctx)
        if i == 0:
            chk = Checks()
            for k, (_, dst) in enumerate(bufs):
                chk.same(dst.numpy(), wants[k], f"allreduce {k}")
            chk.same(bc.numpy(), values(f32, root, (6,)), "broadcast")
            chk.done()

    cases_alloc.check_steady(ctx, step, steps=50)


# -- the C entry points: what spark_hvd's TensorFlow GPU kernels hand the core ---------------

def _capi():
    """(driver, api): the C entry points' test driver (tests/fakes/capi_driver.cc) and the
    core's table of them, as spark_hvd.tensorflow binds its kernels to it."""
    driver = ctypes.CDLL(os.environ["SHVD_CAPI_DRIVER"])
    driver.shvd_capi_run.restype = ctypes.c_int32
    driver.shvd_capi_owners_released.restype = ctypes.c_int64
    get_api = ctypes.CDLL(_core.__file__).spark_hvd_c_api
    get_api.restype, get_api.argtypes = ctypes.c_void_p, [ctypes.c_int32]
    return driver, ctypes.c_void_p(get_api(1))


def _capi_run(driver, api, op, name, arr, in_ptr, out_ptr, stream, ctx, reduce_op=0):
    shape = (ctypes.c_int64 * max(arr.ndim, 1))(*arr.shape)
    work, msg = ctypes.c_void_p(), ctypes.create_string_buffer(1024)
    rc = driver.shvd_capi_run(api, int(op), name.encode(), int(numpy_code(arr.dtype)), shape,
                              arr.ndim, ctypes.c_void_p(in_ptr), ctypes.c_void_p(out_ptr),
                              int(reduce_op), 0, device(), ctypes.c_void_p(stream),
                              int(HANG_S * 1000), ctypes.byref(work), msg, len(msg))
    assert rc == 0, f"{name} on rank {ctx.rank}: code {rc}: {msg.value.decode()}"
    return work


@CASES.case("nccl_capi/device_ops_through_the_c_entry_points")
def _(ctx):
    """The C entry points with device memory, as spark_hvd's TensorFlow GPU kernels use them
    (TensorFlow's CPU build cannot hand out a device tensor): an allreduce whose input its
    producer stream writes late (the ready event recorded at submit is waited for), and an
    allgather whose output the core allocates on the device; each completes through its
    callback, the owner of its buffers is released once, and the output is readable until
    the handle is released; then 20 such allgathers make no device-synchronizing CUDA call
    (their outputs come from the core's pool and go back to it)."""
    driver, api = _capi()
    lib = _lib()
    stream = ctypes.c_void_p()
    assert lib.cudaSetDevice(device()) == 0
    assert lib.cudaStreamCreateWithFlags(ctypes.byref(stream), 1) == 0
    try:
        released = driver.shvd_capi_owners_released()
        x = values(np.float32, ctx.rank, (1000,))
        buf, keep = _produced_late(x, stream.value)
        work = _capi_run(driver, api, OpType.ALLREDUCE, "g.capi.allreduce", x, buf.ptr, buf.ptr,
                         stream.value, ctx, reduce_op=hvd.Sum)
        summed = buf.numpy()
        driver.shvd_capi_release(api, work)
        rows = np.full((ctx.rank + 1, 3), ctx.rank, np.int32)
        src = DeviceArray(rows)
        work = _capi_run(driver, api, OpType.ALLGATHER, "g.capi.allgather", rows, src.ptr, 0,
                         0, ctx)
        data, nbytes = ctypes.c_void_p(), ctypes.c_int64()
        dev, shape, ndim = ctypes.c_int32(), (ctypes.c_int64 * 8)(), ctypes.c_int32()
        driver.shvd_capi_output(api, work, ctypes.byref(data), ctypes.byref(nbytes),
                                ctypes.byref(dev), shape, ctypes.byref(ndim))
        gathered = np.empty(tuple(shape[i] for i in range(ndim.value)), np.int32)
        copy(gathered.ctypes.data, data.value or 0, gathered.nbytes, 2)  # device to host
        driver.shvd_capi_release(api, work)
        hvd.barrier()
        owners = driver.shvd_capi_owners_released() - released

        def gather_once():  # a device output the core allocates, released by its owner
            driver.shvd_capi_release(api, _capi_run(driver, api, OpType.ALLGATHER,
                                                    "g.capi.steady", rows, src.ptr, 0, 0, ctx))
        for _ in range(3):  # warm-up
            gather_once()
        hvd.barrier()
        gc.collect()
        gc.disable()
        reset_sync_calls()
        try:
            for _ in range(20):
                gather_once()
            calls, report = sync_calls(), sync_report()
        finally:
            gc.enable()
        hvd.barrier()
    finally:
        assert lib.cudaStreamDestroy(stream) == 0
    assert_same(summed, reduce([values(np.float32, r, (1000,)) for r in range(ctx.size)], "Sum",
                               np.float32))
    assert dev.value == device() and nbytes.value == gathered.nbytes, (dev.value, nbytes.value)
    assert_same(gathered, np.concatenate([np.full((r + 1, 3), r, np.int32)
                                          for r in range(ctx.size)]))
    assert owners == 2, f"{owners} owners released for 2 ops"
    assert calls == 0, f"{calls} device-synchronizing CUDA calls in 20 steady allgathers " \
                       f"through the C entry points: {report}"
