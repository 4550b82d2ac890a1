"""spark-hvdrun -H over a real ssh: this module starts its own sshd on 127.0.0.2.

127.0.0.2 is a loopback address but not one of this host's names, so the launcher
reaches it over ssh like any other host.  The sshd (``/usr/sbin/sshd -D -e``) has
its own host key, authorized key and config in a temporary directory; the ssh
client is the real one, run through a two-line ``ssh`` on PATH that adds
``-F <our ssh_config>`` (known_hosts with our host key, so nothing of the user's
~/.ssh is read or written).  Needs openssh-server and openssh-client (`make setup`
installs them); when they are installed but sshd does not start, the tests fail.
"""

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import cases_collectives
from harness import CaseRun
from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.runner import _hosts, _ssh, launch as launch_mod
from test_hvdrun import (ENV, SLEEPER_S, TIMEOUT_S, WITH_GRANDCHILD,
                         check_killed_launcher_takes_its_ranks, lines, needs_mpirun, script,
                         wait_gone)

SSHD = "/usr/sbin/sshd"  # sshd must be started by its absolute path
HOST = "127.0.0.2"
pytestmark = pytest.mark.skipif(
    not os.path.exists(SSHD) or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None,
    reason="needs OpenSSH: apt-get install openssh-server openssh-client (make setup does)")


class Sshd:
    def __init__(self, d) -> None:
        self.dir = str(d)
        for name in ("host_key", "client_key", "other_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f",
                            os.path.join(self.dir, name)], check=True, timeout=30)
        self.key = os.path.join(self.dir, "client_key")
        self.other_key = os.path.join(self.dir, "other_key")
        shutil.copy(self.key + ".pub", os.path.join(self.dir, "authorized_keys"))
        with socket.socket() as s:  # sshd takes no port 0: pick one, then hand it over
            s.bind((HOST, 0))
            self.port = s.getsockname()[1]
        with open(os.path.join(self.dir, "host_key.pub")) as f:
            host_key = " ".join(f.read().split()[:2])
        with open(os.path.join(self.dir, "known_hosts"), "w") as f:
            f.write(f"[{HOST}]:{self.port} {host_key}\n")
        self._write("sshd_config", f"""
            Port {self.port}
            ListenAddress {HOST}
            HostKey {self.dir}/host_key
            AuthorizedKeysFile {self.dir}/authorized_keys
            PidFile {self.dir}/sshd.pid
            StrictModes no
            UsePAM no
            PermitRootLogin prohibit-password
            PubkeyAuthentication yes
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            LogLevel INFO
        """)
        self._write("ssh_config", f"""
            Host *
              UserKnownHostsFile {self.dir}/known_hosts
              GlobalKnownHostsFile /dev/null
              StrictHostKeyChecking yes
        """)
        self.bin = os.path.join(self.dir, "bin")
        os.mkdir(self.bin)
        self._write("bin/ssh",
                    f'#!/bin/sh\nexec {shutil.which("ssh")} -F {self.dir}/ssh_config "$@"\n')
        os.chmod(os.path.join(self.bin, "ssh"), 0o755)
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", exist_ok=True)  # its privilege-separation directory
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", f"{self.dir}/sshd_config"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        self._wait_listening(30)

    def _write(self, name: str, text: str) -> None:
        with open(os.path.join(self.dir, name), "w") as f:
            f.write(textwrap.dedent(text).lstrip())

    def _wait_listening(self, timeout_s: float) -> None:
        said, deadline = [], time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stderr], [], [],
                                        max(0.0, deadline - time.monotonic()))
            line = self.proc.stderr.readline().decode(errors="replace") if ready else ""
            if not line:
                break
            said.append(line.rstrip())
            if "Server listening on" in line:
                return
        self.stop()
        pytest.fail(f"sshd did not start on {HOST}:{self.port} (openssh-server is installed, "
                    f"so this is a failure, not a skip):\n" + "\n".join(said))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stderr.close()

    def env(self) -> dict:
        return dict(ENV, PATH=self.bin + os.pathsep + ENV.get("PATH", os.defpath))


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    server = Sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


def hvdrun(sshd, *args, key=None, port=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spark_hvd.runner", "--ssh-port", str(port or sshd.port),
         "-i", key or sshd.key, *args], env=sshd.env(), capture_output=True, timeout=TIMEOUT_S)


def test_placement_fills_hosts_in_order():
    slots = _hosts.place("localhost:2,me@node-b:2,127.0.0.1:1", 5, "here")
    assert [(s.host, s.identity, s.remote) for s in slots] == [
        ("localhost", "here", False), ("localhost", "here", False),
        ("me@node-b", "node-b", True), ("me@node-b", "node-b", True),
        ("127.0.0.1", "here", False)]
    assert [s.host for s in _hosts.place("a:2,b:2", 3, "here")] == ["a", "a", "b"]
    assert _hosts.is_local(socket.gethostname()) and not _hosts.is_local(HOST)
    with pytest.raises(InvalidArgumentError, match="slots of 'a' must be >= 1"):
        _hosts.place("a:0", 1, "here")


def test_network_interface_is_a_nic_or_an_address():
    assert _hosts.interface_address("lo") == "127.0.0.1"
    assert _hosts.interface_address("10.1.2.3") == "10.1.2.3"
    with pytest.raises(InvalidArgumentError, match="interfaces: .*lo"):
        _hosts.interface_address("no-such-nic0")


ALLREDUCE = """
    import json, os
    import numpy as np
    import spark_hvd as hvd
    hvd.init()
    total = hvd.allreduce(np.array([hvd.rank() + 1.0, 2.0]), op=hvd.Sum, name="x")
    print(json.dumps({"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
                      "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
                      "cross_size": hvd.cross_size(), "sum": total.tolist(),
                      "host": os.environ["SPARK_HVD_HOSTNAME"],
                      "ssh": os.environ.get("SSH_CONNECTION", ""), "cwd": os.getcwd(),
                      "user_var": os.environ.get("SPARK_HVD_TEST_VAR")}))
    hvd.shutdown()
"""


def results_by_rank(proc) -> dict:
    """Each rank's JSON line of the job's output, by rank (from its [rank] prefix)."""
    by_rank = {}
    for line in lines(proc.stdout):
        prefix, _, payload = line.partition(" ")
        by_rank[int(prefix.strip("[]"))] = json.loads(payload)
    return by_rank


def test_four_ranks_on_two_hosts(sshd, tmp_path):
    proc = subprocess.run(  # remote ranks too start in the launcher's working directory
        [sys.executable, "-m", "spark_hvd.runner", "-np", "4", "-H", f"localhost:2,{HOST}:2",
         "--ssh-port", str(sshd.port), "-i", sshd.key, *script(ALLREDUCE)],
        env=dict(sshd.env(), SPARK_HVD_TEST_VAR="travels"), cwd=tmp_path, capture_output=True,
        timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr.decode()
    by_rank = results_by_rank(proc)
    assert sorted(by_rank) == [0, 1, 2, 3]
    for r, got in by_rank.items():
        assert got["rank"] == r and got["size"] == 4
        assert got["sum"] == [1.0 + 2 + 3 + 4, 8.0]
        assert (got["local_rank"], got["local_size"]) == (r % 2, 2)
        assert (got["cross_rank"], got["cross_size"]) == (r // 2, 2)
        assert got["cwd"] == str(tmp_path) and got["user_var"] == "travels"
        remote = got["ssh"].split()[2:] == [HOST, str(sshd.port)]
        assert remote == (r >= 2), got
        assert got["host"] == (HOST if r >= 2 else socket.gethostname())


@needs_mpirun
def test_mpi_passes_the_hosts_to_mpirun(sshd):
    # Open MPI's shared-memory transport crashes when two of its daemons share one
    # machine under two names (our "hosts"): TCP only here.
    proc = subprocess.run(
        [sys.executable, "-m", "spark_hvd.runner", "--mpi", "-np", "4",
         "-H", f"localhost:2,{HOST}:2", "--ssh-port", str(sshd.port), "-i", sshd.key,
         *script(ALLREDUCE.replace('os.environ["SPARK_HVD_HOSTNAME"]', '""'))],
        env=dict(sshd.env(), OMPI_MCA_btl="self,tcp"), capture_output=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr.decode()
    by_rank = results_by_rank(proc)
    assert sorted(by_rank) == [0, 1, 2, 3]
    for r, got in by_rank.items():
        assert (got["rank"], got["size"], got["sum"]) == (r, 4, [10.0, 8.0])
        # (local_rank/size come from Open MPI, which sees one machine here)
        assert (got["ssh"].split()[2:] == [HOST, str(sshd.port)]) == (r >= 2), got


PIDS_THEN_FAIL = f"""
    import os, sys, time
    from spark_hvd._job.env import client_from_env
    rank, size = int(os.environ["SPARK_HVD_RANK"]), int(os.environ["SPARK_HVD_SIZE"])
    c = client_from_env()
    with open(os.path.join(sys.argv[1], str(rank)), "w") as f:
        f.write(str(os.getpid()))
    c.set(f"ready/{{rank}}", b"")
    if rank == size - 1:
        for r in range(size):
            c.get(f"ready/{{r}}", 30)
        print("failing", flush=True)
        sys.exit(3)
    time.sleep({SLEEPER_S})
"""


def test_failing_remote_rank_ends_the_job_with_its_code(sshd, tmp_path):
    proc = hvdrun(sshd, "-np", "3", "-H", f"localhost:1,{HOST}:2", *script(PIDS_THEN_FAIL),
                  str(tmp_path))
    assert proc.returncode == 3, proc.stderr.decode()
    assert lines(proc.stdout) == ["[2] failing"]
    err = proc.stderr.decode()
    assert f"rank 2 on {HOST} exited with code 3; terminated the other ranks" in err, err
    pids = [int((tmp_path / str(r)).read_text()) for r in range(2)]
    assert wait_gone(pids, 10) == []  # the remote rank 1 too, through its closed stdin


def test_remote_ranks_die_with_a_killed_launcher(sshd):
    check_killed_launcher_takes_its_ranks(
        ["-np", "2", "-H", f"localhost:1,{HOST}:1", "--ssh-port", str(sshd.port), "-i",
         sshd.key, "bash", "-c", WITH_GRANDCHILD], sshd.env())


def test_unreachable_host_is_named_with_the_fix(sshd):
    with socket.socket() as s:  # a port where nothing listens
        s.bind((HOST, 0))
        dead_port = s.getsockname()[1]
    proc = hvdrun(sshd, "-np", "2", "-H", f"localhost:1,{HOST}:1", "true", port=dead_port)
    assert proc.returncode == 2
    err = proc.stderr.decode()
    assert f"cannot start ranks over ssh on {HOST}" in err and "Connection refused" in err, err
    assert f"ssh -o BatchMode=yes -p {dead_port}" in err and "--ssh-port" in err


def test_refused_login_is_named_with_the_fix(sshd):
    proc = hvdrun(sshd, "-np", "1", "-H", f"{HOST}:1", "true", key=sshd.other_key)
    assert proc.returncode == 2
    err = proc.stderr.decode()
    assert f"cannot start ranks over ssh on {HOST}" in err and "Permission denied" in err, err
    assert "-i/--ssh-identity-file" in err


def test_a_host_without_our_python_is_named_before_any_rank_starts(sshd, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/nonexistent/python3")
    with pytest.raises(_ssh.HostUnreachableError,
                       match=f"(?s){HOST}: there is no /nonexistent/python3 .*same Python"):
        launch_mod.launch(["true"], np=1, hosts=f"{HOST}:1", env=sshd.env(),
                          ssh_port=sshd.port, ssh_identity_file=sshd.key)


def test_no_ssh_client_says_what_to_install(tmp_path):
    with pytest.raises(launch_mod.CommandNotFoundError, match="apt-get install openssh-client"):
        launch_mod.launch(["true"], np=1, hosts=f"{HOST}:1", env={"PATH": str(tmp_path)})


# The op matrix's reductions and gathers at 2 hosts x 2 ranks with Horovod's hierarchical
# switches: allreduce within each host over shm, across hosts over tcp, within again.
HIERARCHICAL = r"^(allreduce|grouped_allreduce|allgather|reducescatter|fusion|process_set|" \
               r"hierarchy)"


def two_host_run(sshd, pattern: str, env: dict):
    """The cases of cases_collectives matching `pattern` at 2 hosts x 2 ranks."""
    run = CaseRun("cases_collectives", 4, pattern=pattern,
                  env={"PATH": sshd.env()["PATH"], **env},
                  launcher_args=["-H", f"localhost:2,{HOST}:2", "--ssh-port", str(sshd.port),
                                 "-i", sshd.key])
    yield run
    shutil.rmtree(run.outdir, ignore_errors=True)


@pytest.fixture(scope="module")
def hierarchical_run(sshd):
    yield from two_host_run(sshd, HIERARCHICAL, {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
                                                 "HOROVOD_HIERARCHICAL_ALLGATHER": "1"})


@pytest.mark.parametrize("case", cases_collectives.CASES.names(HIERARCHICAL))
def test_hierarchical_case(hierarchical_run, case):
    hierarchical_run.check(case)


# Neither switch set: allgather hierarchical by default where each host holds 2 or more of
# a set's ranks, allreduce flat.
@pytest.fixture(scope="module")
def default_run(sshd):
    yield from two_host_run(sshd, r"^hierarchy/allgather_by_default$", {})


def test_allgather_is_hierarchical_by_default(default_run):
    default_run.check("hierarchy/allgather_by_default")
