"""What a rank costs as the job grows (issue #33), asserted through the core's counters
(`_core.traffic()`, `_core.cycles()`) rather than timings: the control plane and small
collectives take log2(n) messages per rank on tcp, a rank connects only the peers its
algorithms talk to (others on demand, as an alltoall needs them), and running out of file
descriptors is a clear error at once."""

import json
import math
import textwrap

from _ranks import PYTHON, hvdrun

TCP = {"SPARK_HVD_CPU_OPERATIONS": "tcp"}

RANK = textwrap.dedent("""
    import json, os
    import numpy as np
    import spark_hvd as hvd
    from spark_hvd import _core

    def sockets():
        n = 0
        for f in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{f}").startswith("socket:")
            except OSError:
                pass
        return n

    def sent(kind):
        return _core.traffic()["tcp"][kind]["messages"]

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    for _ in range(20):  # warm-up: every name cached
        hvd.allreduce(np.ones(1, np.float32), name="scale.small")
    opened = _core.traffic()["connections"]
    mesh_sockets = opened["opened"] + opened["accepted"]
    c0, k0, d0 = _core.cycles(), sent("control"), sent("data")
    steps = 50
    for _ in range(steps):
        got = hvd.allreduce(np.full(3, me + 1.0, np.float32), op=hvd.Sum, name="scale.small")
    assert got.tolist() == [n * (n + 1) / 2] * 3, got
    c1, k1, d1 = _core.cycles(), sent("control"), sent("data")
    before = sockets()
    out, _ = hvd.alltoall(np.arange(n, dtype=np.float32) + 100 * me, name="scale.a2a")
    assert out.tolist() == [100.0 * j + me for j in range(n)], out
    print("SCALE" + json.dumps({
        "rank": me, "size": n, "connections_at_init": mesh_sockets,
        "control_per_cycle": (k1 - k0) / (c1 - c0), "data_per_op": (d1 - d0) / steps,
        "sockets_before_alltoall": before, "sockets_after_alltoall": sockets()}), flush=True)
""")


def _records(proc):
    out = [json.loads(line.split("SCALE", 1)[1]) for line in proc.stdout.splitlines()
           if "SCALE{" in line]
    return sorted(out, key=lambda r: r["rank"])


def test_log_depth_messages_and_connections_on_demand_at_16_ranks():
    n = 16
    proc = hvdrun(n, [PYTHON, "-c", RANK], env=TCP, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = _records(proc)
    assert len(records) == n, proc.stdout[-3000:]
    log2 = math.ceil(math.log2(n))
    for r in records:
        # One summary per cycle by recursive doubling; one small allreduce per op.
        assert r["control_per_cycle"] <= log2 + 1, r
        assert r["data_per_op"] <= log2 + 1, r
        # The heartbeats' connections are to every peer today (n - 1); the mesh's to
        # rank +- 2^k only, 7 of 15 at 16 ranks (the alltoall connects the rest).
        assert r["connections_at_init"] - (n - 1) == 2 * log2 - 1, r
        assert r["sockets_after_alltoall"] - r["sockets_before_alltoall"] == n - 1 - 7, r


def test_running_out_of_file_descriptors_is_a_clear_error_at_once():
    """16 ranks under `ulimit -n 30` (a limit too low for their connections) used to wait
    out SPARK_HVD_START_TIMEOUT_S and report a timeout naming other ranks; the rank that
    runs out now says so at once, with its limit and what the job needs."""
    script = "import numpy as np, spark_hvd as hvd; hvd.init(); hvd.allreduce(np.ones(1))"
    proc = hvdrun(16, ["sh", "-c", f'ulimit -n 30; exec "{PYTHON}" -c "{script}"'],
                  env=TCP, timeout=60)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    lines = [ln for ln in text.splitlines() if "ran out of file descriptors" in ln]
    assert lines, text[-4000:]
    assert "ulimit -n" in lines[0] and "may open 30 files" in lines[0], lines[0]
    assert "InvalidArgumentError" in lines[0], lines[0]
    assert "SPARK_HVD_START_TIMEOUT_S" not in text, text[-4000:]
