"""bench/scale.py's summaries: what one job measured, from its ranks' reports (medians and
means over ranks, counts per rank, per cycle and per op), small enough for
build/scale/results.json."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import Dict, List, Optional

RESOURCE_KEYS = ("fds", "sockets", "tcp", "unix", "listening", "threads", "private_kb",
                 "pss_kb")

def _stats(values: List[float]) -> Dict[str, float]:
    return {"mean": statistics.fmean(values), "max": max(values), "min": min(values),
            "total": sum(values)}


def _sum_dicts(dicts) -> Dict[str, int]:
    out: Counter = Counter()
    for d in dicts:
        out.update(d)
    return dict(out)


def algorithm(tcp_per_op: float, shm_per_op: float, n: int) -> str:
    """The allreduce algorithm the counts show: tcp's direct exchange sends N-1 messages
    per rank, its ring 2(N-1) (one per step), recursive doubling (since 4a639ec, small
    buffers among more than 4 ranks) ceil(log2 N) on average, one more on ranks past a
    power of two; shm counts one per round it posts."""
    parts = []
    log2 = math.ceil(math.log2(n)) if n > 1 else 0
    if tcp_per_op > 0.01:
        if abs(tcp_per_op - (n - 1)) < 0.05:
            parts.append("direct")
        elif abs(tcp_per_op - 2 * (n - 1)) < 0.05:
            parts.append("ring")
        elif n > 4 and tcp_per_op <= log2 + 1.05:
            parts.append("recursive doubling")
        else:
            parts.append(f"tcp {tcp_per_op:g}")
    if shm_per_op > 0.01:
        parts.append(f"shm {shm_per_op:g} round{'' if shm_per_op == 1 else 's'}")
    return " + ".join(parts) or "none"


def loop_summary(mains: Dict[int, dict], key: str, n: int) -> Optional[dict]:
    recs = [m[key] for m in mains.values() if key in m]
    if len(recs) != n:
        return None
    ops = recs[0]["ops"]
    cycles = statistics.median(r["cycles"] for r in recs)

    def per_rank(name: str) -> float:
        return statistics.fmean(r["traffic"].get(name, 0) for r in recs)

    return {
        "ops": ops,
        "median_s": statistics.median(r["median_s"] for r in recs),
        "min_s": min(r["min_s"] for r in recs),
        "cycles": cycles,
        "cycles_per_op": cycles / ops,
        "control_msgs_per_cycle": per_rank("control.messages") / cycles if cycles else 0.0,
        "control_bytes_per_cycle": per_rank("control.bytes") / cycles if cycles else 0.0,
        "control_senders": sorted({k.split(".")[0] for r in recs for k in r["traffic"]
                                   if k.count(".") == 2 and ".control." in k}),
        "data_msgs_per_op": per_rank("data.messages") / ops,
        "data_bytes_per_op": per_rank("data.bytes") / ops,
        "tcp_data_msgs_per_op": per_rank("tcp.data.messages") / ops,
        "shm_data_msgs_per_op": per_rank("shm.data.messages") / ops,
        "algorithm": algorithm(per_rank("tcp.data.messages") / ops,
                               per_rank("shm.data.messages") / ops, n),
        "cpu_s_per_cycle_all": sum(r["cpu_s"] for r in recs) / cycles if cycles else 0.0,
        "cpu_s_per_op_all": sum(r["cpu_s"] for r in recs) / ops,
        "wall_s": max(r["wall_s"] for r in recs),
    }


def liveness_summary(job: dict) -> Optional[dict]:
    live = job.get("liveness")
    if not live:
        return None
    n, victim = job["n"], job["n"] - 1
    lost = job["lost"]
    named = [r for r, x in lost.items()
             if victim in x.get("ranks", []) and str(victim) in x.get("message", "")]
    detect = [x["at"] - live["at"] for x in lost.values()]
    return {
        "signal": live["signal"], "survivors": n - 1, "reported": len(lost),
        "named": len(named),
        "max_s": max(detect) if detect else None,
        "median_s": statistics.median(detect) if detect else None,
        "waited_s": live["waited_s"],
        "errors": dict(Counter(x.get("error") or "none" for x in lost.values())),
        "example": next((x.get("message", "") for x in lost.values()), "")[:400],
    }


def summarize(job: dict) -> dict:
    """What the docs and the plot need from one job (the per-rank reports stay out)."""
    n = job["n"]
    s = {k: job.get(k) for k in ("n", "mode", "label", "hosts", "outcome", "wall_s",
                                 "launch_s", "server_warnings", "server_warning_examples",
                                 "exited", "reports_then", "server_cpu_s", "store_progress",
                                 "samples", "thread_cpu_s", "budget")}
    s["large_note"] = job["config"].get("large_note", "")
    inits, mains = job["inits"], job["mains"]
    s["init_reports"], s["main_reports"] = len(inits), len(mains)
    if job["errors"]:
        rank, err = sorted(job["errors"].items())[0]
        s["error"] = {"ranks": sorted(job["errors"]), "rank": rank, "phase": err.get("phase"),
                      "error": err.get("error"), "message": err.get("message", "")[:1500],
                      "client_retries": err.get("client_retries")}
    if job.get("log_tail"):
        s["log_tail"] = job["log_tail"][-1500:]
    if len(inits) == n:
        calls = [x["init_call"] for x in inits.values()]
        returns = [x["init_return"] for x in inits.values()]
        s["init_s"] = max(returns) - max(calls)
        s["ready_s"] = max(returns) - job["t_start"]
        s["init_call_spread_s"] = max(calls) - min(calls)
        s["requests_init"] = _stats([sum(x["requests_init"].values()) for x in inits.values()])
        s["requests_init_by_op"] = _sum_dicts(x["requests_init"] for x in inits.values())
        s["connections_init"] = _sum_dicts(x["connections_init"] for x in inits.values())
        s["resources"] = {k: _stats([x["resources"][k] for x in inits.values()])
                          for k in RESOURCE_KEYS}
    if len(mains) == n:
        s["requests_total"] = _stats([sum(x["requests_total"].values())
                                      for x in mains.values()])
        s["connections_total"] = _sum_dicts(x["connections_total"] for x in mains.values())
        s["client_retries"] = sum(x["client_retries"] for x in mains.values())
        for key in sorted({k for x in mains.values() for k in x
                           if k == "small" or k.startswith("data_")}):
            s[key] = loop_summary(mains, key, n)
        idle = [x["idle"] for x in mains.values() if "idle" in x]
        if len(idle) == n:
            s["idle"] = {
                "heartbeats_per_s": statistics.fmean(
                    x["traffic"].get("liveness.messages", 0) / x["wall_s"] for x in idle),
                "control_msgs_per_s": statistics.fmean(
                    x["traffic"].get("control.messages", 0) / x["wall_s"] for x in idle),
                "cycles_per_s": statistics.fmean(x["cycles"] / x["wall_s"] for x in idle),
                "cpu_s_per_s_all": sum(x["cpu_s"] for x in idle) / max(x["wall_s"]
                                                                         for x in idle),
            }
    s["liveness"] = liveness_summary(job)
    return s


def failure_text(job: dict) -> str:
    s = summarize(job)
    lines = [f"   outcome {s['outcome']}: {s['init_reports']} init reports, "
             f"{s['main_reports']} main reports of {s['n']}"]
    if s.get("error"):
        e = s["error"]
        lines.append(f"   ranks {e['ranks'][:20]} failed; rank {e['rank']} in {e['phase']}: "
                     f"{e['error']}: {e['message'][:800]}")
    if s.get("exited"):
        lines.append(f"   exited: {s['exited']}")
    if s.get("server_warnings"):
        lines.append(f"   rendezvous server warnings: {s['server_warnings']}")
    if s.get("store_progress"):
        lines.append(f"   the rendezvous service then: {s['store_progress']}")
    for x in (s.get("samples") or [])[-6:]:
        lines.append(f"   t={x['t']:.0f} s: load {x['load']:.0f}, CPU user {x['user']:.0%} "
                     f"system {x['system']:.0%} idle {x['idle']:.0%}, rendezvous server "
                     f"{x['server_cores']:.2f} cores, {x['init']} ranks through init; ranks' "
                     f"threads (cores): {top(x.get('rank_threads_cores') or {}, 4)}")
    if s.get("log_tail"):
        lines.append("   ranks' output, last lines:\n" + s["log_tail"][-1200:])
    return "\n".join(lines)


def top(d: Dict[str, float], k: int) -> str:
    return ", ".join(f"{name} {v:.2f}" for name, v in sorted(d.items(), key=lambda kv: -kv[1])[:k])
