"""spark-hvdrun -H across the box: every rank starts over ssh on its host, as on a real
cluster; the ranks of one host share memory, the hosts talk tcp over their cables, and
the kernel's byte counters say so (rank_traffic.py)."""

import json
import os
import subprocess
import sys

import pytest

import rank_traffic

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 240


def hvdrun(box, *args, env=None, timeout_s=TIMEOUT_S) -> subprocess.CompletedProcess:
    """``spark-hvdrun`` from the root namespace (the driver's address on the bridge)."""
    return subprocess.run(
        [sys.executable, "-m", "spark_hvd.runner", "--network-interface", box.driver_addr,
         *args], env=box.env(dict(os.environ, **(env or {}))), capture_output=True, text=True,
        timeout=timeout_s)


def hosts_arg(box, slots: int) -> str:
    return ",".join(f"{h}:{slots}" for h in box.names)


def by_rank(stdout: str) -> dict:
    """Each rank's JSON line, by the rank of its ``[rank]`` prefix."""
    out = {}
    for line in stdout.splitlines():
        prefix, _, payload = line.partition(" ")
        if prefix.startswith("[") and payload.startswith("{"):
            out[int(prefix.strip("[]"))] = json.loads(payload)
    return out


@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "hierarchical"])
def test_ranks_on_one_host_use_shm_across_hosts_tcp(box, hierarchical):
    """8 ranks, 2 per host: a set within each host runs on shm (no byte on any link), a
    set of one rank per host and the global set on tcp over the hosts' cables; the flat
    global allreduce is a ring whose intra-host hops run on tcp over lo, the hierarchical
    one keeps them in shared memory and sends only a slice per rank across."""
    n = 2 * len(box.hosts)
    proc = hvdrun(box, "-np", str(n), "-H", hosts_arg(box, 2), sys.executable,
                  os.path.join(HERE, "rank_traffic.py"), str(rank_traffic.NBYTES),
                  env={"HOROVOD_HIERARCHICAL_ALLREDUCE": str(int(hierarchical))})
    assert proc.returncode == 0, proc.stderr
    results = by_rank(proc.stdout)
    assert sorted(results) == list(range(n)), proc.stdout
    for r, res in results.items():
        host = box.names[r // 2]
        assert (res["host"], res["env_host"], res["cross_rank"]) == (host, host, r // 2), res
    rank_traffic.check([results[r] for r in range(n)], rank_traffic.NBYTES, hierarchical)
