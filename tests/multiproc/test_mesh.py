"""spark_hvd's own TCP mesh (csrc/backends/tcp/): a rank's listener accepts only peers
that present its token from the rendezvous store, reads every connection's hello
concurrently under a per-connection deadline, and says what it dropped and why."""

import socket
import struct
import textwrap
import threading
import time

import pytest

from _ranks import PYTHON, DirectJob

WORKER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import spark_hvd as hvd
    if os.environ["SPARK_HVD_RANK"] == "1":
        go = sys.argv[1]
        deadline = time.monotonic() + 60
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.02)
    hvd.init()
    print("RESULT", hvd.allreduce(np.full(3, hvd.rank() + 1.0), op=hvd.Sum).tolist(), flush=True)
""")
HELLO_MAGIC = 0x73687664
HELLO_DEADLINE_S = 5.0
# The heartbeats' connections (set up first, with the same code) are off, so rank 0
# publishes the mesh's address while rank 1 has not started init.
NO_HEARTBEATS = {"SPARK_HVD_HEARTBEAT_TIMEOUT_S": "0"}


def rank0_address(job):
    """Rank 0's published "host port token" (it then waits for rank 1, which waits for us)."""
    key = f"{job.server.run_id}/init1/tcp/set0/tcp/0"
    host, port, token = job.server.get(key, 60).decode().split()
    assert len(token) == 32
    return host, int(port), token


def assert_job_connected(job, codes):
    logs = [job.output(r) for r in range(2)]
    assert codes == [0, 0], (codes, logs)
    for r in range(2):
        assert "RESULT [3.0, 3.0, 3.0]" in logs[r], logs[r]
    return logs


def test_listener_drops_bad_hellos_says_why_and_the_job_still_connects(tmp_path):
    go = tmp_path / "go"
    job = DirectJob(2, [PYTHON, "-c", WORKER, str(go)], env=NO_HEARTBEATS)
    try:
        host, port, token = rank0_address(job)
        wrong = "0" * 32 if token != "0" * 32 else "1" * 32
        strays = [b"GET / HTTP/1.0\r\n\r\n" + b"x" * 40,                      # garbage
                  struct.pack("<II", HELLO_MAGIC, 1) + wrong.encode(),         # wrong token
                  struct.pack("<II", HELLO_MAGIC, 7) + token.encode(),         # no such rank
                  struct.pack("<I", HELLO_MAGIC)]                              # closes mid-hello
        for payload in strays:
            with socket.create_connection((host, port), timeout=10) as s:
                s.sendall(payload)
                if len(payload) >= 40:
                    # The listener closes a connection it refuses (a reset when our
                    # garbage was left unread).
                    try:
                        answer = s.recv(16)
                    except ConnectionResetError:
                        answer = b""
                    assert answer == b"", "a connection with a bad hello was answered"
        # A connection that never completes its hello is dropped at its deadline.
        with socket.create_connection((host, port), timeout=3 * HELLO_DEADLINE_S) as idle:
            t0 = time.monotonic()
            assert idle.recv(16) == b""
            dropped_after = time.monotonic() - t0
        assert dropped_after < HELLO_DEADLINE_S + 3, dropped_after
        go.write_text("go")
        logs = assert_job_connected(job, job.wait(60))
        for why in ("is not a spark_hvd mesh hello", "presented a wrong token",
                    "hello from rank 7, which is not expected",
                    "closed the connection after 4 of 40 hello bytes",
                    f"sent no complete hello in {HELLO_DEADLINE_S:g} s (0 of 40 bytes)"):
            assert why in logs[0], f"rank 0 did not log {why!r}:\n{logs[0]}"
        assert logs[0].count("; dropped") == 5, logs[0]
    finally:
        job.close()


def trickle(sock: socket.socket, every_s: float, stop: threading.Event) -> None:
    """Sends one byte every every_s until stopped or refused."""
    while not stop.wait(every_s):
        try:
            sock.send(b"s")
        except OSError:
            return


@pytest.mark.parametrize("strays", ["4 idle", "1 trickling"])
def test_idle_and_trickling_connections_neither_fail_nor_delay_init(tmp_path, strays):
    """Before the listener read hellos concurrently, four idle connections delayed
    init by 5 s each and one sending a byte every 3 s failed it after the 30 s
    start deadline ("wrong token?")."""
    go = tmp_path / "go"
    job = DirectJob(2, [PYTHON, "-c", WORKER, str(go)], env=NO_HEARTBEATS)
    socks = []
    stop = threading.Event()
    try:
        host, port, _ = rank0_address(job)
        count = int(strays.split()[0])
        socks = [socket.create_connection((host, port), timeout=10) for _ in range(count)]
        if "trickling" in strays:
            threading.Thread(target=trickle, args=(socks[0], 3.0, stop), daemon=True).start()
        t0 = time.monotonic()
        go.write_text("go")
        codes = job.wait(90)
        took = time.monotonic() - t0
        print(f"{strays} connection(s): init + one allreduce took {took:.2f} s")
        assert_job_connected(job, codes)
        assert took < 8.0, f"{strays} connection(s) delayed init to {took:.1f} s"
    finally:
        stop.set()
        for s in socks:
            s.close()
        job.close()
