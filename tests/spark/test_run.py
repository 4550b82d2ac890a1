"""spark_hvd.spark.run: the launch checks, the rank reports, and real runs.

Three kinds of test, by cost:

- no Spark: the launch checks on conf mappings, the GPU mapping, the failure report;
- ``local[2]`` through the shared ``spark_local`` fixture (in this process);
- ``local-cluster[2,1,1024]`` with real executor JVMs and a fake GPU per executor,
  marked ``local_cluster``: they run in a pytest process of their own, because one
  process can hold only one SparkContext (see tests/spark/conftest.py).

The functions the ranks run are module-level functions of this module, pickled by
value (the executors cannot import this test module).
"""

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import types

import cloudpickle
import numpy as np
import psutil
import pytest

import spark_hvd.spark
from spark_hvd._job import env as renv
from spark_hvd.exceptions import CollectiveTimeoutError, InvalidArgumentError, RankFailedError
from spark_hvd.runner.rendezvous import RendezvousServer
from spark_hvd.spark import _checks, _driver, _failures, _protocol, _task, runner

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CHILD_SCRIPT = os.path.abspath(spark_hvd.spark._child.__file__)
LC_MASTER = "local-cluster[2,1,1024]"
GPU_CONF = {_checks.MASTER: LC_MASTER, _checks.TASK_GPU_AMOUNT: "1",
            _checks.EXECUTOR_GPU_AMOUNT: "1"}

# Passed to the ranks of the runs that check for leftover processes: other test
# sessions on this machine may be running spark_hvd.spark.run at the same time.
OWNER = {"SPARK_HVD_TEST_OWNER": str(os.getpid())}


def _children():
    """Live rank child processes of this test session's spark_hvd.spark.run calls."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if CHILD_SCRIPT in (proc.info.get("cmdline") or []) and \
                    proc.environ().get("SPARK_HVD_TEST_OWNER") == OWNER["SPARK_HVD_TEST_OWNER"]:
                found.append(proc)
        except psutil.Error:  # gone meanwhile, or not ours to read
            pass
    return found


def _no_active_jobs(spark):
    return not spark.sparkContext.statusTracker().getActiveJobsIds()


# -- functions the ranks run -------------------------------------------------------

def _describe_rank(tag):
    import importlib.util

    return {"rank": int(os.environ[renv.RANK_ENV_VAR]),
            # the child's own directory (spark_hvd/spark) must not shadow user modules
            "shadowed": [m for m in ("runner", "_task") if importlib.util.find_spec(m)],
            "size": int(os.environ[renv.SIZE_ENV_VAR]),
            "local_rank": int(os.environ[renv.LOCAL_RANK_ENV_VAR]),
            "local_size": int(os.environ[renv.LOCAL_SIZE_ENV_VAR]),
            "cross_size": int(os.environ[renv.CROSS_SIZE_ENV_VAR]),
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "user": os.environ.get("SPARK_HVD_TEST_USER_VAR"),
            "tag": tag}


def _allreduce_ranks():
    import spark_hvd as hvd

    hvd.init()
    total = hvd.allreduce(np.full(5, hvd.rank() + 1.0), op=hvd.Sum, name="ranks")
    return hvd.rank(), hvd.size(), total.tolist()


def _print_and_return(n_lines):
    rank = os.environ[renv.RANK_ENV_VAR]
    for i in range(n_lines):
        print(f"line {i} of rank {rank}")
    print(f"warning from rank {rank}", file=sys.stderr)
    return rank


def _print_and_show_env(n_lines):
    rank = _print_and_return(n_lines)
    return rank, os.environ.get("SHVD_TEST_WRAPPED"), os.environ.get("SHVD_TEST_ENV")


def _wait_until_seen(flag_path, timeout_s):
    """Rank 0 prints, then waits for the driver to have shown that line."""
    import time

    if os.environ[renv.RANK_ENV_VAR] != "0":
        return True
    print("first line", flush=True)
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(flag_path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    print("second line")
    return True


def _big_value(n_bytes):
    rank = int(os.environ[renv.RANK_ENV_VAR])
    return np.arange(n_bytes // 8, dtype=np.float64) + rank


def _fail_on_rank_1():
    import spark_hvd as hvd

    hvd.init()
    if hvd.rank() == 1:
        print("rank 1 is about to fail", flush=True)
        raise ValueError("boom on rank 1")
    while True:
        hvd.allreduce(np.ones(4), op=hvd.Sum)


def _rank_1_exits_hard():
    import spark_hvd as hvd

    hvd.init()
    if hvd.rank() == 1:
        os._exit(3)
    while True:
        hvd.allreduce(np.ones(4), op=hvd.Sum)


def _rank_1_never_inits():
    import spark_hvd as hvd

    if os.environ[renv.RANK_ENV_VAR] == "1":
        return "never called init"
    hvd.init()
    return "init returned"


def _report_pids_and_sleep(directory):
    import time

    rank = os.environ[renv.RANK_ENV_VAR]
    tmp = os.path.join(directory, f"{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()} {os.getppid()}")
    os.replace(tmp, os.path.join(directory, f"{rank}.pids"))
    time.sleep(600)


# -- no Spark ------------------------------------------------------------------------

@pytest.mark.parametrize("master, conf, expected", [
    ("local[2]", {}, 2),
    ("local", {}, 1),
    ("local[4, 3]", {_checks.TASK_CPUS: "2"}, 2),
    ("local[*]", {}, os.cpu_count()),
    (LC_MASTER, {}, 2),
    ("local-cluster[3,4,1024]", {_checks.TASK_CPUS: "2"}, 6),
    ("local-cluster[3,4,1024]", {_checks.TASK_GPU_AMOUNT: "1",
                                 _checks.EXECUTOR_GPU_AMOUNT: "1"}, 3),
    ("yarn", {_checks.EXECUTOR_INSTANCES: "4", _checks.EXECUTOR_CORES: "8",
              _checks.TASK_CPUS: "4"}, 8),
])
def test_task_slots(master, conf, expected):
    assert _checks.task_slots({_checks.MASTER: master, **conf}) == expected


def test_task_slots_fall_back_to_registered_executors():
    conf = {_checks.MASTER: "spark://h:7077"}
    assert _checks.task_slots(conf) is None
    assert _checks.task_slots(conf, registered=lambda: 6) == 6


def test_plan_defaults_to_every_slot_and_rejects_more():
    assert _checks.plan({_checks.MASTER: "local[3]"}, None).num_proc == 3
    with pytest.raises(InvalidArgumentError, match=r"num_proc=4 is more than the 3 tasks.*"
                                                   r"spark.master=local\[3\]"):
        _checks.plan({_checks.MASTER: "local[3]"}, 4)
    with pytest.raises(InvalidArgumentError, match="pass num_proc"):
        _checks.plan({_checks.MASTER: "spark://h:7077"}, None)


@pytest.mark.parametrize("num_proc", [0, -1, 1.5, True, "2"])
def test_plan_rejects_bad_num_proc(num_proc):
    with pytest.raises(InvalidArgumentError, match="num_proc must be an int >= 1"):
        _checks.plan({_checks.MASTER: "local[2]"}, num_proc)


def test_plan_rejects_dynamic_allocation():
    conf = {_checks.MASTER: "yarn", _checks.DYNAMIC_ALLOCATION: "true"}
    with pytest.raises(InvalidArgumentError, match="spark.dynamicAllocation.enabled=false"):
        _checks.plan(conf, 2)


def test_plan_gpu_settings():
    assert _checks.plan(GPU_CONF, 2).use_gpu                       # auto: the conf is set
    assert not _checks.plan(GPU_CONF, 2, use_gpu=False).use_gpu
    assert not _checks.plan({_checks.MASTER: LC_MASTER}, 2).use_gpu
    with pytest.raises(InvalidArgumentError, match="needs spark.task.resource.gpu.amount"):
        _checks.plan({_checks.MASTER: LC_MASTER}, 2, use_gpu=True)
    for use_gpu in (True, None):
        with pytest.raises(InvalidArgumentError,
                           match=r"spark.task.resource.gpu.amount=0.5 is fractional"):
            _checks.plan({**GPU_CONF, _checks.TASK_GPU_AMOUNT: "0.5",
                          _checks.EXECUTOR_GPU_AMOUNT: "2"}, 2, use_gpu=use_gpu)
    with pytest.raises(InvalidArgumentError, match=r"local\[2\] never assigns GPUs"):
        _checks.plan({_checks.MASTER: "local[2]", _checks.TASK_GPU_AMOUNT: "1"}, 2,
                     use_gpu=True)


def test_visible_devices_map_through_the_executors_list():
    assert _task.visible_devices(["0", "1"], None) == "0,1"
    assert _task.visible_devices(["1"], "") == "1"
    assert _task.visible_devices(["1"], "3,5") == "5"
    assert _task.visible_devices(["1", "0"], " 3, 5 ") == "5,3"
    with pytest.raises(InvalidArgumentError, match="CUDA_VISIBLE_DEVICES=3 has 1 entries"):
        _task.visible_devices(["2"], "3")


def test_the_childs_pythonpath_leaves_out_what_pth_files_add(tmp_path, monkeypatch):
    """A directory a .pth file of the worker's site-packages adds (another environment's
    site-packages) is added again by the child's own start-up, after its site-packages; on
    PYTHONPATH it would come first and shadow the child's own modules (an editable install's
    finder of the same name). Spark's py-files and the worker's PYTHONPATH stay."""
    import site
    dirs = {n: tmp_path / n for n in ("site", "foreign", "pyfiles", "given")}
    for d in dirs.values():
        d.mkdir()
    (dirs["site"] / "zz_other.pth").write_text(f"# a comment\nimport os\n{dirs['foreign']}\n")
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(dirs["site"])])
    monkeypatch.setattr(sys, "path", sys.path + [str(dirs["foreign"]), str(dirs["pyfiles"])])
    root = os.path.dirname(os.path.dirname(os.path.dirname(_task.__file__)))
    found = _task._child_pythonpath({"PYTHONPATH": str(dirs["given"])}).split(os.pathsep)
    assert found[:2] == [root, str(dirs["given"])] and found[-1] == str(dirs["pyfiles"])
    assert str(dirs["foreign"]) not in found, found
    assert str(dirs["foreign"]) in _task._child_pythonpath(  # asked for: kept
        {"PYTHONPATH": str(dirs["foreign"])}).split(os.pathsep)


def _leaves_work_for_the_exit(where):
    """Run in a rank's child: a thread still running, a thread pool left open, an atexit
    handler, C output in stdio's buffer, and an object only the interpreter's teardown
    would finalize."""
    import atexit
    import ctypes
    import time

    class Teardown:
        def __del__(self):  # late in the teardown: no builtins left, os still there
            os.close(os.open(os.path.join(where, "finalized"), os.O_CREAT | os.O_WRONLY))

    sys.modules["__main__"].left_behind = Teardown()
    # Each line in one write: print() writes the text and its newline separately, and the
    # child's flush after the function returns may fall between the two.
    atexit.register(sys.stdout.write, "atexit handler ran\n")

    def late():
        time.sleep(0.2)
        sys.stdout.write("thread finished\n")
    threading.Thread(target=late).start()
    from concurrent.futures import ThreadPoolExecutor
    # Left open: its thread waits for more.
    ThreadPoolExecutor(1).submit(sys.stdout.write, "pool ran\n")
    ctypes.CDLL(None).printf(b"printed by C\n")
    return 7


def test_the_child_ends_as_python_would_without_tearing_the_interpreter_down(tmp_path):
    """The rank's child (_child.py, run as the task runs it) joins its threads (a thread
    pool left open is told to finish, as at the interpreter's exit), runs the atexit
    handlers and flushes Python's and C's output, then leaves without the interpreter's
    teardown (seconds once torch is imported): a module global's finalizer, which only that
    teardown would call, does not run."""
    import pickle
    payload, result = tmp_path / "payload.pkl", tmp_path / "result.pkl"
    payload.write_bytes(cloudpickle.dumps((_leaves_work_for_the_exit, (str(tmp_path),), {})))
    proc = subprocess.run([sys.executable, CHILD_SCRIPT, str(payload), str(result),
                           str(os.getpid())], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    record = pickle.loads(result.read_bytes())
    assert record["ok"] and pickle.loads(record["value"]) == 7
    for line in ("thread finished", "pool ran", "atexit handler ran", "printed by C"):
        assert line in proc.stdout.splitlines(), proc.stdout
    assert not (tmp_path / "finalized").exists()


@pytest.mark.parametrize("conf, connect, bound, announced", [
    ({_checks.DRIVER_HOST: "localhost"}, False, "127.0.0.1", "127.0.0.1"),
    ({_checks.DRIVER_HOST: "localhost", _checks.DRIVER_BIND_ADDRESS: "0.0.0.0"}, False,
     "0.0.0.0", "localhost"),
    ({_checks.DRIVER_HOST: "no-such-host.invalid"}, False, "0.0.0.0", "no-such-host.invalid"),
    # Connect: a driver elsewhere; announce this machine's address on the way to it
    ({_checks.DRIVER_HOST: "192.0.2.1"}, True, "0.0.0.0", None),
])
def test_rendezvous_server_address(conf, connect, bound, announced):
    server, addr = runner._start_server(conf, connect)
    try:
        assert server.host == bound
        assert addr == (announced or runner._route_address("192.0.2.1"))
    finally:
        server.stop()


def test_log_lines_round_trip():
    body = _protocol.lines_message([_protocol.line(_protocol.STDOUT, b"a b\n"),
                                    _protocol.line(_protocol.STDERR, "\u00e9\n".encode())])
    assert body[:1] == _protocol.KIND_LINES
    assert list(_protocol.parse_lines(body[1:])) == [(b"O", "a b"), (b"E", "\u00e9")]
    long = _protocol.line(_protocol.STDOUT, b"x" * (_protocol.MAX_LINE_BYTES * 2) + b"\n")
    assert len(long) <= _protocol.MAX_LINE_BYTES + 1 and long.endswith(b"truncated]\n")


def _job_error(failure, reports, size, tails=None, attempts=None):
    return _failures.job_error(failure, reports, size, tails or {},
                               attempts or (lambda rank: 1), start_timeout_s=30.0)


def test_failure_report_puts_the_root_cause_first():
    tails = {0: ["allreduce...", "PeerLostError: rank 2 is gone"],
             2: ["step 7", "Traceback (most recent call last):", "KeyError: 'w'"]}
    lost = {"ok": False, "type": "PeerLostError", "message": "rank 2 is gone",
            "traceback": "", "peer_lost": True}
    # rank 0's PeerLostError arrives before the KeyError of rank 2 that caused it
    reports = {0: {"rank": 0, "record": lost, "returncode": 1},
               3: {"rank": 3, "record": lost, "returncode": 1},
               2: {"rank": 2, "returncode": 1,
                   "record": {"ok": False, "type": "KeyError", "message": "'w'",
                              "traceback": "KeyError: 'w'\n", "peer_lost": False}},
               1: {"rank": 1, "returncode": -15, "aborted": True}}
    error = _job_error(("rank", 0), reports, 4, tails)
    assert isinstance(error, RankFailedError)
    assert list(error.failures) == [2, 0, 1, 3]
    text = str(error)
    assert text.splitlines()[0] == "spark_hvd.spark.run: rank 2 failed: KeyError: 'w'"
    assert "[ranks 0,3]: PeerLostError: rank 2 is gone" in text
    assert "[rank 1]: stopped by the driver" in text
    assert "step 7" in error.failures[2] and "KeyError: 'w'" in error.failures[2]
    assert (error.ranks, error.cause, error.reason) == ([2], "function", "KeyError: 'w'")


def test_failure_report_roots_at_the_first_rank_to_fail():
    # Rank 1 raised; its exit then broke rank 0 with another exception, which arrived first.
    reports = {0: {"rank": 0, "returncode": 1,
                   "record": {"ok": False, "type": "NotInitializedError", "message": "x",
                              "traceback": "", "peer_lost": False, "time": 20.0}},
               1: {"rank": 1, "returncode": 1,
                   "record": {"ok": False, "type": "ValueError", "message": "boom",
                              "traceback": "", "peer_lost": False, "time": 10.0}}}
    error = _job_error(("rank", 0), reports, 2)
    assert list(error.failures) == [1, 0]
    assert str(error).splitlines()[:2] == ["spark_hvd.spark.run: rank 1 failed: ValueError: boom",
                                           "[rank 0]: NotInitializedError: x"]


@pytest.mark.parametrize("report,cause", [
    ({"returncode": -9}, "process"),
    ({"returncode": 1, "record": {"ok": False, "type": "CollectiveTimeoutError", "message": "x",
                                  "traceback": "", "peer_lost": False, "collective": True}},
     "collective"),
    ({"returncode": 1, "record": {"ok": False, "type": "TensorMismatchError", "message": "x",
                                  "traceback": "", "peer_lost": False, "collective": False}},
     "function"),
    ({"task_error": "Traceback...\nInvalidArgumentError: no GPU\n"}, "task"),
])
def test_failure_report_says_what_kind_of_failure_the_root_is(report, cause):
    # A lost peer on rank 0 is an effect; rank 1's failure is the root, whatever its kind.
    lost = {"ok": False, "type": "PeerLostError", "message": "lost rank 1", "traceback": "",
            "peer_lost": True, "collective": True}
    error = _job_error(("rank", 0), {0: {"rank": 0, "record": lost, "returncode": 1},
                                     1: dict(report, rank=1)}, 2)
    assert (error.ranks, error.cause) == ([1], cause)
    assert str(error).splitlines()[0] == f"spark_hvd.spark.run: rank 1 failed: {error.reason}"


def test_failure_report_of_a_start_timeout_and_of_a_spark_failure():
    error = _job_error(("start_timeout", [1, 2]), {}, 3)
    assert "[ranks 1,2] did not start within 30 s" in str(error)
    assert "raise start_timeout (or SPARK_HVD_START_TIMEOUT_S)" in str(error)
    cause = RuntimeError("Job aborted: executor lost\nat ...")
    error = _job_error(("spark", cause), {}, 2)
    assert str(error).startswith("spark_hvd.spark.run: the Spark job failed before every rank "
                                 "reported: RuntimeError: Job aborted: executor lost")
    assert error.__cause__ is cause
    assert (error.ranks, error.cause) == ([], "spark")
    error = _job_error(("lost", [1]), {0: {"rank": 0, "returncode": -15, "aborted": True}}, 2)
    assert (error.ranks, error.cause, error.reason) == ([1], "spark", "ended without a report")


def test_failure_report_of_a_killed_rank_and_a_missing_one():
    reports = {1: {"rank": 1, "returncode": -9}}
    error = _job_error(("rank", 1), reports, 3, attempts=lambda rank: 2 if rank == 2 else 1)
    assert "rank 1 failed: its process was killed by signal 9 (SIGKILL)" in str(error)
    assert "[rank 2]: the Spark task was lost and Spark retried it" in str(error)
    assert "[rank 0]: no report" in str(error)


def test_run_without_a_session_says_how_to_get_one(tmp_path):
    code = textwrap.dedent("""
        import spark_hvd.spark
        from spark_hvd.exceptions import InvalidArgumentError
        try:
            spark_hvd.spark.run(print, num_proc=1)
        except InvalidArgumentError as e:
            print("ERROR:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=str(tmp_path))
    assert "ERROR: spark_hvd.spark.run needs an active SparkSession" in out.stdout, out.stderr


def test_run_checks_its_arguments_first():
    with pytest.raises(InvalidArgumentError, match="fn must be callable"):
        spark_hvd.spark.run(42)
    with pytest.raises(InvalidArgumentError, match="env must map"):
        spark_hvd.spark.run(print, env={"A": 1})
    with pytest.raises(InvalidArgumentError, match="start_timeout"):
        spark_hvd.spark.run(print, start_timeout=0)


@pytest.mark.parametrize("kwargs, match", [
    ({"use_mpi": True}, "use_mpi=True: .* no mpirun"),
    ({"use_gloo": False}, "use_gloo=False"),
    ({"extra_mpi_args": "-x FOO"}, "extra_mpi_args='-x FOO': .* no mpirun"),
    ({"nics": ["eth0"]}, r"nics=\['eth0'\] cannot be honoured"),
    ({"stdout": 42}, "stdout must be a stream"),
    ({"verbose": -1}, "verbose must be"),
    ({"executable": ""}, "executable must be a path"),
])
def test_run_refuses_horovod_arguments_it_cannot_honour(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        spark_hvd.spark.run(print, **kwargs)


def test_run_start_timeout_reads_horovod_s_name_too(monkeypatch):
    monkeypatch.delenv("SPARK_HVD_START_TIMEOUT_S", raising=False)
    monkeypatch.delenv("HOROVOD_START_TIMEOUT", raising=False)
    assert runner._start_timeout(None) == runner.DEFAULT_SPARK_START_TIMEOUT_S
    monkeypatch.setenv("HOROVOD_START_TIMEOUT", "50")
    assert runner._start_timeout(None) == 50.0
    monkeypatch.setenv("SPARK_HVD_START_TIMEOUT_S", "40")
    assert runner._start_timeout(None) == 40.0


# -- local[2], in this process -------------------------------------------------------

@pytest.mark.spark
def test_local_mode_runs_every_slot_by_default(spark_local):
    results = spark_hvd.spark.run(_allreduce_ranks, verbose=0)
    assert results == [(0, 2, [3.0] * 5), (1, 2, [3.0] * 5)]


@pytest.mark.spark
def test_local_mode_checks_before_launching(spark_local):
    with pytest.raises(InvalidArgumentError, match="more than the 2 tasks"):
        spark_hvd.spark.run(_allreduce_ranks, num_proc=3)
    with pytest.raises(InvalidArgumentError, match="never assigns GPUs"):
        spark_hvd.spark.run(_allreduce_ranks, num_proc=2, use_gpu=True)


@pytest.mark.spark
def test_check_launch_is_run_s_checks_without_a_launch(spark_local):
    assert spark_hvd.spark.check_launch() == 2
    assert spark_hvd.spark.check_launch(num_proc=1, spark=spark_local) == 1
    with pytest.raises(InvalidArgumentError, match="more than the 2 tasks"):
        spark_hvd.spark.check_launch(num_proc=3)
    with pytest.raises(InvalidArgumentError, match="never assigns GPUs"):
        spark_hvd.spark.check_launch(num_proc=2, use_gpu=True)


@pytest.mark.spark
def test_local_mode_a_rank_that_never_calls_init_is_lost_for_the_others(spark_local):
    """Rank 1 returns without init(): its report tells the driver, which tells the
    rendezvous service, so rank 0's init fails naming rank 1 instead of waiting out the
    start timeout (120 s here)."""
    import time

    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        spark_hvd.spark.run(_rank_1_never_inits, num_proc=2, verbose=0, start_timeout=120)
    text = str(info.value)
    assert time.monotonic() - t0 < 60, text
    assert "PeerLostError" in text and "rank 1" in text, text


# -- local-cluster, in a pytest process of its own -----------------------------------

@pytest.mark.parametrize("use_gpu, expected_gpus", [(None, "3"), (False, "3,5")])
@pytest.mark.usefixtures("spark_cluster")
@pytest.mark.local_cluster
@pytest.mark.spark
@pytest.mark.timeout(900)
def test_ranks_get_results_in_order_env_and_their_gpu(use_gpu, expected_gpus):
    # The executors have CUDA_VISIBLE_DEVICES=3,5 and Spark gives each task GPU "0":
    # pinned, a rank sees exactly device 3; with use_gpu=False the list is left alone.
    results = spark_hvd.spark.run(_describe_rank, args=("t",), use_gpu=use_gpu, verbose=0,
                                  env={"SPARK_HVD_TEST_USER_VAR": "yes"})
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["size"] == 2 and r["tag"] == "t" and r["user"] == "yes"
        assert r["shadowed"] == []
        assert r["gpus"] == expected_gpus
        assert r["local_size"] == 2 and r["cross_size"] == 1  # both executors on this host
    assert sorted(r["local_rank"] for r in results) == [0, 1]
    assert renv.RANK_ENV_VAR not in os.environ and "SPARK_HVD_TEST_USER_VAR" not in os.environ


@pytest.mark.usefixtures("spark_cluster")
@pytest.mark.local_cluster
@pytest.mark.spark
@pytest.mark.timeout(900)
def test_env_of_one_run_does_not_reach_the_next():
    spark_hvd.spark.run(_describe_rank, args=("a",), env={"SPARK_HVD_TEST_USER_VAR": "a"},
                        verbose=0)
    results = spark_hvd.spark.run(_describe_rank, args=("b",), verbose=0)
    assert [r["user"] for r in results] == [None, None]


@pytest.mark.usefixtures("spark_cluster")
@pytest.mark.local_cluster
@pytest.mark.spark
@pytest.mark.timeout(900)
def test_ranks_allreduce_with_each_other():
    assert spark_hvd.spark.run(_allreduce_ranks, num_proc=2, verbose=0) == \
        [(0, 2, [3.0] * 5), (1, 2, [3.0] * 5)]


@pytest.mark.usefixtures("spark_cluster")
@pytest.mark.local_cluster
@pytest.mark.spark
@pytest.mark.timeout(900)
def test_output_lines_are_prefixed_with_the_rank(capsys):
    assert spark_hvd.spark.run(_print_and_return, args=(3,), num_proc=2) == ["0", "1"]
    out, err = capsys.readouterr()
    for rank in (0, 1):
        lines = [ln for ln in out.splitlines() if ln.startswith(f"[{rank}] ")]
        assert lines == [f"[{rank}] line {i} of rank {rank}" for i in range(3)]
        assert f"[{rank}] warning from rank {rank}" in err.splitlines()
    quiet = spark_hvd.spark.run(_print_and_return, args=(3,), num_proc=2, verbose=0)
    assert quiet == ["0", "1"] and "line 0" not in capsys.readouterr().out


class _Watch:
    """sys.stdout stand-in that creates ``flag`` once ``marker`` was printed."""

    def __init__(self, inner, marker, flag):
        self.inner, self.marker, self.flag = inner, marker, flag

    def write(self, text):
        if self.marker in text:
            open(self.flag, "w").close()
        return self.inner.write(text)

    def flush(self):
        self.inner.flush()


@pytest.mark.usefixtures("spark_cluster")
@pytest.mark.local_cluster
@pytest.mark.spark
@pytest.mark.timeout(900)
def test_output_reaches_the_driver_while_the_rank_runs(tmp_path, monkeypatch):
    flag = str(tmp_path / "seen")
    monkeypatch.setattr(sys, "stdout", _Watch(sys.stdout, "[0] first line", flag))
    assert spark_hvd.spark.run(_wait_until_seen, args=(flag, 120.0), num_proc=2) == [True, True]


@pytest.mark.usefixtures("spark_cluster")
@pytest.mark.local_cluster
@pytest.mark.spark
@pytest.mark.timeout(900)
def test_large_return_values_come_back():
    n_bytes = 9 * 1024 * 1024
    results = spark_hvd.spark.run(_big_value, args=(n_bytes,), num_proc=2, verbose=0)
    for rank, value in enumerate(results):
        assert value.nbytes == n_bytes
        np.testing.assert_array_equal(value, np.arange(n_bytes // 8, dtype=np.float64) + rank)


@pytest.mark.local_cluster
@pytest.mark.spark
@pytest.mark.timeout(900)
def test_a_failing_rank_stops_the_job_and_names_its_traceback(spark_cluster):
    with pytest.raises(RankFailedError) as info:
        spark_hvd.spark.run(_fail_on_rank_1, num_proc=2, verbose=0, env=OWNER)
    error = info.value
    assert list(error.failures)[0] == 1 and 0 in error.failures
    assert str(error).startswith("spark_hvd.spark.run: rank 1 failed: ValueError: boom on rank 1")
    assert (error.ranks, error.cause) == ([1], "function")
    assert "[rank 0]: " in str(error)
    assert "rank 1 is about to fail" in error.failures[1]
    assert "Traceback (most recent call last)" in error.failures[1]
    assert "in _fail_on_rank_1" in error.failures[1]
    assert _children() == []
    assert _no_active_jobs(spark_cluster)


@pytest.mark.local_cluster
@pytest.mark.spark
@pytest.mark.timeout(900)
def test_a_rank_that_dies_without_an_exception_is_the_root_cause(spark_cluster):
    with pytest.raises(RankFailedError) as info:
        spark_hvd.spark.run(_rank_1_exits_hard, num_proc=2, verbose=0, env=OWNER)
    assert str(info.value).startswith(
        "spark_hvd.spark.run: rank 1 failed: its process exited with code 3")
    assert list(info.value.failures) == [1, 0]
    assert (info.value.ranks, info.value.cause) == ([1], "process")
    assert _children() == []


@pytest.mark.local_cluster
@pytest.mark.spark
@pytest.mark.timeout(900)
def test_children_die_with_their_task(spark_cluster, tmp_path):
    # Kill rank 0's Python worker as Spark does when it cancels a task: its child
    # must go with it, and run() must fail instead of waiting for it.
    outcome = {}

    def launch():
        try:
            spark_hvd.spark.run(_report_pids_and_sleep, args=(str(tmp_path),), num_proc=2,
                                verbose=0, env=OWNER)
        except BaseException as e:  # noqa: B036 - checked below
            outcome["error"] = e

    thread = threading.Thread(target=launch, daemon=True)
    thread.start()
    pids = {}
    for rank in (0, 1):
        path = tmp_path / f"{rank}.pids"
        for _ in range(1200):  # the ranks write these files once they run
            if path.exists() or not thread.is_alive():
                break
            thread.join(0.1)
        assert path.exists(), outcome
        pids[rank] = [int(p) for p in path.read_text().split()]
    children = [psutil.Process(pids[r][0]) for r in (0, 1)]
    os.kill(pids[0][1], signal.SIGKILL)
    gone, alive = psutil.wait_procs(children, timeout=60)
    assert alive == []
    thread.join(120)
    assert isinstance(outcome.get("error"), RankFailedError)
    assert _children() == []
    assert _no_active_jobs(spark_cluster)
    # The session is still usable afterwards.
    assert spark_hvd.spark.run(_print_and_return, args=(0,), num_proc=2, verbose=0) == ["0", "1"]


@pytest.mark.local_cluster
@pytest.mark.spark
@pytest.mark.timeout(900)
def test_ranks_that_cannot_start_time_out_and_their_stage_is_cancelled(spark_cluster,
                                                                        tmp_path):
    # A plain job holds one of the two slots: the barrier stage of 2 tasks waits.
    sc = spark_cluster.sparkContext
    flag = tmp_path / "holding"

    def hold():
        sc.setJobGroup("holder", "holds a slot", interruptOnCancel=True)
        try:
            # (a lambda: pyspark's own cloudpickle would pickle a module function by name)
            sc.parallelize([str(flag)], 1).map(
                lambda path: (open(path, "w").close(), __import__("time").sleep(120))).collect()
        except Exception:  # cancelled below
            pass

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    for _ in range(1200):
        if flag.exists():
            break
        holder.join(0.1)
    try:
        with pytest.raises(CollectiveTimeoutError, match=r"\[ranks 0,1\] did not start within 5 s"):
            spark_hvd.spark.run(_describe_rank, args=("x",), num_proc=2, start_timeout=5,
                                env=OWNER)
        assert [j for j in sc.statusTracker().getActiveJobsIds()
                if j not in sc.statusTracker().getJobIdsForGroup("holder")] == []
    finally:
        sc.cancelJobGroup("holder")
        holder.join(60)
    assert _children() == []


@pytest.mark.local_cluster
@pytest.mark.spark
@pytest.mark.timeout(900)
def test_settings_that_cannot_work_fail_before_anything_starts(spark_cluster, monkeypatch):
    def no_server(self):
        raise AssertionError("the rendezvous server was started")

    monkeypatch.setattr(RendezvousServer, "start", no_server)
    with pytest.raises(InvalidArgumentError,
                       match=r"num_proc=3 is more than the 2 tasks .*local-cluster\[2,1,1024\]"):
        spark_hvd.spark.run(_describe_rank, args=("x",), num_proc=3)

    real_read_conf = _checks.read_conf
    for key, value, message in [
            (_checks.DYNAMIC_ALLOCATION, "true", "set spark.dynamicAllocation.enabled=false"),
            (_checks.TASK_GPU_AMOUNT, "0.5", "spark.task.resource.gpu.amount=0.5 is fractional")]:
        monkeypatch.setattr(_checks, "read_conf",
                            lambda spark, k=key, v=value: {**real_read_conf(spark), k: v})
        with pytest.raises(InvalidArgumentError, match=message):
            spark_hvd.spark.run(_describe_rank, args=("x",), num_proc=2)
    assert _no_active_jobs(spark_cluster)


@pytest.mark.spark
def test_run_takes_horovod_s_arguments_in_horovod_s_order(spark_local, tmp_path, capsys):
    """horovod.spark.run(fn, args, kwargs, num_proc, start_timeout, use_mpi, use_gloo,
    extra_mpi_args, env, stdout, stderr, verbose, nics, prefix_output_with_timestamp,
    executable): the streams get the ranks' lines (even at verbose=0), timestamped; the
    ranks run ``executable`` with ``env``."""
    import io
    import re

    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(f'#!/bin/sh\nSHVD_TEST_WRAPPED=1 exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    out, err = io.StringIO(), io.StringIO()
    results = spark_hvd.spark.run(_print_and_show_env, (2,), None, 2, 120.0, False, True, None,
                                  {"SHVD_TEST_ENV": "from-env"}, out, err, 0, None, True,
                                  str(wrapper))
    assert results == [("0", "1", "from-env"), ("1", "1", "from-env")]
    stamp = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4} "
    for rank in (0, 1):
        lines = [ln for ln in out.getvalue().splitlines() if f"[{rank}] " in ln]
        assert [re.sub(f"^{stamp}", "", ln) for ln in lines] \
            == [f"[{rank}] line {i} of rank {rank}" for i in range(2)]
        assert all(re.match(stamp, ln) for ln in lines)
        assert any(ln.endswith(f"[{rank}] warning from rank {rank}")
                   for ln in err.getvalue().splitlines())
    printed = capsys.readouterr()
    assert "line 0" not in printed.out and "warning from" not in printed.err


def _collecting(size, events):
    """A _Job with only what _collect reads: its events, its size, a spec's kill grace."""
    job = runner._Job.__new__(runner._Job)
    job.size, job.events, job._spark_ended = size, queue.Queue(), False
    job.spec = types.SimpleNamespace(kill_grace_s=3.0)
    for event in events:
        job.events.put(event)
    return job


def _lost(rank, named):
    record = {"ok": False, "type": "PeerLostError", "message": f"lost ranks {named}",
              "peer_lost": True, "lost_ranks": named, "collective": True}
    return ("report", rank, {"rank": rank, "record": record, "returncode": 1})


def test_reports_of_ranks_the_others_named_lost_are_waited_for_briefly(monkeypatch):
    """After a failure the driver waits kill grace + REPORT_WAIT_S for every rank's report;
    once the ranks still silent are all ones the others' PeerLostErrors named (a host cut
    off: their reports never come), only LOST_REPORT_S more. A report already on its way
    is still read."""
    monkeypatch.setattr(_driver, "REPORT_WAIT_S", 600.0)
    monkeypatch.setattr(_driver, "LOST_REPORT_S", 0.3)
    killed = ("report", 3, {"rank": 3, "returncode": -9})
    job = _collecting(4, [_lost(0, [2, 3]), _lost(1, [2, 3]), killed])
    reports = {}
    done = threading.Thread(target=job._collect, args=(reports,), daemon=True)
    done.start()
    done.join(60)
    assert not done.is_alive(), "waited the full REPORT_WAIT_S for ranks named lost"
    assert sorted(reports) == [0, 1, 3]  # rank 3's report, already there, is read
    # A silent rank nobody named: the full wait (cut short here by its report)
    job = _collecting(3, [_lost(0, [2])])
    reports = {}
    done = threading.Thread(target=job._collect, args=(reports,), daemon=True)
    done.start()
    done.join(1.0)
    assert done.is_alive(), "stopped waiting for rank 1, which nobody named lost"
    job.events.put(("report", 1, {"rank": 1, "returncode": 1}))
    job.events.put(("report", 2, {"rank": 2, "returncode": -9}))
    done.join(60)
    assert not done.is_alive() and sorted(reports) == [0, 1, 2]
