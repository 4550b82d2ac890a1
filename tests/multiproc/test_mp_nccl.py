"""The GPU backends on 1, 2 and 3 ranks through the fake CUDA runtime and NCCL of
tests/fakes (built here; CI has no GPU): the op matrix of cases_nccl.py on NCCL (one GPU
per rank, in exclusive-process mode), staged through host memory on the tcp backend
(SPARK_HVD_GPU_OPERATIONS=tcp, every rank on GPU 0, which NCCL refuses) and staged because
NCCL does not load; a rank SIGKILLed in the middle of a GPU allreduce on NCCL (every
survivor raises PeerLostError naming it within 10 s), and a rank whose GPU stalls (every
rank raises CollectiveTimeoutError after SPARK_HVD_TIMEOUT_S).

The fault scripts make a rank's GPU slow at the moment they choose
(shvd_fake_set_delay_us) and wait on conditions (the fake NCCL's count of calls made,
cudaDeviceSynchronize), never on a sleep."""

import json
import os
import signal
import time

import pytest

import cases_nccl
from _ranks import PYTHON, DirectJob, script_job
from fakes.build import cached_fakes, fake_env

pytestmark = pytest.mark.nccl
NAMES = cases_nccl.CASES.names()
DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def gpu_env(tmp_path_factory):
    """The fakes, 3 GPUs per process, in exclusive-process compute mode: a rank whose
    threads make a CUDA call without setting its device claims GPU 0 and fails."""
    exclusive = tmp_path_factory.mktemp("exclusive_gpus")
    return dict(fake_env(cached_fakes(), devices=3), SHVD_FAKE_CUDA_EXCLUSIVE_DIR=str(exclusive))


MODES = {
    "nccl": {},
    # every rank on GPU 0: the Default compute mode, not exclusive
    "staged_shared_gpu": {"SPARK_HVD_GPU_OPERATIONS": "tcp", "SHVD_TEST_SHARED_GPU": "1",
                          "SHVD_FAKE_CUDA_EXCLUSIVE_DIR": ""},
    # NCCL does not load, the CUDA runtime does: the staged backend takes GPU tensors
    "staged_without_nccl": {"SPARK_HVD_NCCL_LIBRARY": "/nonexistent/libnccl.so.2",
                            "SHVD_TEST_NO_NCCL": "1"},
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("np", [1, 2, 3])
@pytest.mark.parametrize("case", NAMES)
def test_case(case_runs, gpu_env, case, np, mode):
    case_runs.get("cases_nccl", np, env=dict(gpu_env, **MODES[mode])).check(case)


# What the fault scripts start with: imports, init, `out` (the results folder), `me`, `rt`
# (the fake CUDA runtime), die(), die_once_issued() and report(handle).
PRELUDE = r'''
import ctypes, json, os, signal, sys, time
here = os.environ["SHVD_TESTS_MULTIPROC"]
sys.path[:0] = [here, os.path.dirname(here)]
import numpy as np
import spark_hvd as hvd
from spark_hvd import _ops
from spark_hvd._types import OpType, numpy_code
import cases_nccl as g

out = sys.argv[1]
hvd.init()
me = hvd.rank()
rt = g._lib()
nccl = ctypes.CDLL(os.environ["SPARK_HVD_NCCL_LIBRARY"])
nccl.shvd_fake_nccl_calls.restype = ctypes.c_ulonglong


def die_once_issued(before):
    """Waits until this rank's engine made an NCCL call after `before` calls (the op was
    negotiated and queued on its GPU stream), then dies."""
    deadline = time.time() + 30
    while nccl.shvd_fake_nccl_calls() <= before and time.time() < deadline:
        time.sleep(0.001)
    die()


def die():
    """SIGKILLs this rank, writing first when (out/killed_at)."""
    with open(os.path.join(out, "killed_at"), "w") as f:
        json.dump({"at": time.time()}, f)
    os.kill(os.getpid(), signal.SIGKILL)


def report(h):
    """Waits for h and writes result<me>: the error it raised (if any) and when."""
    try:
        hvd.synchronize(h)
        res = {"error": None}
    except Exception as e:
        res = {"error": type(e).__name__, "message": str(e), "ranks": getattr(e, "ranks", [])}
    res["at"] = time.time()
    with open(os.path.join(out, f"result{me}"), "w") as f:
        json.dump(res, f)
'''

KILL_SCRIPT = PRELUDE + r'''
for i in range(3):
    g.wait_for(g.allreduce_async(np.ones(1 << 16, np.float32), f"warm.{i}"), 20, "warm-up")
x = g.DeviceArray(np.ones(1 << 20, np.float32))
hvd.barrier()
before = nccl.shvd_fake_nccl_calls()
if me == 2:  # from now on this rank's GPU takes a minute per stream item: its part of
    rt.shvd_fake_set_delay_us(60 * 1000 * 1000)  # the collective never reaches its peers
h = _ops.submit(OpType.ALLREDUCE, "big", numpy_code(np.float32), (1 << 20,), x.ptr, x.ptr, x,
                lambda r: None, reduce_op=hvd.Sum, device=g.device())
if me == 2:
    die_once_issued(before)  # the peers' collective waits for a contribution that never comes
report(h)
'''


def test_rank_killed_mid_gpu_allreduce(gpu_env, tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    env = dict(gpu_env, SHVD_TESTS_MULTIPROC=os.path.dirname(os.path.abspath(__file__)))
    job = DirectJob(3, [PYTHON, str(script), str(tmp_path)], env=env)
    try:
        codes = job.wait(DEADLINE_S + 30)
        logs = job.outputs()
        assert codes[2] == -signal.SIGKILL, (codes, logs)
        killed = json.loads((tmp_path / "killed_at").read_text())["at"]
        for r in (0, 1):
            path = tmp_path / f"result{r}"
            assert path.exists(), f"rank {r} did not report (exit {codes[r]})\n{logs}"
            res = json.loads(path.read_text())
            print(f"rank {r}: {res['at'] - killed:.2f} s after the kill: {res}")
            assert res["error"] == "PeerLostError", (res, logs)
            assert 2 in res["ranks"] and "2" in res["message"], res
            assert res["at"] - killed < DEADLINE_S, (res["at"] - killed, res)
    finally:
        job.close()


LATE_COPY_SCRIPT = PRELUDE + r'''
import ctypes, gc
pool = []  # buffers the core let go of: a caching allocator's free list, as torch's


class Owner:
    """Keeps an op's (fake) GPU buffers; when the core lets go of it, they go to `pool`
    for reuse, not to cudaFree (whose device-wide wait would hide a late write)."""

    def __init__(self, bufs):
        self.bufs = bufs

    def __del__(self):
        pool.extend(self.bufs)


probe = g.allreduce_async(np.ones(8, np.float32), "probe")
probe_work = probe.work  # kept: its poll() is a cheap binding call
g.wait_for(probe, 20, "warm-up")
n = 1 << 14
arrays = [(g.DeviceArray(np.ones(n, np.float32)), g.DeviceArray(np.zeros(n, np.float32)))
          for k in range(2)]
outs = [dst.ptr for _, dst in arrays]
hvd.barrier()
before = nccl.shvd_fake_nccl_calls()
# From now on every stream item waits 400 ms (rank 2's a minute: its part never ships), so
# the copies out of the fusion buffer run long after the collective failed.
rt.shvd_fake_set_delay_us(60 * 1000 * 1000 if me == 2 else 400 * 1000)
hs = []
with _ops.submit_together():  # fused: the outputs are copied out of the fusion buffer
    for k, (src, dst) in enumerate(arrays):  # behind the collective, on the NCCL stream
        hs.append(_ops.submit(OpType.ALLREDUCE, f"late.{k}", numpy_code(np.float32), (n,),
                              src.ptr, dst.ptr, Owner([src, dst]), lambda r: None,
                              reduce_op=hvd.Sum, device=g.device()))
del arrays, src, dst
if me == 2:
    die_once_issued(before)
errors = []
for h in hs:
    try:
        hvd.synchronize(h)
    except Exception as e:
        errors.append(type(e).__name__)
failed_at = time.time()
del hs, h
gc.collect()
# Reuse the outputs the moment the core gives them back: a copy of the failed op that
# runs after that writes into reused memory.
deadline = time.time() + 30
while sum(b.ptr in outs for b in pool) < 2 and time.time() < deadline:
    probe_work.poll()  # a binding call: drops the references the core released
    time.sleep(0.005)
reused = [b for b in pool if b.ptr in outs]
for b in reused:
    b.fill(0x5A)
given_back = time.time() - failed_at
rt.cudaDeviceSynchronize()  # every queued copy, the failed op's included, has run
intact = all(bool(np.all(b.numpy().view(np.uint8) == 0x5A)) for b in reused)
with open(os.path.join(out, f"result{me}"), "w") as f:
    json.dump({"errors": errors, "reused": len(reused), "intact": intact,
               "given_back_s": given_back}, f)
'''


def test_a_failed_ops_buffers_stay_until_its_queued_copies_ran(gpu_env, tmp_path):
    """Rank 2 dies while a fused GPU allreduce waits for it: the survivors' ops fail at
    once, but the copies out of the fusion buffer queued behind the aborted collective
    still run. The callers' buffers are released only after them, so memory reused the
    moment it is given back (as torch's caching allocator does) is never written."""
    env = dict(gpu_env, SHVD_TESTS_MULTIPROC=os.path.dirname(os.path.abspath(__file__)))
    with script_job(3, LATE_COPY_SCRIPT, tmp_path, env, DEADLINE_S + 40) as (codes, logs):
        assert codes[2] == -signal.SIGKILL, (codes, logs)
        for r in (0, 1):
            path = tmp_path / f"result{r}"
            assert path.exists(), f"rank {r} did not report (exit {codes[r]})\n{logs}"
            res = json.loads(path.read_text())
            print(f"rank {r}: {res}")
            assert res["errors"] == ["PeerLostError"] * 2, (res, logs)
            assert res["reused"] == 2, (res, logs)
            assert res["intact"], (res, logs)


INIT_FAIL_SCRIPT = PRELUDE + r'''
x = g.DeviceArray(np.ones(8, np.float32))
# Rank 1's NCCL init fails at once with a system error (as on a node whose /dev/shm is too
# small): its first GPU op fails before it joins the NCCL communicator, and it exits; rank 0
# is already waiting in ncclCommInitRank for it.
if me == 1:
    os.environ["SHVD_FAKE_NCCL_INIT_ERROR"] = "2"  # ncclSystemError
h = _ops.submit(OpType.ALLREDUCE, "first", numpy_code(np.float32), (8,), x.ptr, x.ptr, x,
                lambda r: None, device=g.device())
report(h)
if me == 1:
    os._exit(3)
'''


def test_rank_failing_before_the_nccl_communicator_exists(gpu_env, tmp_path):
    """ncclCommInitRank waits for every member: a member that fails first (and exits) must
    end the wait with PeerLostError naming it, not hang the survivor's engine. The member's
    own failure, an NCCL system error, is InternalError saying what to check on that
    rank, not a lost peer."""
    script = tmp_path / "init_fail.py"
    script.write_text(INIT_FAIL_SCRIPT)
    env = dict(gpu_env, SHVD_TESTS_MULTIPROC=os.path.dirname(os.path.abspath(__file__)))
    job = DirectJob(2, [PYTHON, str(script), str(tmp_path)], env=env)
    try:
        started = time.time()
        codes = job.wait(DEADLINE_S + 30)
        logs = job.outputs()
        assert codes[1] == 3, (codes, logs)
        failed = json.loads((tmp_path / "result1").read_text())
        assert failed["error"] == "InternalError", failed
        assert "unhandled system error" in failed["message"], failed
        assert "/dev/shm" in failed["message"] and "NCCL_DEBUG=WARN" in failed["message"], failed
        path = tmp_path / "result0"
        assert path.exists(), f"rank 0 did not report (exit {codes[0]})\n{logs}"
        res = json.loads(path.read_text())
        print(f"rank 0: {res['at'] - failed['at']:.2f} s after rank 1 failed: {res}")
        assert res["error"] == "PeerLostError" and res["ranks"] == [1], (res, logs)
        assert res["at"] - failed["at"] < DEADLINE_S, res
        assert res["at"] - started < DEADLINE_S + 20
    finally:
        job.close()


# Rank 1's GPU stalls: from the op on, each item on its fake streams takes 4 s, so its part
# of the allreduce comes long after SPARK_HVD_TIMEOUT_S. The script keeps the op's
# buffers: freeing fake device memory waits for every stream (as cudaFree does), which
# would delay the report by the stall.
STALL_SCRIPT = PRELUDE + r"""
x = g.DeviceArray(np.ones(1 << 10, np.float32))
if me == 1:
    rt.shvd_fake_set_delay_us(4 * 1000 * 1000)
with open(os.path.join(out, f"started{me}"), "w") as f:
    json.dump({"at": time.time()}, f)
report(_ops.submit(OpType.ALLREDUCE, "stalled.grad", numpy_code(np.float32), (1 << 10,),
                   x.ptr, x.ptr, x, lambda r: None, device=g.device()))
if me == 0:
    hvd.shutdown()  # after the abort, the healthy rank still shuts down cleanly
    with open(os.path.join(out, "shut_down0"), "w") as f:
        json.dump({"at": time.time()}, f)
os._exit(0)  # rank 1's fake streams would drain for seconds more
"""


def test_a_stalled_gpu_times_out_on_every_rank(gpu_env, tmp_path):
    """A collective that the GPUs do not finish within SPARK_HVD_TIMEOUT_S (here a stalled
    stream on rank 1; on a real GPU a hung kernel, or a peer stuck before its NCCL call):
    each rank aborts its communicator and raises within the timeout plus a little; the
    stalled rank's CollectiveTimeoutError names the op, the other rank's error is that or,
    if the stalled rank aborted first, PeerLostError (both HorovodInternalError)."""
    timeout_s = 2.0
    env = dict(gpu_env, SHVD_TESTS_MULTIPROC=os.path.dirname(os.path.abspath(__file__)),
               SPARK_HVD_TIMEOUT_S=str(timeout_s))
    with script_job(2, STALL_SCRIPT, tmp_path, env, DEADLINE_S + 30) as (codes, logs):
        assert list(codes) == [0, 0], (codes, logs)
    for r in range(2):
        started = json.loads((tmp_path / f"started{r}").read_text())["at"]
        res = json.loads((tmp_path / f"result{r}").read_text())
        took = res["at"] - started
        print(f"rank {r}: {took:.2f} s: {res}")
        if r == 1 or res["error"] == "CollectiveTimeoutError":
            assert res["error"] == "CollectiveTimeoutError", (res, logs)
            assert "allreduce 'stalled.grad'" in res["message"], res
            assert "SPARK_HVD_TIMEOUT_S=2 s" in res["message"], res
            assert timeout_s <= took, took
        else:
            assert res["error"] == "PeerLostError", (res, logs)
        assert took < timeout_s + 5, took
    assert (tmp_path / "shut_down0").exists(), logs


# Rank 0's NCCL communicator fails at the first of two GPU allreduces (ncclSystemError,
# through the fake's SHVD_FAKE_NCCL_FAIL_CALL): its work hangs, as a real kernel would, and
# the other op's call (made at once, in the same cycle) finds the error. "stuck": that call
# also blocks 7 s, as one stuck on a broken connection, while SPARK_HVD_TIMEOUT_S is 1 s
# on rank 0.
NCCL_ERROR_SCRIPT = r"""
import os, sys
if os.environ["SPARK_HVD_RANK"] == "0":
    os.environ["SHVD_FAKE_NCCL_FAIL_CALL"] = "3:2"  # the 3rd NCCL call: ncclSystemError
    if sys.argv[2] == "stuck":
        os.environ.update(SHVD_FAKE_NCCL_STUCK_CALL_MS="7000", SPARK_HVD_TIMEOUT_S="1")
""" + PRELUDE + r"""
for i in range(2):  # the 1st and 2nd NCCL calls
    g.wait_for(g.allreduce_async(np.ones(8, np.float32), f"warm.{i}"), 20, "warm-up")
a = g.DeviceArray(np.ones(64, np.float32))
b = g.DeviceArray(np.ones(64, np.int32))  # another dtype: not fused with a
hvd.barrier()
started = time.time()
with _ops.submit_together():
    hs = {name: _ops.submit(OpType.ALLREDUCE, name, numpy_code(x.dtype), (64,), x.ptr, x.ptr,
                            x, lambda r: None, reduce_op=hvd.Sum, device=g.device())
          for name, x in (("a", a), ("b", b))}
done = {}
while len(done) < 2 and time.time() - started < 40:  # when each op completes
    for name, h in hs.items():
        if name not in done and hvd.poll(h):
            done[name] = time.time() - started
    time.sleep(0.002)
res = {}
for name, h in hs.items():
    try:
        hvd.synchronize(h)
        res[name] = {"error": None}
    except Exception as e:
        res[name] = {"error": type(e).__name__, "message": str(e)}
    res[name]["after_s"] = done.get(name)
with open(os.path.join(out, f"result{me}"), "w") as f:
    json.dump(res, f)
os._exit(0)
"""


@pytest.mark.parametrize("mode", ["async", "stuck"])
def test_an_nccl_failure_of_this_rank_is_internal_and_no_abort_overlaps_a_call(gpu_env, tmp_path,
                                                                               mode):
    """An NCCL system error on rank 0 is InternalError there, naming NCCL's text and what
    to check (shared memory, interfaces, NCCL_DEBUG=WARN), not a lost peer; rank 1, whose
    collective rank 0 abandons, gets PeerLostError. "stuck": the engine thread is inside an
    NCCL call that blocks 7 s when SPARK_HVD_TIMEOUT_S (1 s) aborts the communicator: the
    timed-out op still fails within seconds, and ncclCommAbort waits for the call to return
    (the fake reports any call that overlaps another on one communicator)."""
    env = dict(gpu_env, SHVD_TESTS_MULTIPROC=os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "nccl_error.py"
    script.write_text(NCCL_ERROR_SCRIPT)
    job = DirectJob(2, [PYTHON, str(script), str(tmp_path), mode], env=env)
    try:
        codes = job.wait(DEADLINE_S + 40)
        logs = job.outputs(tail=1 << 20)
    finally:
        job.close()
    assert list(codes) == [0, 0], (codes, logs[-4000:])
    assert "must not overlap" not in logs, logs
    res = [json.loads((tmp_path / f"result{r}").read_text()) for r in range(2)]
    print(res)
    internal = [op for op in res[0].values() if op["error"] == "InternalError"]
    assert internal, (res, logs)
    for op in internal:
        assert "unhandled system error" in op["message"], op
        assert "/dev/shm" in op["message"] and "NCCL_DEBUG=WARN" in op["message"], op
    if mode == "async":
        assert [op["error"] for op in res[0].values()] == ["InternalError"] * 2, res
        assert "PeerLostError" in [op["error"] for op in res[1].values()], res
    else:
        timed_out = [op for op in res[0].values() if op["error"] == "CollectiveTimeoutError"]
        assert len(timed_out) == 1 and len(internal) == 1, res
        assert timed_out[0]["after_s"] < 4, res  # not held up by the stuck call
        assert internal[0]["after_s"] >= 6.5, res  # the stuck call's own error, after it


# The end of the scripts where rank 2 freezes: a GPU allreduce that ranks 0 and 1 report
# (result<me>, with after_s and shutdown_s) before shutting down; rank 0 then kills rank 2.
FROZEN_RANK_2_TAIL = r"""
x = g.DeviceArray(np.ones(64, np.float32))
started = time.time()
h = _ops.submit(OpType.ALLREDUCE, "frozen.grad", numpy_code(np.float32), (64,), x.ptr, x.ptr, x,
                lambda r: None, reduce_op=hvd.Sum, device=g.device())
report(h)  # rank 2 never gets here
res = json.loads(open(os.path.join(out, f"result{me}")).read())
res["after_s"] = res["at"] - started
t = time.time()
hvd.shutdown()
res["shutdown_s"] = time.time() - t
with open(os.path.join(out, f"result{me}"), "w") as f:
    json.dump(res, f)
if me == 0:
    os.kill(int(open(os.path.join(out, "pid2")).read()), signal.SIGKILL)
os._exit(0)
"""


# Rank 2 freezes (SIGSTOP, through the fake's SHVD_FAKE_NCCL_STOP_AT_CALL) as it makes its
# 3rd NCCL call, after negotiating the op: alive, connected, silent. Ranks 0 and 1 make
# that call. "in_call": it waits for the missing peer (SHVD_FAKE_NCCL_HANG_CALL: as NCCL
# connecting to a peer that never comes; on a blocking communicator it would never
# return). "on_stream": it is queued, and their GPU streams wait for rank 2's part.
SILENT_PEER_SCRIPT = r"""
import os
os.environ["SPARK_HVD_TIMEOUT_S"] = "3"
if os.environ["SPARK_HVD_RANK"] == "2":
    os.environ["SHVD_FAKE_NCCL_STOP_AT_CALL"] = "3"
elif os.environ["SHVD_TEST_WAIT"] == "in_call":
    os.environ["SHVD_FAKE_NCCL_HANG_CALL"] = "3"
""" + PRELUDE + r"""
for i in range(2):  # the 1st and 2nd NCCL calls
    g.wait_for(g.allreduce_async(np.ones(8, np.float32), f"warm.{i}"), 20, "warm-up")
with open(os.path.join(out, f"pid{me}"), "w") as f:
    f.write(str(os.getpid()))
hvd.barrier()
""" + FROZEN_RANK_2_TAIL


@pytest.mark.parametrize("wait", ["in_call", "on_stream"])
def test_a_silent_peer_ends_in_a_timeout_naming_it_not_a_hang(gpu_env, tmp_path, wait):
    """A peer that negotiated a GPU op and then never makes its NCCL call (frozen) leaves
    the others waiting for it. in_call: the communicator is non-blocking, so the call
    returns ncclInProgress and the engine thread polls it; at SPARK_HVD_TIMEOUT_S (3 s)
    each waiting rank aborts its communicator (from that thread: no overlapping call).
    On a blocking communicator the call never returns and the job hangs. on_stream: the
    call was queued and the GPU stream waits; InFlight's timeout aborts it. Either way
    each waiting rank raises CollectiveTimeoutError naming the op and the silent rank 2
    alone (rank 1 waited too, and said so in the store), then shuts down cleanly."""
    env = dict(gpu_env, SHVD_TESTS_MULTIPROC=os.path.dirname(os.path.abspath(__file__)),
               SHVD_TEST_WAIT=wait)
    with script_job(3, SILENT_PEER_SCRIPT, tmp_path, env, DEADLINE_S + 40) as (codes, logs):
        assert codes[2] == -signal.SIGKILL, (codes, logs[-4000:])
        assert list(codes[:2]) == [0, 0], (codes, logs[-4000:])
    assert "must not overlap" not in logs, logs
    for res in _waiters_name_rank_2(tmp_path, logs, "SPARK_HVD_TIMEOUT_S", 3):
        if wait == "in_call":
            assert "ncclAllReduce on rank" in res["message"], res
            assert "rank(s) 2 never reached it" in res["message"], res
        else:  # InFlight's timeout, or the control plane's (it waits for rank 2 too) if
            # that one fires first: either way the op is named, rank 2 too
            assert "allreduce 'frozen.grad'" in res["message"], res
            assert "rank(s) 2 " in res["message"], res


def _waiters_name_rank_2(tmp_path, logs, setting, timeout_s):
    """Ranks 0 and 1's results (result<r> files), each checked to be a
    CollectiveTimeoutError naming rank 2 alone and ``setting``, raised after its timeout_s
    and followed by a prompt shutdown."""
    results = []
    for r in (0, 1):
        res = json.loads((tmp_path / f"result{r}").read_text())
        print(f"rank {r}: {res}")
        assert res["error"] == "CollectiveTimeoutError", (res, logs[-4000:])
        assert res["ranks"] == [2], res
        assert setting in res["message"], res
        assert timeout_s <= res["after_s"] < timeout_s + DEADLINE_S, res
        assert res["shutdown_s"] < DEADLINE_S, res
        results.append(res)
    return results


# Rank 2 freezes (SIGSTOP, through the fake's SHVD_FAKE_NCCL_STOP_AT_INIT) as it enters
# ncclCommInitRank at its first GPU op, after negotiating it: ranks 0 and 1 wait in their
# init for it until SPARK_HVD_START_TIMEOUT_S.
FROZEN_INIT_SCRIPT = r"""
import os
os.environ["SPARK_HVD_START_TIMEOUT_S"] = "5"
if os.environ["SPARK_HVD_RANK"] == "2":
    os.environ["SHVD_FAKE_NCCL_STOP_AT_INIT"] = "1"
""" + PRELUDE + r"""
with open(os.path.join(out, f"pid{me}"), "w") as f:
    f.write(str(os.getpid()))
""" + FROZEN_RANK_2_TAIL


def test_a_rank_frozen_at_nccl_init_is_named_in_the_timeout(gpu_env, tmp_path):
    """A peer that negotiated its first GPU op and froze entering ncclCommInitRank leaves
    the others' init waiting for it: at SPARK_HVD_START_TIMEOUT_S (5 s) each waiting rank
    gives up and raises CollectiveTimeoutError naming rank 2 alone (rank 1 waited in the
    init too, and said so in the store), in .ranks and in the message, then shuts down."""
    env = dict(gpu_env, SHVD_TESTS_MULTIPROC=os.path.dirname(os.path.abspath(__file__)))
    with script_job(3, FROZEN_INIT_SCRIPT, tmp_path, env, DEADLINE_S + 40) as (codes, logs):
        assert codes[2] == -signal.SIGKILL, (codes, logs[-4000:])
        assert list(codes[:2]) == [0, 0], (codes, logs[-4000:])
    for res in _waiters_name_rank_2(tmp_path, logs, "SPARK_HVD_START_TIMEOUT_S=5 s", 5):
        assert "ncclCommInitRank" in res["message"], res
        assert "rank(s) 2 never reached it" in res["message"], res


# One rank, its GPU memory cache bounded at 1 MiB: allgathers whose core-allocated outputs
# grow from 4 KiB to 1 MiB (about 50 size classes, 26 MiB in all), each dropped at once.
POOL_SCRIPT = r"""
import os
os.environ["SPARK_HVD_GPU_CACHE_BYTES"] = str(1 << 20)
""" + PRELUDE + r"""
rt.shvd_fake_live_bytes.restype = ctypes.c_ulonglong
dev = g.device()
src = g.DeviceArray(np.ones((256, 1024), np.float32))
own = rt.shvd_fake_live_bytes(dev)  # this script's own device memory
total = 0
for rows in range(1, 257, 5):
    h = _ops.submit(OpType.ALLGATHER, f"grow.{rows}", numpy_code(np.float32), (rows, 1024),
                    src.ptr, 0, src, lambda r: r, device=dev)
    r = hvd.synchronize(h)
    total += rows * 4096
    del r, h  # the output's capsule: its block goes back to the pool
deadline = time.time() + 10  # blocks beyond the bound are freed on the pool's own thread
while rt.shvd_fake_live_bytes(dev) - own > 1 << 20 and time.time() < deadline:
    time.sleep(0.01)
held = rt.shvd_fake_live_bytes(dev) - own
hvd.shutdown()
deadline = time.time() + 10  # likewise at shutdown
while rt.shvd_fake_live_bytes(dev) != own and time.time() < deadline:
    time.sleep(0.01)
with open(os.path.join(out, "result0"), "w") as f:
    json.dump({"total": total, "held": held, "after": rt.shvd_fake_live_bytes(dev) - own,
               "pinned_after": rt.shvd_fake_live_bytes(-1)}, f)
os._exit(0)
"""


def test_the_gpu_memory_cache_is_bounded_and_freed_at_shutdown(gpu_env, tmp_path):
    """The device memory the core keeps for reuse (outputs, fusion buffers) stays within
    SPARK_HVD_GPU_CACHE_BYTES however many sizes the ops ask for (a block returned beyond
    it goes back to CUDA), and none is left once hvd.shutdown() returned (the fake runtime
    counts live cudaMalloc bytes)."""
    env = dict(gpu_env, SHVD_TESTS_MULTIPROC=os.path.dirname(os.path.abspath(__file__)))
    with script_job(1, POOL_SCRIPT, tmp_path, env, DEADLINE_S + 30) as (codes, logs):
        assert list(codes) == [0], (codes, logs[-4000:])
    res = json.loads((tmp_path / "result0").read_text())
    print(res)
    assert res["total"] > 20 << 20, res  # the ops asked for far more than the bound
    assert 0 < res["held"] <= 1 << 20, res
    assert res["after"] == 0 and res["pinned_after"] == 0, res
