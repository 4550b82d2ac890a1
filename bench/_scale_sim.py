"""bench/scale.py's simulated rows (``--sim-np``): N ranks as engines on threads of one
process (``_core._simulate``, csrc/python/simulate.h: the engine, controller, tcp mesh and
heartbeats users run, an in-memory store in place of the rendezvous service), for rank
counts past what this machine runs as processes. Each run is a fresh interpreter with
SPARK_HVD_CPU_OPERATIONS=tcp; its result becomes an entry of results.json shaped as the
process jobs' (bench/_scale_summary.py), in mode "sim"."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import List, Optional

import _scale_summary as summary


def peak_bytes(n: int) -> int:
    """The simulator's peak memory at n ranks, measured at 512 to 1,024 ranks: about
    0.2 MiB per rank, plus per rank ~0.9 KiB per rank of the job (the records and
    requests of a full negotiation cycle, the mesh's per-peer vectors): 1.1 GiB at
    1,024 ranks, ~16 GiB at 4,096."""
    return n * (200 * 1024 + 900 * n)


def _child(args: dict) -> None:
    """In the fresh interpreter: one simulation, printed as one JSON line."""
    from spark_hvd import _core
    from spark_hvd.exceptions import from_code

    t0 = time.monotonic()
    out = _core._simulate(**args)
    out["wall_s"] = time.monotonic() - t0
    for key in ("ops", "killed_op"):  # the exception class each status would raise
        out["ranks"][key] = [
            None if s is None else dict(s, error=type(from_code(s["code"], s["message"])).__name__)
            for s in out["ranks"][key]]
    print("SIMJSON" + json.dumps(out), flush=True)


def simulate(n: int, args: argparse.Namespace, **options) -> dict:
    """One simulation of n ranks in a child interpreter with --tree's spark_hvd."""
    env = dict(os.environ, SPARK_HVD_CPU_OPERATIONS="tcp",
               PYTHONPATH=os.pathsep.join(p for p in (args.tree, os.environ.get("PYTHONPATH"))
                                          if p))
    env.update(kv.split("=", 1) for kv in args.env)
    options = dict(size=n, timeout_s=args.liveness_timeout_s, **options)
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), json.dumps(options)],
                              env=env, capture_output=True, text=True, timeout=args.budget_s)
    except subprocess.TimeoutExpired:
        return {"failed": f"killed after {args.budget_s:.0f} s (--budget-s)",
                "wall_s": time.monotonic() - t0}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SIMJSON")]
    if proc.returncode != 0 or not lines:
        tail = " ".join((proc.stdout + proc.stderr).split()[-80:])
        return {"failed": f"exit {proc.returncode}: {tail}", "wall_s": time.monotonic() - t0}
    return json.loads(lines[-1][len("SIMJSON"):])


def _liveness(out: dict, how: str) -> Optional[dict]:
    victim = out["kill"]
    if victim < 0:
        return None
    ranks = out["ranks"]
    lost = {r: s for r, s in enumerate(ranks["killed_op"]) if r != victim and s is not None}
    named = [r for r, s in lost.items()
             if s["ranks"] == [victim] and f"rank {victim}" in s["message"]]
    after = [ranks["named_after_s"][r] for r in lost]
    return {"signal": how, "survivors": out["size"] - 1, "reported": len(lost),
            "named": len(named), "max_s": max(after) if after else None,
            "median_s": statistics.median(after) if after else None,
            "waited_s": out.get("timeout_s", 0.0),
            "errors": dict(Counter(s["error"] for s in lost.values())),
            "example": next((s["message"] for s in lost.values()), "")[:400]}


def _job(out: dict, label: str) -> dict:
    """A process job's summary (bench/_scale_summary.py's keys) from one simulation."""
    n = out.get("size")
    job = {"n": n, "mode": "sim", "label": label, "hosts": 1, "wall_s": out["wall_s"],
           "large_note": "", "server_warnings": {}}
    if "failed" in out:
        job.update(outcome="error", error={"ranks": [], "phase": "simulation",
                                           "error": "failed", "message": out["failed"]})
        return job
    ranks = out["ranks"]
    job["outcome"] = "ok" if not out["error"] else "error"
    if out["error"]:
        job["error"] = {"ranks": [r for r, s in enumerate(ranks["ops"]) if s], "phase": "sim",
                        "error": "SimulationError", "message": out["error"][:1500]}
    before, after = out["before"], out["after_init"]
    threads = (after["threads"] - before["threads"]) / n
    private_kb = (after["rss_bytes"] - before["rss_bytes"]) / n / 1024
    job["init_s"] = out["init_s"]
    job["ready_s"] = max(ranks["init_s"])
    asked = [sum(q.values()) for q in ranks["init_requests"]]
    job["requests_init"] = summary._stats(asked)
    job["requests_init_by_op"] = summary._sum_dicts(ranks["init_requests"])
    job["requests_total"] = summary._stats([sum(q.values()) for q in ranks["requests"]])
    conn = ("opened", "accepted", "failed", "dropped")
    job["connections_init"] = {k: out["init"][k] for k in conn}
    job["connections_total"] = {k: sum(out[p][k] for p in ("init", "steady", "idle", "killed"))
                                for k in conn}
    job["client_retries"] = 0
    job["resources"] = {
        "fds": summary._stats(ranks["fds"]), "sockets": summary._stats(ranks["sockets"]),
        "tcp": summary._stats(ranks["sockets"]), "unix": summary._stats([0]),
        "listening": summary._stats([2]), "threads": summary._stats([threads]),
        "private_kb": summary._stats([private_kb]), "pss_kb": summary._stats([private_kb])}
    steady, ops = out["steady"], out["ops"]
    op_s = [x for per in ranks["op_s"] for x in per]
    if ops and steady["cycles"] and op_s:
        cycles = steady["cycles"] / n  # per rank, as the process jobs count them
        per_op = steady["data_messages"] / n / ops
        job["small"] = {
            "ops": ops, "median_s": statistics.median(op_s), "min_s": min(op_s),
            "cycles": cycles, "cycles_per_op": cycles / ops,
            "control_msgs_per_cycle": steady["control_messages"] / steady["cycles"],
            "control_bytes_per_cycle": steady["control_bytes"] / steady["cycles"],
            "control_senders": ["tcp"], "data_msgs_per_op": per_op,
            "data_bytes_per_op": steady["data_bytes"] / n / ops,
            "tcp_data_msgs_per_op": per_op, "shm_data_msgs_per_op": 0.0,
            "algorithm": summary.algorithm(per_op, 0.0, n),
            "cpu_s_per_cycle_all": steady["cpu_s"] / cycles,
            "cpu_s_per_op_all": steady["cpu_s"] / ops, "wall_s": steady["seconds"]}
    idle = out["idle"]
    if idle["seconds"] > 0:
        job["idle"] = {"heartbeats_per_s": idle["liveness_messages"] / n / idle["seconds"],
                       "control_msgs_per_s": idle["control_messages"] / n / idle["seconds"],
                       "cycles_per_s": idle["cycles"] / n / idle["seconds"],
                       "cpu_s_per_s_all": idle["cpu_s"] / idle["seconds"]}
    job["liveness"] = _liveness(out, "crash (simulated)" if label == "main" else
                                "freeze (simulated)")
    return job


def entry(n: int, args: argparse.Namespace, common: dict, available: int) -> dict:
    """results.json's entry "sim/<n>": the main run (init, cached allreduces, idle, a
    crashed rank) and, up to --sim-stop-max-np, a run with a frozen rank; not run when
    its memory (peak_bytes) is more than 0.8 of `available`."""
    e = dict(common, n=n, mode="sim", ranks_per_host=args.ranks_per_host,
             date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
             load_at_start=os.getloadavg()[0], jobs={})
    need = peak_bytes(n)
    if need > 0.8 * available:
        e["skipped"] = (f"not run: about {need / 2**30:.1f} GiB needed in one process, "
                        f"{available / 2**30:.1f} GiB available")
        print(f"-- sim N={n}: {e['skipped']}", flush=True)
        return e
    runs = [("main", dict(ops=args.sim_ops, kill=n - 1, idle_s=args.idle_s))]
    if n <= args.sim_stop_max_np:
        runs.append(("stop", dict(ops=0, warmup=1, kill=n - 1, freeze=True)))
    for label, options in runs:
        print(f"-- sim N={n} {label}: starting", flush=True)
        out = simulate(n, args, **options)
        out["timeout_s"] = args.liveness_timeout_s
        e["jobs"][label] = _job(out, label)
        print(f"-- sim N={n} {label}: {e['jobs'][label]['outcome']} in {out['wall_s']:.1f} s"
              + (f" ({out.get('failed') or out.get('error')})"
                 if e["jobs"][label]["outcome"] != "ok" else ""), flush=True)
        if e["jobs"][label]["outcome"] != "ok":
            break
    return e


def _sizes(text: str) -> List[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sim-np", default="",
                   help="rank counts to simulate in one process (rows 'tcp, simulated (one "
                   "process)'), e.g. 1024,4096; with --np '' --store-np 0 nothing else runs")
    p.add_argument("--sim-ops", type=int, default=30,
                   help="cached 4-byte allreduces per simulated rank (default %(default)s)")
    p.add_argument("--sim-stop-max-np", type=int, default=1024,
                   help="a second simulation with a frozen rank up to this N "
                   "(default %(default)s)")


def sim_sizes(args: argparse.Namespace) -> List[int]:
    return _sizes(args.sim_np)


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
