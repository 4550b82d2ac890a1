"""The Gloo backend's own TCP connections (csrc/backends/tcp/): a rank's
listener accepts only peers that present its token from the rendezvous store."""

import os
import socket
import struct
import textwrap

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


def test_listener_drops_connections_without_the_token_and_the_job_still_connects(tmp_path):
    go = tmp_path / "go"
    job = DirectJob(2, [PYTHON, "-c", WORKER, str(go)])
    try:
        # Rank 0 publishes "host port token" and waits for rank 1, which waits for us.
        key = f"{job.server.run_id}/init1/tcp/set0/tcp/0"
        host, port, token = job.server.get(key, 60).decode().split()
        assert len(token) == 32
        wrong = "0" * 32 if token != "0" * 32 else "1" * 32
        strays = [b"GET / HTTP/1.0\r\n\r\n" + b"x" * 40,            # garbage
                  struct.pack("<II", 0x73687664, 1) + wrong.encode(),  # right shape, wrong token
                  b""]                                                   # connects, says nothing
        for payload in strays:
            with socket.create_connection((host, int(port)), timeout=10) as s:
                if payload:
                    s.sendall(payload)
                    # The listener closes a connection it refuses (a reset when our
                    # garbage was left unread).
                    s.settimeout(10)
                    try:
                        answer = s.recv(16)
                    except ConnectionResetError:
                        answer = b""
                    assert answer == b"", "a connection with a bad hello was answered"
        go.write_text("go")
        codes = job.wait(60)
        logs = [job.output(r) for r in range(2)]
        assert codes == [0, 0], (codes, logs)
        for r in range(2):
            assert "RESULT [3.0, 3.0, 3.0]" in logs[r], logs[r]
        assert logs[0].count("dropped a connection without a valid hello") >= 2, logs[0]
    finally:
        job.close()
