"""spark-hvdrun end to end: ranks as real processes, launched as a user would."""

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.runner import launch as launch_mod
from spark_hvd.runner._procs import Sink

from _ranks import running, wait_gone  # noqa: F401 - test_hosts imports them from here

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 60  # far below the 60 s the sleeping ranks would need, plus startup
SLEEPER_S = 120
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None,
                                  reason="mpirun not on PATH (apt-get install openmpi-bin)")


def script(code: str) -> list:
    return [sys.executable, "-c", textwrap.dedent(code)]


def hvdrun(*args, timeout=TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spark_hvd.runner", *args], env=ENV,
                          capture_output=True, timeout=timeout)


def lines(data: bytes) -> list:
    return data.decode().splitlines()


OUTPUT = """
    import os, sys
    r = int(os.environ["SPARK_HVD_RANK"])
    for i in range(3):
        print(f"out {r} {i}")
    for i in range(2):
        print(f"err {r} {i}", file=sys.stderr)
    sys.stdout.write(f"no newline {r}")
"""


@pytest.mark.parametrize("mode", ["--gloo", pytest.param("--mpi", marks=needs_mpirun)])
@pytest.mark.parametrize("np", [1, 2, 3])
def test_output_is_prefixed_by_rank_per_stream(mode, np):
    proc = hvdrun(mode, "-np", str(np), *script(OUTPUT))
    assert proc.returncode == 0, proc.stderr.decode()
    out, err = lines(proc.stdout), lines(proc.stderr)
    for r in range(np):
        assert [x for x in out if x.startswith(f"[{r}] ")] == \
            [f"[{r}] out {r} {i}" for i in range(3)] + [f"[{r}] no newline {r}"]
        assert [x for x in err if x.startswith(f"[{r}] ")] == \
            [f"[{r}] err {r} {i}" for i in range(2)]
    assert len(out) == 4 * np and len(err) == 2 * np  # nothing else printed on success


RANK_ENV = """
    import json, os
    from spark_hvd._job.env import client_from_env
    names = ["RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
             "RENDEZVOUS_ADDR", "RENDEZVOUS_PORT", "SECRET", "RUN_ID", "CONTROLLER"]
    seen = {n: os.environ.get("SPARK_HVD_" + n) for n in names}
    c = client_from_env()
    rank, size = int(seen["RANK"]), int(seen["SIZE"])
    c.set(f"hello/{rank}", str(rank * 10).encode())
    peers = [int(c.get(f"hello/{r}", 20)) for r in range(size)]
    c.close()
    print(json.dumps({"env": seen, "peers": peers}))
"""


@pytest.mark.parametrize("mode", ["--gloo", pytest.param("--mpi", marks=needs_mpirun)])
@pytest.mark.parametrize("np", [1, 3])
def test_each_rank_sees_its_env_and_reaches_the_rendezvous(mode, np):
    proc = hvdrun(mode, "-np", str(np), *script(RANK_ENV))
    assert proc.returncode == 0, proc.stderr.decode()
    by_rank = {}
    for line in lines(proc.stdout):
        prefix, _, payload = line.partition(" ")
        by_rank[int(prefix.strip("[]"))] = json.loads(payload)
    assert sorted(by_rank) == list(range(np))
    run_ids = set()
    for r, got in by_rank.items():
        e = got["env"]
        assert (e["RANK"], e["SIZE"], e["LOCAL_RANK"], e["LOCAL_SIZE"]) == \
            (str(r), str(np), str(r), str(np))
        assert (e["CROSS_RANK"], e["CROSS_SIZE"]) == ("0", "1")
        assert e["CONTROLLER"] == mode.lstrip("-")
        assert e["RENDEZVOUS_ADDR"] == "127.0.0.1" and int(e["RENDEZVOUS_PORT"]) > 0
        assert len(bytes.fromhex(e["SECRET"])) == 32
        run_ids.add(e["RUN_ID"])
        assert got["peers"] == [10 * p for p in range(np)]
    assert len(run_ids) == 1


ONE_FAILS = f"""
    import os, sys, time
    from spark_hvd._job.env import client_from_env
    rank = int(os.environ["SPARK_HVD_RANK"])
    c = client_from_env()
    if rank == 0:
        c.get("sleeper-ready", 30)
        sys.exit(3)
    with open(sys.argv[1], "w") as f:
        f.write(str(os.getpid()))
    c.set("sleeper-ready", b"")
    time.sleep({SLEEPER_S})
"""


def test_failing_rank_ends_the_job_with_its_code(tmp_path):
    pid_file = tmp_path / "sleeper.pid"
    proc = hvdrun("-np", "2", *script(ONE_FAILS), str(pid_file))
    assert proc.returncode == 3
    err = proc.stderr.decode()
    assert "rank 0 exited with code 3" in err and err.count("spark-hvdrun:") == 1
    assert not running(int(pid_file.read_text()))


def test_rank_killed_by_a_signal():
    proc = hvdrun("-np", "2", *script(f"""
        import os, signal, time
        if os.environ["SPARK_HVD_RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep({SLEEPER_S})
    """))
    assert proc.returncode == 128 + signal.SIGKILL
    assert "rank 1 was killed by signal 9 (SIGKILL)" in proc.stderr.decode()


READY_THEN_SLEEP = f"""
    import os, time
    print("ready", os.getpid(), flush=True)
    time.sleep({SLEEPER_S})
"""


@pytest.mark.parametrize("mode", ["--gloo", pytest.param("--mpi", marks=needs_mpirun)])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_ends_every_rank(sig, mode):
    launcher = subprocess.Popen(
        [sys.executable, "-m", "spark_hvd.runner", mode, "-np", "2", *script(READY_THEN_SLEEP)],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        pids = [int(launcher.stdout.readline().split()[-1]) for _ in range(2)]
        assert all(running(p) for p in pids)
        launcher.send_signal(sig)
        launcher.wait(TIMEOUT_S)
        assert launcher.returncode == 128 + sig
        assert f"interrupted by {sig.name}" in launcher.stderr.read().decode()
        assert not any(running(p) for p in pids)
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()
        launcher.stderr.close()


# Each rank starts a grandchild and prints its own pid and the grandchild's.
WITH_GRANDCHILD = f"sleep {SLEEPER_S} & echo ready $$ $!; wait"


def check_killed_launcher_takes_its_ranks(argv, env):
    """Starts ``spark-hvdrun argv`` (2 ranks running WITH_GRANDCHILD), SIGKILLs it once
    both ranks are up, and checks that every rank and grandchild is gone soon after."""
    launcher = subprocess.Popen([sys.executable, "-m", "spark_hvd.runner", *argv], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pids = []
    try:
        for _ in range(2):
            line = launcher.stdout.readline().decode()
            assert " ready " in line, line + launcher.stderr.read().decode()
            pids += [int(p) for p in line.split()[-2:]]
        assert all(running(p) for p in pids)
        launcher.kill()  # SIGKILL: no teardown of its own
        launcher.wait(TIMEOUT_S)
        assert wait_gone(pids, 10) == []
    finally:
        launcher.kill()
        launcher.wait()
        for p in pids:
            if running(p):
                os.kill(p, signal.SIGKILL)
        launcher.stdout.close()
        launcher.stderr.close()


@pytest.mark.parametrize("mode, ignore_sigterm", [
    ("--gloo", False), ("--gloo", True), pytest.param("--mpi", False, marks=needs_mpirun)])
def test_ranks_and_their_children_die_with_a_killed_launcher(mode, ignore_sigterm):
    trap = "trap '' TERM; " if ignore_sigterm else ""  # then SIGKILL, after the grace (3 s)
    check_killed_launcher_takes_its_ranks([mode, "-np", "2", "bash", "-c",
                                           trap + WITH_GRANDCHILD], ENV)


def test_launch_api_kills_a_rank_that_ignores_sigterm(tmp_path):
    pid_file = tmp_path / "stubborn.pid"
    out, err = io.BytesIO(), io.BytesIO()
    code = launch_mod.launch(script(f"""
        import os, signal, sys, time
        from spark_hvd._job.env import client_from_env
        c = client_from_env()
        if os.environ["SPARK_HVD_RANK"] == "0":
            c.get("stubborn-ready", 30)
            print("giving up")
            sys.exit(1)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with open(sys.argv[1], "w") as f:
            f.write(str(os.getpid()))
        c.set("stubborn-ready", b"")
        time.sleep({SLEEPER_S})
    """) + [str(pid_file)], np=2, env={"PYTHONPATH": ENV["PYTHONPATH"]}, stdout=out,
        stderr=err, kill_grace_s=0.5)
    assert code == 1
    assert out.getvalue() == b"[0] giving up\n"
    assert b"rank 0 exited with code 1" in err.getvalue()
    # SIGKILLed with its supervisor's group once the grace ran out: gone within moments
    # (the launcher waits for the supervisors; the kernel finishes the rank just after).
    assert wait_gone([int(pid_file.read_text())], 10) == []


def test_command_not_found():
    proc = hvdrun("-np", "2", "/nonexistent/program")
    assert proc.returncode == 127
    assert "cannot run '/nonexistent/program'" in proc.stderr.decode()


def test_hosts():
    assert launch_mod.parse_hosts("localhost:2,127.0.0.1") == [("localhost", 2), ("127.0.0.1", 1)]
    proc = hvdrun("-np", "2", "-H", "localhost:1,127.0.0.1:1", *script("print('hi')"))
    assert proc.returncode == 0 and sorted(lines(proc.stdout)) == ["[0] hi", "[1] hi"]
    # Ranks fill the hosts in order: the second host is not used, nor ssh.
    proc = hvdrun("-np", "2", "-H", "localhost:2,node-7.example.com:2", *script("print('hi')"))
    assert proc.returncode == 0 and sorted(lines(proc.stdout)) == ["[0] hi", "[1] hi"]
    with pytest.raises(InvalidArgumentError, match="more than the 2 slots"):
        launch_mod.launch(["true"], np=3, hosts="localhost:2")


def test_bad_arguments():
    assert hvdrun("-np", "2").returncode == 2  # no command
    assert hvdrun("--gloo", "--mpi", "-np", "2", "true").returncode == 2
    with pytest.raises(InvalidArgumentError):
        launch_mod.launch(["true"], np=0)


def test_mpi_tags_are_joined_per_rank_and_stream():
    out, err = io.BytesIO(), io.BytesIO()
    tags = launch_mod._MpiTags(Sink(out), Sink(err), Sink(err))
    for line in [b"[1,0]<stdout>:hel[1,1]<stdout>:whole\n",
                 b"[1,0]<stdout>:lo\n",
                 b"mpirun says something\n",
                 b"[1,1]<stdout>:a\n",
                 b"[1,1]<stdout>:partial",
                 b"[1,0]<stdout>:no newline"]:
        for sink, data in tags.route(line):
            sink.write(data)
    for sink, data in tags.finish():
        sink.write(data)
    assert out.getvalue().splitlines() == [b"[1] whole", b"[0] hello", b"[1] a",
                                           b"[0] no newline", b"[1] partial"]
    assert err.getvalue() == b"mpirun says something\n"


@needs_mpirun
def test_mpi_propagates_the_exit_code_and_ends_the_others(tmp_path):
    pid_file = tmp_path / "sleeper.pid"
    proc = hvdrun("--mpi", "-np", "2", *script(f"""
        import os, sys, time
        from spark_hvd._job.env import client_from_env
        rank = int(os.environ["SPARK_HVD_RANK"])
        c = client_from_env()
        print(f"rank {{rank}} of {{os.environ['SPARK_HVD_SIZE']}}", flush=True)
        if rank == 1:
            c.get("sleeper-ready", 30)
            sys.exit(3)
        with open(sys.argv[1], "w") as f:
            f.write(str(os.getpid()))
        c.set("sleeper-ready", b"")
        time.sleep({SLEEPER_S})
    """), str(pid_file))
    assert proc.returncode == 3
    assert sorted(lines(proc.stdout)) == ["[0] rank 0 of 2", "[1] rank 1 of 2"]
    assert "spark-hvdrun: mpirun exited with code 3" in proc.stderr.decode()
    assert not running(int(pid_file.read_text()))


def test_mpi_without_mpirun_says_what_to_install(tmp_path):
    with pytest.raises(launch_mod.CommandNotFoundError, match="apt-get install openmpi-bin"):
        launch_mod.launch(["true"], np=1, mpi=True, env={"PATH": str(tmp_path)})


def test_horovodrun_tuning_flags_become_the_ranks_settings():
    proc = hvdrun("-np", "2", "--fusion-threshold-mb", "8", "--cycle-time-ms", "2.5",
                  "--cache-capacity", "16", "--timeline-filename", "/tmp/tl.json",
                  "--stall-check-warning-time-seconds", "30", "--log-level", "debug",
                  "--autotune", "--autotune-log-file", "/tmp/at.csv",
                  "--autotune-warmup-samples", "2", *script("""
                      import os
                      print(*(os.environ.get("SPARK_HVD_" + k) for k in (
                          "FUSION_THRESHOLD", "CYCLE_TIME_MS", "CACHE_CAPACITY", "TIMELINE",
                          "STALL_CHECK_TIME_S", "LOG_LEVEL", "AUTOTUNE", "AUTOTUNE_LOG",
                          "AUTOTUNE_WARMUP_SAMPLES")))
                  """))
    assert proc.returncode == 0, proc.stderr.decode()
    assert sorted(lines(proc.stdout)) == [
        f"[{r}] 8388608 2.5 16 /tmp/tl.json 30 debug 1 /tmp/at.csv 2" for r in (0, 1)]
