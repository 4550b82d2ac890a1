"""One rank of bench/scale.py: ``python bench/_scale_rank.py OUTDIR CONFIG_JSON``.

Started by scale.py with the launch contract in its environment (no launcher). It
measures what the job costs this rank and writes it as JSON into OUTDIR:

* ``main<rank>.json``: init (wall clock before and after ``init()``), rendezvous
  requests by op (at init and in all), connection counts, resources after init (fds,
  sockets, threads, private memory), the steady control plane and the data plane over
  time-budgeted loops of cached allreduces, heartbeats over an idle interval;
* then, when CONFIG asks for a liveness test, the last rank is the victim: it blocks
  without joining anything while every other rank waits in an allreduce it never
  joins, and scale.py SIGKILLs (or SIGSTOPs) it. Each survivor writes
  ``lost<rank>.json``: when its exception arrived, its class, message and ranks;
* ``error<rank>.json`` when something fails (init included): the exception.

Every rank runs the same number of each op: rank 0 decides in the first element of each
timed allreduce whether another one follows (a Sum over ranks where only rank 0
contributes), so a loop is bounded by rank 0's clock without a further message.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import statistics
import sys
import time

PROCESS_START = time.time()

import numpy as np  # noqa: E402

import spark_hvd as hvd  # noqa: E402

OUT = sys.argv[1]
CONFIG = json.loads(sys.argv[2])
RANK = int(os.environ["SPARK_HVD_RANK"])
KINDS = ("control", "data", "liveness")


def save(name: str, record: dict) -> None:
    path = os.path.join(OUT, name)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


class RetryCounter(logging.Handler):
    """Counts the rendezvous client's reconnects of a connection the server closed
    before authenticating it (logged at debug level by spark_hvd._job.client)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.retries = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "before authenticating" in record.getMessage():
            self.retries += 1


def resources() -> dict:
    """This process's descriptors (sockets by family, listening ones apart), threads and
    memory (kB) as /proc shows them."""
    fds = tcp = unix = other_sockets = listening = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the listdir's own descriptor, closed since
        fds += 1
        if not target.startswith("socket:"):
            continue
        try:
            s = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            other_sockets += 1
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6):
                tcp += 1
            elif s.family == socket.AF_UNIX:
                unix += 1
            else:
                other_sockets += 1
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                listening += 1
        finally:
            s.close()
    mem = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Rss", "Pss", "Private_Clean", "Private_Dirty"):
                mem[key] = int(value.split()[0])
    return {"fds": fds, "sockets": tcp + unix + other_sockets, "tcp": tcp, "unix": unix,
            "listening": listening, "threads": len(os.listdir("/proc/self/task")),
            "private_kb": mem.get("Private_Clean", 0) + mem.get("Private_Dirty", 0),
            "pss_kb": mem.get("Pss", 0), "rss_kb": mem.get("Rss", 0)}


def snapshot() -> dict:
    """Counters now: traffic per sender and kind, cycles, CPU and wall time."""
    from spark_hvd import _core

    flat = {}
    for sender, kinds in _core.traffic().items():
        if sender == "connections":
            continue
        for kind in KINDS:
            flat[f"{sender}.{kind}.messages"] = kinds[kind]["messages"]
            flat[f"{sender}.{kind}.bytes"] = kinds[kind]["bytes"]
    return {"traffic": flat, "cycles": _core.cycles(), "cpu_s": time.process_time(),
            "wall_s": time.monotonic()}


def delta(a: dict, b: dict) -> dict:
    """Counters from a to b; traffic summed per kind too (``kind.messages``...)."""
    traffic = {k: b["traffic"][k] - a["traffic"][k] for k in a["traffic"]}
    for kind in KINDS:
        for unit in ("messages", "bytes"):
            traffic[f"{kind}.{unit}"] = sum(v for k, v in traffic.items()
                                            if k.count(".") == 2 and k.split(".")[1] == kind
                                            and k.endswith(unit))
    return {"traffic": {k: v for k, v in traffic.items() if v},
            "cycles": b["cycles"] - a["cycles"], "cpu_s": b["cpu_s"] - a["cpu_s"],
            "wall_s": b["wall_s"] - a["wall_s"]}


def timed_loop(name: str, elements: int, budget_s: float, warmup: int, min_reps: int,
               max_reps: int) -> dict:
    """Blocking float32 Sum allreduces of one cached name: ``warmup`` untimed, then timed
    ones until rank 0's budget is spent (at least min_reps, at most max_reps)."""
    x = np.zeros(elements, np.float32)
    for _ in range(warmup):
        hvd.allreduce(x, name=name, op=hvd.Sum)
    times = []
    start = time.monotonic()
    before = snapshot()
    while True:
        if RANK == 0:
            done = len(times) + 1
            more = done < min_reps or (done < max_reps and time.monotonic() - start < budget_s)
            x[0] = 1.0 if more else 0.0
        t0 = time.perf_counter()
        out = hvd.allreduce(x, name=name, op=hvd.Sum)
        times.append(time.perf_counter() - t0)
        if out[0] < 0.5:
            break
    after = snapshot()
    return {"ops": len(times), "median_s": statistics.median(times), "min_s": min(times),
            "max_s": max(times), **delta(before, after)}


def wait_forever() -> None:
    while True:
        select.select([], [], [], 3600)


def lost_peer(victim: int) -> None:
    """Waits in an allreduce the victim never joins; writes what ended the wait."""
    t0 = time.monotonic()
    try:
        hvd.allreduce(np.ones(1, np.float32), name="scale.victim", op=hvd.Sum)
    except Exception as e:  # noqa: BLE001 - the outcome measured
        record = {"error": type(e).__name__, "message": str(e)[:2000],
                  "ranks": list(getattr(e, "ranks", None) or [])}
    else:
        record = {"error": None}
    save(f"lost{RANK}.json", {"at": time.time(), "waited_s": time.monotonic() - t0,
                              "victim": victim, **record})


def wait_for_go() -> None:
    """--sync-init: tells scale.py this rank is ready to call init() (its imports done) and
    waits until every rank is, so the ranks call init() together, not spread over the
    tens of seconds N interpreters take to start on a few cores."""
    save(f"ready{RANK}.json", {"at": time.time()})
    go = os.path.join(OUT, "go")
    while not os.path.exists(go):
        time.sleep(0.05)


def main() -> None:
    from spark_hvd import _core, _runtime

    if CONFIG.get("sync_init"):
        wait_for_go()
    retries = RetryCounter()
    client_log = logging.getLogger("spark_hvd._job.client")
    client_log.addHandler(retries)
    client_log.setLevel(logging.DEBUG)
    record: dict = {"rank": RANK, "process_start": PROCESS_START}
    record["init_call"] = time.time()
    try:
        hvd.init()
    except Exception as e:  # noqa: BLE001 - reported to scale.py
        save(f"error{RANK}.json", {"phase": "init", "error": type(e).__name__,
                                   "message": str(e)[:4000], "at": time.time(),
                                   "client_retries": retries.retries})
        os._exit(1)
    record["init_return"] = time.time()
    client = _runtime.RUNTIME.client
    record["requests_init"] = dict(client.requests)
    record["connections_init"] = dict(_core.traffic()["connections"])
    phase = "after init"
    try:
        hvd.barrier()
        record["resources"] = resources()
        save(f"init{RANK}.json", record)
        size = hvd.size()
        if CONFIG.get("steady"):
            phase = "steady"
            record["small"] = timed_loop("scale.small", 1, CONFIG["steady_s"], CONFIG["warmup"],
                                         CONFIG["min_reps"], CONFIG["max_reps"])
        for elements in CONFIG.get("data_elements", []):
            phase = f"data {elements * 4} B"
            record[f"data_{elements * 4}"] = timed_loop(
                f"scale.data{elements}", elements, CONFIG["data_s"], 1,
                CONFIG["min_reps_large"] if elements * 4 > (1 << 20) else CONFIG["min_reps"],
                CONFIG["max_reps"])
        if CONFIG.get("idle_s"):
            phase = "idle"
            hvd.barrier()
            before = snapshot()
            time.sleep(CONFIG["idle_s"])
            record["idle"] = delta(before, snapshot())
            hvd.barrier()
        record["requests_total"] = dict(client.requests)
        record["connections_total"] = dict(_core.traffic()["connections"])
        record["client_retries"] = retries.retries
        record["resources_end"] = resources()
    except Exception as e:  # noqa: BLE001 - reported to scale.py
        save(f"error{RANK}.json", {"phase": phase, "error": type(e).__name__,
                                   "message": str(e)[:4000], "at": time.time(),
                                   "partial": record})
        os._exit(1)
    victim = size - 1
    liveness = CONFIG.get("liveness")
    if liveness and RANK == victim:
        save(f"main{RANK}.json", record)
        wait_forever()  # scale.py kills (or stops) this process now
    save(f"main{RANK}.json", record)
    if liveness:
        lost_peer(victim)
        os._exit(0)  # the job is broken: no teardown to wait for
    hvd.shutdown()


if __name__ == "__main__":
    main()
