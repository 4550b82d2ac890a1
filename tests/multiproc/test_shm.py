"""The shm backend's faults and the privacy of its segments: a rank killed or frozen in
the middle of allreduces, what is left of the segments afterwards, and who can reach
them during set-up. Each test is one launch of fault_worker.py at 3 ranks on this host,
where CPU ops run on shm by default.
"""

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time


from _ranks import PYTHON, DirectJob, wait_gone
from test_mp_faults import WORKER, load, names_rank, survivors

SHM_DETECT_S = 1.0  # the contract: survivors raise within a second of the kill


def shm_files() -> set:
    return {n for n in os.listdir("/dev/shm") if "spark_hvd" in n or "shvd" in n}


def wait_file(path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_killed_rank_mid_allreduce_survivors_raise_within_1s_and_no_segment_is_left(tmp_path):
    """Rank 2 is SIGKILLed while a child it forked (as a data loader would) still holds
    its connections to the peers: the survivors see its process end (pidfd) all the same."""
    before = shm_files()
    job = DirectJob(3, [PYTHON, WORKER, "kill_forked_mid_transfer", str(tmp_path)])
    try:
        codes, logs, reports = survivors(job, tmp_path, "killed_at", 40)
        assert codes[2] == -signal.SIGKILL, (codes, logs)
        for r, res, detect in reports:
            assert res["error"] == "PeerLostError" and res["ranks"] == [2], (res, logs)
            assert "shm allreduce" in res["message"] and names_rank(res, 2), res
            assert detect < SHM_DETECT_S, f"rank {r} needed {detect:.2f} s to notice"
            # While running: its own and both peers' segments mapped, no descriptor open.
            assert len(res["held"]["maps"]) == 3 and res["held"]["fds"] == [], res["held"]
            assert res["after"] == {"fds": [], "maps": []}, "segments left after shutdown()"
            assert codes[r] == 0, f"rank {r} did not exit cleanly: {codes}\n{logs}"
        assert not wait_gone(job.pids, 5), "rank processes left running"
    finally:
        holder = load(tmp_path, "holder_pid")
        if holder is not None:
            try:
                os.kill(holder["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        job.close()
    assert shm_files() == before, f"left in /dev/shm: {shm_files() - before}"


def test_frozen_rank_mid_allreduce_fails_the_others_after_the_timeout(tmp_path):
    """SIGSTOP keeps the frozen rank's connections open: the others' waits give up after
    SPARK_HVD_TIMEOUT_S (2 s here), naming it, instead of spinning or sleeping forever."""
    job = DirectJob(3, [PYTHON, WORKER, "freeze_mid_transfer", str(tmp_path)],
                    env={"SPARK_HVD_TIMEOUT_S": "2"})
    try:
        _, logs, reports = survivors(job, tmp_path, "frozen_at", 40)
        for r, res, detect in reports:
            assert res["error"] in ("CollectiveTimeoutError", "PeerLostError"), (res, logs)
            assert names_rank(res, 2) or "rank(s) 2" in res["message"], res
            assert 1.5 < detect < 10, f"rank {r} gave up after {detect:.1f} s"
            assert res["after"] == {"fds": [], "maps": []}, "segments left after shutdown()"
    finally:
        job.close()  # kills the stopped rank


# -- who can reach a segment -------------------------------------------------------------

def listening_shm_sockets(pids) -> list:
    """The abstract Unix sockets named spark_hvd-shm-* that processes `pids` listen on."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    names = []
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            # Num RefCount Protocol Flags Type St Inode Path; flag 0x10000: listening
            parts = line.split()
            if len(parts) >= 8 and int(parts[6]) in inodes and int(parts[3], 16) & 0x10000 \
                    and parts[7].startswith("@spark_hvd-shm-"):
                names.append(parts[7][1:])
    return names


KNOCK = r'''
import array, json, os, socket, sys
def knock(name, payload):
    """What the listener answers before it closes: bytes, and descriptors (SCM_RIGHTS)."""
    got, fds = b"", []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect("\0" + name)
        s.sendall(payload)
        while True:
            data, anc, _, _ = s.recvmsg(4096, socket.CMSG_SPACE(4 * 4))
            for level, kind, cdata in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += list(array.array("i", cdata[:len(cdata) - len(cdata) % 4]))
            if not data:
                return {"bytes": len(got), "fds": len(fds)}
            got += data
names, pids, hellos = json.loads(sys.argv[1])
out = {"knocks": [knock(n, bytes.fromhex(h)) for n in names for h in hellos], "proc": {}}
for pid in pids:
    for what in ("fd", "map_files"):
        try:
            out["proc"][f"{pid}/{what}"] = len(os.listdir(f"/proc/{pid}/{what}"))
        except OSError as e:
            out["proc"][f"{pid}/{what}"] = type(e).__name__
print(json.dumps(out))
'''


def world_python():
    """A Python interpreter any user may run (every directory on its path searchable by
    others), or None."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        path = os.path.realpath(candidate)
        parts = path.split(os.sep)
        dirs = [os.sep.join(parts[:i]) or os.sep for i in range(1, len(parts))]
        if os.path.exists(path) and all(os.stat(d).st_mode & 0o001 for d in dirs) and \
                os.stat(path).st_mode & 0o001:
            return path
    return None


def knock(names, pids, as_nobody: bool) -> dict:
    """Runs KNOCK in a process of its own (as user nobody when asked): a process that has
    not the job's secret, so not the tokens in the store."""
    hellos = [struct.pack("<II", 0x73687664, 2).hex() + b"0".hex() * 32,  # tcp's magic
              b"GET / HTTP/1.0\r\n\r\n".hex()]
    python = world_python() if as_nobody else sys.executable
    proc = subprocess.run(
        [python, "-I", "-S", "-c", KNOCK,
         json.dumps([names, pids, hellos])], capture_output=True, text=True, timeout=60,
        cwd="/", preexec_fn=(lambda: os.setuid(65534)) if as_nobody else None)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


class GivingListener:
    """The positive control of KNOCK: an abstract Unix socket that answers every
    connection with 2 bytes and a descriptor (SCM_RIGHTS), as a careless backend would."""

    def __init__(self) -> None:
        self.name = f"spark_hvd-test-{os.getpid()}-{time.monotonic_ns()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind("\0" + self.name)
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn, open(os.devnull) as f:
                conn.recv(64)
                socket.send_fds(conn, [b"ok"], [f.fileno()])

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def test_no_process_without_the_jobs_secret_gets_a_segment(tmp_path):
    """While rank 2 is held in its set-up, ranks 0 and 1 listen for their peers: a client
    of this user and one of user nobody (when the test runs as root) connect to those
    sockets with wrong hellos and get nothing back, no data and no descriptor. The other
    user cannot list the ranks' descriptors or mappings either. Then the job connects and
    reduces as usual, and no shm listener is left."""
    job = DirectJob(3, [PYTHON, WORKER, "hold_shm_setup", str(tmp_path)])
    try:
        assert wait_file(tmp_path / "holding", 60), job.outputs()
        pids = job.pids
        names = listening_shm_sockets(pids[:2])
        assert len(names) == 2, f"ranks 0 and 1 should listen while rank 2 is held: {names}"
        other_user = os.geteuid() == 0 and world_python() is not None
        print(f"clients: this user{' and user nobody' if other_user else ' only (not root)'}")
        control = GivingListener()
        try:
            for as_nobody in ([False, True] if other_user else [False]):
                got = knock([control.name], [], as_nobody)
                assert got["knocks"] == [{"bytes": 2, "fds": 1}] * 2, got  # KNOCK sees a gift
        finally:
            control.close()
        for as_nobody in ([False, True] if other_user else [False]):
            got = knock(names, pids, as_nobody)
            assert got["knocks"] and all(k == {"bytes": 0, "fds": 0} for k in got["knocks"]), got
            if as_nobody:
                assert all(v == "PermissionError" for v in got["proc"].values()), got
        (tmp_path / "attack_done").write_text("")
        for r in range(3):
            assert wait_file(tmp_path / f"result{r}", 60), job.outputs()
            res = load(tmp_path, f"result{r}")
            assert res["error"] is None and res["value"] == [6.0] * 3, (res, job.outputs())
        assert listening_shm_sockets(pids) == [], "shm listeners left open after set-up"
        (tmp_path / "checked").write_text("")
        assert job.wait(30) == [0, 0, 0], job.outputs()
        warned = job.output(0) + job.output(1)
        assert "presented a wrong token" in warned and "not a spark_hvd mesh hello" in warned, \
            job.outputs()
    finally:
        job.close()
