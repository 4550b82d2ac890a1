"""bench/scale.py's jobs: N rank processes started as a launcher starts them, waiting for
their reports, the liveness test, watching where the machine's CPU goes; and the probe of
the rendezvous service alone."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from typing import Dict, List, Optional

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
RANK_SCRIPT = os.path.join(BENCH, "_scale_rank.py")
STORE_SCRIPT = os.path.join(BENCH, "_scale_store.py")
WORK = os.path.join(ROOT, "build", "scale")
POLL_S = 0.2


def base_env(tree: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARK_HVD_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)
    return env


class ServerLog(logging.Handler):
    """The rendezvous server's warnings (connections it closed or refused), by reason."""

    PATTERNS = (("closed before auth", "before it authenticated"),
                ("handshake timeout", "did not authenticate"),
                ("accept failed", "cannot accept"),
                ("refused request", "refused a request"))

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: Dict[str, int] = {}
        self.first: Dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        reason = next((r for r, pat in self.PATTERNS if pat in text), "other")
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.first.setdefault(reason, text[:300])


def read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def files(outdir: str, prefix: str) -> Dict[int, dict]:
    out = {}
    for name in os.listdir(outdir):
        m = re.fullmatch(rf"{prefix}(\d+)\.json", name)
        if m:
            rec = read_json(os.path.join(outdir, name))
            if rec is not None:
                out[int(m.group(1))] = rec
    return out


def log_tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def run_job(n: int, mode: str, args: argparse.Namespace, config: dict, label: str) -> dict:
    """Runs one job of n ranks; returns every rank's reports and what happened."""
    from spark_hvd._job import env as job_env
    from spark_hvd._job.topology import assign
    from spark_hvd.runner.rendezvous import RendezvousServer

    outdir = os.path.join(WORK, f"{mode}-{n}-{label}")
    shutil.rmtree(outdir, ignore_errors=True)
    os.makedirs(outdir)
    log_path = os.path.join(outdir, "ranks.log")
    server_log = ServerLog()
    runner_logger = logging.getLogger("spark_hvd.runner")
    runner_logger.addHandler(server_log)
    # Every warning logged, none held back by the rate limit, so they can be counted.
    server = RendezvousServer(host="127.0.0.1", warning_interval_s=0.0)
    server.start()
    hosts = [f"simhost{r // args.ranks_per_host}" for r in range(n)]
    env0 = base_env(args.tree)
    if mode == "tcp":
        env0["SPARK_HVD_CPU_OPERATIONS"] = "tcp"
    for kv in args.env:
        key, _, value = kv.partition("=")
        env0[key] = value
    procs: List[subprocess.Popen] = []
    pgid = 0
    job: dict = {"n": n, "mode": mode, "label": label, "hosts": len(set(hosts)),
                 "outcome": "ok", "config": config}
    t_start = time.time()
    t_mono = time.monotonic()
    cpu0 = cpu_s()
    sampler = None
    try:
        with open(log_path, "ab") as log:
            for topo, host in zip(assign(hosts), hosts):
                env = dict(env0)
                env.update(job_env.rank_env(topo, "127.0.0.1", server.port, server.secret,
                                            server.run_id, job_env.CONTROLLER_GLOO,
                                            args.budget_s))
                env[job_env.HOSTNAME_ENV_VAR] = host
                p = subprocess.Popen([sys.executable, RANK_SCRIPT, outdir, json.dumps(config)],
                                     env=env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, process_group=pgid)
                pgid = pgid or p.pid
                procs.append(p)
        job["launch_s"] = time.time() - t_start
        sampler = Sampler([p.pid for p in procs])
        deadline = time.monotonic() + args.budget_s
        job.update(wait_reports(outdir, procs, n, deadline, t_mono + args.init_budget_s,
                                sampler, bool(config.get("sync_init"))))
        job["thread_cpu_s"] = {k: round(v, 2) for k, v in thread_cpu(sampler.pids).items()
                               if v >= 0.01}
        if job["outcome"] == "ok" and config.get("liveness"):
            job["liveness"] = liveness(outdir, procs, n, config["liveness"], deadline,
                                       args.liveness_timeout_s)
        if job["outcome"] != "ok":
            job["store_progress"] = store_progress(server)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        server.stop()
        runner_logger.removeHandler(server_log)
    job["wall_s"] = time.time() - t_start
    job["server_cpu_s"] = cpu_s() - cpu0
    job["samples"] = sampler.samples if sampler else []
    job["t_start"] = t_start
    job["inits"] = files(outdir, "init")
    job["mains"] = files(outdir, "main")
    job["errors"] = files(outdir, "error")
    job["lost"] = files(outdir, "lost")
    job["server_warnings"] = server_log.counts
    job["server_warning_examples"] = server_log.first
    if job["outcome"] != "ok":
        job["log_tail"] = log_tail(log_path)
    if not args.keep_logs and job["outcome"] == "ok":
        shutil.rmtree(outdir, ignore_errors=True)
    return job


def cpu_s() -> float:
    """CPU time of this process: the rendezvous server's threads, and little else."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def store_progress(server) -> dict:
    """How far a job that did not finish got, as the rendezvous service saw it: ranks
    registered, and keys by pattern (rank numbers as #)."""
    keys = Counter(re.sub(r"\d+", "#", k.split("/", 1)[-1]) for k in server.store.keys())
    return {"registered": len(server.registered_ranks()), "keys": dict(keys.most_common(12))}


def store_probe(n: int, args: argparse.Namespace) -> dict:
    """n rendezvous clients connecting at once, then sending GETs for args.store_s: what
    the service refuses, and the requests per second and per CPU-second it serves."""
    from spark_hvd._job import env as job_env
    from spark_hvd.runner.rendezvous import RendezvousServer

    outdir = os.path.join(WORK, f"store-{n}")
    shutil.rmtree(outdir, ignore_errors=True)
    os.makedirs(outdir)
    server_log = ServerLog()
    runner_logger = logging.getLogger("spark_hvd.runner")
    runner_logger.addHandler(server_log)
    server = RendezvousServer(host="127.0.0.1", warning_interval_s=0.0)
    server.start()
    nproc = min(4, n)
    connect_at = time.time() + 2.0 + nproc * 0.3
    rate_at = connect_at + 5.0 + n / 100
    procs = []
    env = dict(base_env(args.tree), **job_env.rendezvous_env("127.0.0.1", server.port,
                                                              server.secret, server.run_id))
    try:
        for i in range(nproc):
            config = {"addr": "127.0.0.1", "port": server.port, "run_id": server.run_id,
                      "threads": n // nproc + (i < n % nproc),
                      "connect_at": connect_at, "rate_at": rate_at, "seconds": args.store_s,
                      "connect_timeout_s": 30.0, "process": i,
                      "out": os.path.join(outdir, f"probe{i}.json")}
            procs.append(subprocess.Popen([sys.executable, STORE_SCRIPT, json.dumps(config)],
                                          env=env, stdin=subprocess.DEVNULL,
                                          start_new_session=True))
        time.sleep(max(0.0, rate_at - time.time()))
        cpu0 = cpu_s()
        time.sleep(args.store_s)
        cpu = cpu_s() - cpu0
        for p in procs:
            try:
                p.wait(60 + n / 10)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        server.stop()
        runner_logger.removeHandler(server_log)
    reports = [r for r in (read_json(os.path.join(outdir, f"probe{i}.json"))
                           for i in range(nproc)) if r]
    shutil.rmtree(outdir, ignore_errors=True)
    connect = sorted(s for r in reports for s in r["connect_s"])
    requests = sum(r["requests"] for r in reports)
    errors: Counter = Counter()
    for r in reports:
        errors.update(r["errors"])
    return {"n": n, "processes": nproc, "reported": len(reports),
            "connected": sum(r["connected"] for r in reports),
            "failed": sum(r["failed"] for r in reports),
            "retries": sum(r["retries"] for r in reports), "errors": dict(errors),
            "server_warnings": server_log.counts,
            "connect_max_s": connect[-1] if connect else None,
            "connect_median_s": connect[len(connect) // 2] if connect else None,
            "requests_per_s": requests / args.store_s,
            "server_cpu_s_per_request": cpu / requests if requests else None}


def machine_cpu() -> List[int]:
    """/proc/stat's first line: jiffies of user, nice, system, idle, iowait, irq, softirq."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:8]]


TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu(pids: List[int]) -> Counter:
    """CPU seconds of the ranks' threads so far, by thread name and user/system
    (``shvd_heartbeat/system``...): which of them the machine's time goes to."""
    out: Counter = Counter()
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            out[f"{name}/user"] += int(fields[11]) / TICKS
            out[f"{name}/system"] += int(fields[12]) / TICKS
    return out


class Sampler:
    """Every SAMPLE_S while a job runs: how the machine's CPU is spent (user, system,
    idle), the load, the cores this process (the rendezvous server) and the ranks'
    threads by name used, the ranks through init. Shows where a slow init goes."""

    SAMPLE_S = 5.0

    def __init__(self, pids: List[int]) -> None:
        self.pids = pids
        self.samples: List[dict] = []
        self._last = (time.monotonic(), machine_cpu(), cpu_s(), thread_cpu(pids))
        self._t0 = self._last[0]

    def maybe(self, names: List[str]) -> None:
        now = time.monotonic()
        t, cpu, own, threads = self._last
        if now - t < self.SAMPLE_S:
            return
        cpu2, own2, threads2 = machine_cpu(), cpu_s(), thread_cpu(self.pids)
        d = [b - a for a, b in zip(cpu, cpu2)]
        total = max(1, sum(d))
        busy = {k: round((v - threads.get(k, 0)) / (now - t), 2) for k, v in threads2.items()}
        self.samples.append({
            "t": round(now - self._t0, 1), "load": os.getloadavg()[0],
            "user": round((d[0] + d[1]) / total, 3),
            "system": round((d[2] + d[5] + d[6]) / total, 3),
            "idle": round((d[3] + d[4]) / total, 3),
            "server_cores": round((own2 - own) / (now - t), 3),
            "rank_threads_cores": {k: v for k, v in sorted(busy.items(), key=lambda kv: -kv[1])
                                   if v >= 0.01},
            "init": sum(1 for x in names if x.startswith("init") and x.endswith(".json"))})
        self._last = (now, cpu2, own2, threads2)


def wait_reports(outdir: str, procs: List[subprocess.Popen], n: int, deadline: float,
                 init_deadline: float, sampler: Sampler, sync: bool = False) -> dict:
    """Waits until every rank wrote its main report, one failed, or a deadline passed
    (with ``sync``, --sync-init, first tells the ranks to call init() once all are ready)."""
    go = os.path.join(outdir, "go")
    while True:
        names = os.listdir(outdir)
        sampler.maybe(names)
        if sync and not os.path.exists(go) and sum(
                1 for x in names if x.startswith("ready") and x.endswith(".json")) == n:
            with open(go, "w"):
                pass  # --sync-init: every rank is ready to call init()
        mains = sum(1 for x in names if x.startswith("main") and x.endswith(".json"))
        errors = sum(1 for x in names if x.startswith("error") and x.endswith(".json"))
        if mains == n:
            return {"outcome": "ok"}
        if errors:
            return {"outcome": "error"}
        dead = [r for r, p in enumerate(procs) if p.poll() is not None]
        if dead:
            return {"outcome": "rank exited", "exited": {r: procs[r].returncode for r in dead[:20]}}
        inits = sum(1 for x in names if x.startswith("init") and x.endswith(".json"))
        if time.monotonic() > deadline or (inits < n and time.monotonic() > init_deadline):
            return {"outcome": "budget", "budget": "job" if inits == n else "init",
                    "reports_then": {"init": inits, "main": mains}}
        time.sleep(POLL_S)


def liveness(outdir: str, procs: List[subprocess.Popen], n: int, how: str, deadline: float,
             timeout_s: float) -> dict:
    """SIGKILLs (SIGSTOPs) the last rank while the others wait on it; waits for their
    reports of the loss."""
    time.sleep(0.5)  # the survivors submit their allreduce right after their report
    victim = procs[n - 1]
    sig = signal.SIGKILL if how == "kill" else signal.SIGSTOP
    at = time.time()
    os.kill(victim.pid, sig)
    end = min(deadline, time.monotonic() + timeout_s)
    while time.monotonic() < end:
        lost = sum(1 for x in os.listdir(outdir) if x.startswith("lost") and x.endswith(".json"))
        if lost >= n - 1:
            break
        time.sleep(POLL_S)
    return {"signal": how, "at": at, "waited_s": time.time() - at}
