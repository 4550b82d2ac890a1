"""The fake CUDA runtime and NCCL (tests/fakes/*.cc) keep the contract the NCCL backend's
tests rely on. Each test starts SIZE processes of tests/fakes/fake_driver.cc running one
scenario (it loads the fakes by path, as the backend does, and computes what to expect
from its rank and SIZE) and judges their exit codes and output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import pytest

from fakes.build import DELAY_US_ENV_VAR, DEVICES_ENV_VAR, HOST_ENV_VAR

pytestmark = pytest.mark.nccl

JOB_TIMEOUT_S = 60
SLOW_STREAM = {DELAY_US_ENV_VAR: "20000"}  # "right after enqueue" is reliably early


@dataclass
class Rank:
    rank: int
    returncode: int
    out: str
    err: str

    def values(self, key: str) -> List[str]:
        return [ln.split(" ", 1)[1] for ln in self.out.splitlines() if ln.startswith(key + " ")]


def report(ranks: Sequence[Rank]) -> str:
    return "\n".join(f"--- rank {r.rank} (exit {r.returncode})\n{r.out}{r.err}" for r in ranks)


def run_job(fakes: Dict[str, str], scenario: str, size: int, env: Optional[dict] = None,
            rank_env: Optional[Callable[[int], dict]] = None) -> List[Rank]:
    """Runs `scenario` on `size` processes at once (each fake device its own unless `env`
    says otherwise); a job that outlives JOB_TIMEOUT_S is killed and fails the test."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("SHVD_FAKE_") and k != "CUDA_VISIBLE_DEVICES"}
    base[DEVICES_ENV_VAR] = str(size)
    base.update(env or {})
    with tempfile.TemporaryDirectory(prefix="shvd-fakes-") as shared:
        procs = [subprocess.Popen(
            [fakes["driver"], fakes["cudart"], fakes["nccl"], scenario, str(r), str(size), shared],
            env=dict(base, **(rank_env(r) if rank_env else {})), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True) for r in range(size)]
        deadline = time.monotonic() + JOB_TIMEOUT_S
        ranks, hung = [], False
        for r, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung = True
                for q in procs:
                    q.kill()
                out, err = p.communicate()
            ranks.append(Rank(r, p.returncode, out, err))
    assert not hung, f"{scenario} on {size} ranks hung (> {JOB_TIMEOUT_S} s)\n{report(ranks)}"
    return ranks


def assert_passed(ranks: Sequence[Rank], which: Optional[Sequence[int]] = None) -> None:
    for r in ranks:
        if which is None or r.rank in which:
            assert r.returncode == 0 and "PASS" in r.out.splitlines(), report(ranks)


# -- CUDA runtime ---------------------------------------------------------------------

def test_cuda_runtime_devices_memory_streams_events_and_error_names(fakes):
    assert_passed(run_job(fakes, "cuda_basics", 1, env={DEVICES_ENV_VAR: "3"}))


def test_an_empty_cuda_visible_devices_hides_every_device(fakes):
    assert_passed(run_job(fakes, "no_device", 1, env={"CUDA_VISIBLE_DEVICES": ""}))


def test_copies_and_collectives_refuse_memory_of_the_wrong_kind_or_device(fakes):
    assert_passed(run_job(fakes, "invalid_arguments", 1, env={DEVICES_ENV_VAR: "2"}))


@pytest.mark.parametrize("size", [1, 2])
def test_results_show_only_after_the_stream_ran_them(fakes, size):
    assert_passed(run_job(fakes, "stream_order", size, env=SLOW_STREAM))


def _cuda_script(fakes, body: str, env: dict, wait_for: Optional[str] = None):
    """Runs `body` in a Python process with the fake runtime loaded as `rt` (ctypes);
    returns the process, after it printed `wait_for` when given."""
    code = ("import ctypes, sys, time\n"
            f"rt = ctypes.CDLL({fakes['cudart']!r})\n" + body)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SHVD_FAKE_")}
    p = subprocess.Popen([sys.executable, "-c", code], env=dict(base, **env), text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if wait_for is not None:
        line = p.stdout.readline()
        assert line.strip() == wait_for, (line, p.stderr.read() if p.poll() is not None else "")
    return p


def test_exclusive_process_mode_gives_each_gpu_to_one_process(fakes, tmp_path):
    """SHVD_FAKE_CUDA_EXCLUSIVE_DIR: a context on a GPU another live process holds fails
    with cudaErrorDevicesUnavailable (46), whichever call makes it (cudaSetDevice, or any
    call on a thread left on device 0); a gone holder's claim is taken over."""
    env = {DEVICES_ENV_VAR: "2", "SHVD_FAKE_CUDA_EXCLUSIVE_DIR": str(tmp_path)}
    holder = _cuda_script(fakes, "assert rt.cudaSetDevice(0) == 0\nprint('held', flush=True)\n"
                          "sys.stdin.readline()\n", env, wait_for="held")
    try:
        other = _cuda_script(fakes, """
p = ctypes.c_void_p()
print(rt.cudaGetDeviceCount(ctypes.byref(ctypes.c_int())))  # no context: 0
print(rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(64)))  # this thread is on device 0: 46
print(rt.cudaSetDevice(0))                 # 46
print(rt.cudaSetDevice(1), rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(64)),
      rt.cudaFree(p))  # 0 0 0
""", env)
        out, err = other.communicate(timeout=30)
        assert out.split("\n")[:4] == ["0", "46", "46", "0 0 0"], (out, err)
        assert "which process" in err and "exclusive-process mode" in err, err
    finally:
        holder.communicate("\n", timeout=30)
    assert holder.returncode == 0
    after = _cuda_script(fakes, "print(rt.cudaSetDevice(0))\n", env)
    out, err = after.communicate(timeout=30)
    assert out.strip() == "0", (out, err)


def test_the_legacy_null_stream_runs_its_work_later(fakes):
    """SHVD_FAKE_CUDA_LEGACY_STREAM=1: work on the null stream is queued (here behind a
    0.6 s kernel), seen only after cudaStreamSynchronize(0) or a wait on an event recorded
    there; without it the null stream runs work at once."""
    body = """
p, ev, side = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
host = ctypes.create_string_buffer(1)
assert rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(8)) == 0
assert rt.cudaEventCreateWithFlags(ctypes.byref(ev), 2) == 0
assert rt.cudaStreamCreateWithFlags(ctypes.byref(side), 1) == 0
def first_byte():  # read through a copy on another stream (the host cannot touch p)
    assert rt.cudaMemcpyAsync(host, p, ctypes.c_size_t(1), 2, side) == 0
    assert rt.cudaStreamSynchronize(side) == 0
    return host.raw[0]
assert rt.shvd_fake_launch_kernel(None, ctypes.c_uint(600000)) == 0  # 0.6 s of compute first
assert rt.cudaMemsetAsync(p, 0, ctypes.c_size_t(8), None) == 0
assert rt.cudaEventRecord(ev, None) == 0
print(first_byte(), rt.cudaEventQuery(ev))
assert rt.cudaStreamSynchronize(None) == 0
print(first_byte(), rt.cudaEventQuery(ev))
"""
    outs = []
    for legacy in ("1", "0"):
        proc = _cuda_script(fakes, body, {DELAY_US_ENV_VAR: "20000",
                                          "SHVD_FAKE_CUDA_LEGACY_STREAM": legacy})
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        outs.append(out.split())
    assert outs[0] == ["255", "600", "0", "0"], outs  # 0xFF fill, not ready; then done
    assert outs[1] == ["0", "0", "0", "0"], outs


@pytest.mark.parametrize("scenario", ["host_reads_device_memory",
                                      "device_pointer_as_host_scalar"])
def test_host_code_touching_device_memory_faults(fakes, scenario):
    """Device memory has no host access: a host read of it, or a device pointer passed
    as a host-immediate scalar, dies of SIGSEGV in CI as it would on a GPU."""
    ranks = run_job(fakes, scenario, 1)
    assert ranks[0].returncode == -signal.SIGSEGV, report(ranks)
    assert "UNREACHABLE" not in ranks[0].out, report(ranks)


def test_device_wide_syncs_are_counted_and_kernels_take_their_time(fakes):
    """Every device-synchronizing call is counted (with its thread's name), except a
    cudaStreamSynchronize of a stream a spark_hvd thread (shvd_*) made; a fake kernel
    holds its stream for the time asked."""
    proc = _cuda_script(fakes, """
import threading
libc = ctypes.CDLL(None)
report = ctypes.create_string_buffer(4096)
p, h, s, ev = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
rt.shvd_fake_sync_reset()
assert rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(64)) == 0
assert rt.cudaFree(p) == 0
assert rt.cudaMallocHost(ctypes.byref(h), ctypes.c_size_t(64)) == 0
assert rt.cudaFreeHost(h) == 0
assert rt.cudaDeviceSynchronize() == 0
assert rt.cudaStreamSynchronize(None) == 0
assert rt.cudaStreamCreateWithFlags(ctypes.byref(s), 1) == 0
assert rt.cudaStreamSynchronize(s) == 0
def core_thread():  # named as spark_hvd's threads are: its own stream is not counted
    libc.prctl(15, b"shvd_test", 0, 0, 0)  # PR_SET_NAME
    mine = ctypes.c_void_p()
    assert rt.cudaStreamCreateWithFlags(ctypes.byref(mine), 1) == 0
    assert rt.cudaStreamSynchronize(mine) == 0
    assert rt.cudaStreamDestroy(mine) == 0
t = threading.Thread(target=core_thread)
t.start()
t.join()
rt.shvd_fake_sync_report(report, 4096)
print(rt.shvd_fake_sync_calls(), report.value.decode())
assert rt.cudaEventCreateWithFlags(ctypes.byref(ev), 2) == 0
start = time.monotonic()
assert rt.shvd_fake_launch_kernel(s, ctypes.c_uint(300000)) == 0
assert rt.cudaEventRecord(ev, s) == 0
print(rt.cudaEventQuery(ev))
assert rt.cudaEventSynchronize(ev) == 0
print(round(time.monotonic() - start, 2) >= 0.3)
rt.shvd_fake_sync_reset()
print(rt.shvd_fake_sync_calls())
""", {DELAY_US_ENV_VAR: "0"})
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    count, _, text = lines[0].partition(" ")
    assert count == "7", out
    for call in ("cudaMalloc", "cudaFree", "cudaMallocHost", "cudaFreeHost",
                 "cudaDeviceSynchronize", "cudaStreamSynchronize(null stream)",
                 "cudaStreamSynchronize(a stream spark_hvd does not own)"):
        assert f"{call} on thread " in text, text
    assert "shvd_test" not in text, text
    assert lines[1:] == ["600", "True", "0"], out


# -- collectives ----------------------------------------------------------------------

@pytest.mark.parametrize("size", [1, 2, 3])
def test_collectives_in_every_dtype_and_op(fakes, size):
    assert_passed(run_job(fakes, "collectives", size))


@pytest.mark.parametrize("size", [1, 2, 3])
def test_grouped_ragged_broadcasts_alltoall_and_an_ordered_ring(fakes, size):
    assert_passed(run_job(fakes, "grouped", size))


def test_ungrouped_send_before_recv_on_both_ranks_deadlocks_until_abort(fakes):
    assert_passed(run_job(fakes, "ungrouped_deadlock", 2))


def test_destroy_waits_for_the_comms_queued_work(fakes):
    assert_passed(run_job(fakes, "destroy_waits", 2, env=SLOW_STREAM))


@pytest.mark.parametrize("size", [2, 3])
def test_the_coordinators_process_may_leave_once_all_calls_are_done(fakes, size):
    assert_passed(run_job(fakes, "home_leaves_first", size))


# -- the contract between ranks -------------------------------------------------------

@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("kind", ["count", "dtype", "root", "p2p", "departed"])
def test_a_mismatch_fails_the_call_on_every_rank(fakes, kind, size):
    ranks = run_job(fakes, f"mismatch_{kind}", size)
    assert_passed(ranks)
    reporting = [r for r in ranks if r.values("LAST_ERROR")]
    # every rank but one that left (departed) reports the same error
    assert len(reporting) == size - (kind == "departed"), report(ranks)
    assert len({r.values("LAST_ERROR")[0] for r in reporting}) == 1, report(ranks)


@pytest.mark.parametrize("size", [2, 3])
def test_two_ranks_on_one_device_of_one_host_fail_init(fakes, size):
    ranks = run_job(fakes, "duplicate_device", size, env={DEVICES_ENV_VAR: "1"})
    assert_passed(ranks)


@pytest.mark.parametrize("how", ["cuda_visible_devices", "hosts"])
def test_ranks_on_distinct_devices_or_hosts_init(fakes, how):
    if how == "cuda_visible_devices":  # each rank sees its own physical device as device 0
        env, rank_env = {DEVICES_ENV_VAR: "2"}, lambda r: {"CUDA_VISIBLE_DEVICES": str(r)}
    else:
        env, rank_env = {DEVICES_ENV_VAR: "1"}, lambda r: {HOST_ENV_VAR: f"h{r}"}
    assert_passed(run_job(fakes, "smoke", 2, env=env, rank_env=rank_env))


def test_init_refuses_disagreeing_nranks_and_bad_arguments(fakes):
    assert_passed(run_job(fakes, "init_errors", 2))


def test_group_end_without_start_and_a_failed_call_in_a_group(fakes):
    assert_passed(run_job(fakes, "group_errors", 1))


@pytest.mark.parametrize("size", [1, 2])
def test_every_call_on_an_aborted_or_destroyed_comm_or_op_fails(fakes, size):
    assert_passed(run_job(fakes, "use_after_abort", size))


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("victim", ["last", "home"])
def test_a_killed_peer_is_a_remote_error_and_abort_unblocks_its_calls(fakes, victim, size):
    ranks = run_job(fakes, f"kill_{victim}", size)
    dead = size - 1 if victim == "last" else 0
    assert ranks[dead].returncode == -signal.SIGKILL, report(ranks)
    survivors = [r.rank for r in ranks if r.rank != dead]
    assert_passed(ranks, survivors)
    for r in survivors:
        assert int(ranks[r].values("DETECTED_MS")[0]) < 5000, report(ranks)
