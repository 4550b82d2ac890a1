"""What carries a job's collectives across the box's hosts, measured inside each rank.

``measure()`` runs in every rank of a job (spark-hvdrun -H, or spark_hvd.spark.run) and
returns, for three allreduces of ``nbytes``, what each one sent: this process's rounds on
shm and bytes on tcp (``_core.traffic()``) and its host's bytes by link (the kernel's
counters of ``eth0``, the host's cable, and ``lo``, which carries tcp between two ranks
of one host), each op between two barriers:

- ``local``: a process set per host (its ranks only);
- ``across``: one rank per host (each host's local rank 0);
- ``global``: every rank (hierarchical or flat, as the job's settings say).

Run as a script it prints one JSON line per rank (``spark-hvdrun ... python
rank_traffic.py [nbytes]``).
"""

import json
import os
import socket
import sys

import numpy as np

NBYTES = 16 << 20


def _links() -> dict:
    """This host's bytes sent per link (this namespace's /sys/class/net) and the tcp
    segments it has sent again (``resent``: /proc/net/snmp's RetransSegs)."""
    out = {}
    for dev in ("eth0", "lo"):
        with open(f"/sys/class/net/{dev}/statistics/tx_bytes") as f:
            out[dev] = int(f.read())
    with open("/proc/net/snmp") as f:
        names, values = (line.split()[1:] for line in f if line.startswith("Tcp:"))
    out["resent"] = int(dict(zip(names, values))["RetransSegs"])
    return out


def _sent() -> dict:
    """This process's collectives so far: shm rounds (its bytes go through memory,
    uncounted) and tcp bytes."""
    from spark_hvd import _core

    t = _core.traffic()
    return {"shm_rounds": t["shm"]["data"]["messages"], "tcp": t["tcp"]["data"]["bytes"]}


def measure(nbytes: int = NBYTES) -> dict:
    import spark_hvd as hvd

    hvd.init()
    me = socket.gethostname()
    hosts = hvd.allgather_object(me, name="traffic.hosts")
    names = list(dict.fromkeys(hosts))
    local = [hvd.add_process_set([r for r, h in enumerate(hosts) if h == n]) for n in names]
    across = hvd.add_process_set([hosts.index(n) for n in names])
    mine = local[names.index(me)]
    x = np.ones(nbytes // 4, np.float32)
    ops = {"local": (mine, True), "across": (across, across.included()),
           "global": (hvd.global_process_set, True)}
    result = {"rank": hvd.rank(), "host": me, "hosts": hosts, "local_rank": hvd.local_rank(),
              "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
              "env_host": os.environ.get("SPARK_HVD_HOSTNAME"),
              "gpu": os.environ.get("CUDA_VISIBLE_DEVICES")}
    for what, (ps, member) in ops.items():
        hvd.barrier()
        links, sent = _links(), _sent()
        if member:
            got = hvd.allreduce(x, op=hvd.Sum, name=f"traffic.{what}", process_set=ps)
            assert got[0] == ps.size(), (what, got[0])
        hvd.barrier()
        links2, sent2 = _links(), _sent()
        result[what] = {"member": member,
                        **{k: sent2[k] - sent[k] for k in sent},
                        **{k: links2[k] - links[k] for k in links}}
    hvd.shutdown()
    return result


def check(results: list, nbytes: int, hierarchical: bool) -> None:
    """Asserts that each op went where it should, in bytes: ``results`` are measure()'s
    by rank. tcp's allreduce is a ring in rank order (each rank sends 2(n-1)/n of the
    buffer to the next), so a host's cable carries that for each of its ranks whose next
    rank is elsewhere, and its ``lo`` for the others; shm sends nothing through either.

    A link's counter also holds what tcp sent again: on a loaded machine ``lo``'s backlog
    overflows and drops segments (a run here resent 400 in one op; CI saw 10 % more bytes
    on ``lo`` than the ring sends). Where the host resent any, a link may carry up to a
    fifth more than its share, never less. The process's own tcp bytes, never resent, are
    held to the share exactly."""
    small = nbytes // 16  # heartbeats, negotiation, barriers: a few KiB
    n, hosts = len(results), results[0]["hosts"]
    names = list(dict.fromkeys(hosts))
    per_host = {h: hosts.count(h) for h in names}

    def ring(members: int, part: float = 1.0) -> float:
        return 2 * (members - 1) / members * nbytes * part

    def near(got: float, want: float, resent: int = 0) -> bool:
        return want - small <= got <= want + small + (want / 5 if resent else 0)

    for r, res in enumerate(results):
        me, why = res["host"], f"rank {r} on {res['host']}: {res}"
        same = [q for q, h in enumerate(hosts) if h == me]
        assert (res["rank"], hosts[r], res["local_size"], res["local_rank"]) == \
            (r, me, len(same), same.index(r)), why
        loc = res["local"]
        if len(same) > 1:
            assert loc["shm_rounds"] > 0 and loc["tcp"] < small, f"local op not on shm: {why}"
        assert loc["eth0"] < small and loc["lo"] < small, f"local op left shm: {why}"
        acr = res["across"]
        assert acr["shm_rounds"] == 0 and acr["lo"] < small, why
        assert near(acr["tcp"], ring(len(names)) if acr["member"] else 0), why
        assert near(acr["eth0"], ring(len(names)), acr["resent"]), \
            f"across op not on the cable: {why}"
        glo = res["global"]
        if hierarchical:
            share = ring(len(names), 1 / per_host[me])
            assert glo["shm_rounds"] > 0 and near(glo["tcp"], share), why
            assert near(glo["eth0"], share * len(same), glo["resent"]), why
            assert glo["lo"] < small, why
        else:
            crossing = sum(hosts[(q + 1) % n] != me for q in same)
            assert glo["shm_rounds"] == 0 and near(glo["tcp"], ring(n)), why
            assert near(glo["eth0"], ring(n) * crossing, glo["resent"]), \
                f"flat ring's cable bytes: {why}"
            assert near(glo["lo"], ring(n) * (len(same) - crossing), glo["resent"]), \
                f"flat ring's lo: {why}"


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]) if len(sys.argv) > 1 else NBYTES)), flush=True)
