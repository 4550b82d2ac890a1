"""How the cost of a job grows with its rank count: N real rank processes on this machine.

Run (``make bench-scale`` runs the defaults and rewrites docs/scaling.md's measured part)::

    python bench/scale.py [--np 2,8,16,32,64,128,256,512] [--backend shm,tcp]
                          [--ranks-per-host 8] [--budget-s 600] [--init-budget-s 300]
                          [--tree CHECKOUT] [--merge] [--no-write] [--report-only]
                          [--sync-init] [--baseline RESULTS_JSON]

For each mode and each N, one job of N ranks (bench/_scale_rank.py) is started directly, as
a launcher would start it (bench/_scale_job.py): a RendezvousServer in this process, the
launch contract from ``spark_hvd._job.env.rank_env`` and ``topology.assign`` over simulated
hosts of ``--ranks-per-host`` ranks, each rank's SPARK_HVD_HOSTNAME its host's name (the shm
backend groups ranks by it: csrc/backends/shm/communicator.cc's ShmHostKey). Modes: ``shm``
is the default configuration (SPARK_HVD_CPU_OPERATIONS unset: shared memory within a host,
tcp for what spans hosts), ``tcp`` sets SPARK_HVD_CPU_OPERATIONS=tcp (tcp between all
ranks). The code measured is the code users run; only the hosts are simulated, so the
times are those of N processes on this machine's cores, and the counts are exact.

Each rank reports init, rendezvous requests, connection counts, resources, the steady
control plane and the data plane over cached allreduces of 4 B, 1 MiB and 64 MiB (64 MiB up
to ``--large-max-np`` and where memory allows), and heartbeats over an idle interval. Then
this process SIGKILLs the last rank while every other rank waits in an allreduce it never
joins, and times until each survivor's exception arrives and whether it names the killed
rank; a second job (N up to ``--stop-max-np``) does the same with SIGSTOP. While a job
runs, the machine's CPU (user, system), the rendezvous server's and the ranks' threads' by
name are sampled. A job whose ranks are not all through init after ``--init-budget-s``, or
that outlives ``--budget-s``, is killed (what it reported by then is kept) and larger N
in that mode are skipped. Every rank runs in the job's process group, killed whatever
happens (Ctrl-C and SIGTERM included). Before the jobs, a probe without ranks
(``--store-np``) has N rendezvous clients connect at once, then send GETs for a while.

``--sim-np 1024,4096`` adds rows for rank counts past what this machine runs as processes:
the ranks' engines on threads of one process (bench/_scale_sim.py, csrc/python/simulate.h;
an in-memory store in place of the rendezvous service), marked "tcp, simulated (one
process)"; ``--np '' --store-np 0 --sim-np 1024 --merge`` runs only those.

``--tree`` measures another checkout's build (its spark_hvd and _core; e.g. a commit
exported with ``git archive`` and built with ``setup.py build_ext --inplace``), so the numbers
of a commit can be taken while this checkout's core changes.

Each job is summarized (bench/_scale_summary.py) into build/scale/results.json, per mode
and N (``--merge`` keeps the entries of earlier runs that this one does not redo); the
tables are printed and, unless ``--no-write``, written into docs/scaling.md between its
markers, with the plot docs/scaling.png (bench/_scale_report.py). Benchmarks never assert:
a failure is a row of the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import signal
import subprocess
import sys
from typing import Dict, List, Optional

import _scale_report as report
import _scale_sim as sim
import _scale_summary as summary
from _scale_job import ROOT, WORK, read_json, run_job, store_probe

RESULTS = os.path.join(WORK, "results.json")
MiB = 1 << 20
# What a rank holds beyond its arrays, for the memory check: 19 MiB private measured at
# 2 to 128 ranks (Python, numpy, the core), and the kernel's memory for its sockets.
RANK_BASE_BYTES = 24 * MiB


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", default="2,8,16,32,64,128,256,512",
                   help="rank counts, comma-separated (default %(default)s)")
    p.add_argument("--backend", default="shm,tcp",
                   help="modes: shm (the default configuration), tcp (default %(default)s)")
    p.add_argument("--ranks-per-host", type=int, default=8)
    p.add_argument("--budget-s", type=float, default=600.0,
                   help="wall time per job before it is killed (default %(default)s)")
    p.add_argument("--init-budget-s", type=float, default=300.0,
                   help="a job whose ranks are not all through init by then is killed "
                   "(default %(default)s)")
    p.add_argument("--steady-s", type=float, default=10.0,
                   help="time budget of the cached 4-byte loop (default %(default)s)")
    p.add_argument("--data-s", type=float, default=10.0,
                   help="time budget of each data-plane size (default %(default)s)")
    p.add_argument("--min-reps", type=int, default=5)
    p.add_argument("--max-reps", type=int, default=100)
    p.add_argument("--large-max-np", type=int, default=64,
                   help="64 MiB allreduces only up to this N (default %(default)s)")
    p.add_argument("--idle-s", type=float, default=3.0,
                   help="idle interval over which heartbeats are counted (default %(default)s)")
    p.add_argument("--kill-max-np", type=int, default=1 << 30,
                   help="SIGKILL test up to this N (default: every N)")
    p.add_argument("--stop-max-np", type=int, default=128,
                   help="SIGSTOP test (a job of its own) up to this N (default %(default)s)")
    p.add_argument("--liveness-timeout-s", type=float, default=60.0,
                   help="how long survivors get to report a lost rank (default %(default)s)")
    p.add_argument("--store-np", default=None,
                   help="client counts of the rendezvous probe (N clients connecting at once, "
                   "then sending GETs): default the --np list and 1024; 0: no probe")
    p.add_argument("--store-s", type=float, default=3.0,
                   help="how long the probe's clients send GETs (default %(default)s)")
    p.add_argument("--sync-init", action="store_true",
                   help="ranks call init() together, once every one has started (by default "
                   "each calls it as soon as its interpreter is up)")
    sim.add_arguments(p)
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra SPARK_HVD_* setting for every rank (repeatable)")
    p.add_argument("--merge", action="store_true",
                   help="keep earlier results for the (mode, N) this run does not redo")
    p.add_argument("--no-write", action="store_true",
                   help="print only; leave docs/scaling.md and its plot alone")
    p.add_argument("--tree", default=ROOT,
                   help="the spark_hvd checkout (with its built _core) to measure: this one by "
                   "default; another one measures another commit's build")
    p.add_argument("--build-label", default=None,
                   help="what --tree holds, for the docs (default: its git commit)")
    p.add_argument("--baseline", default=None, metavar="RESULTS_JSON",
                   help="another build's results.json (e.g. a copy of build/scale/results.json "
                   "from before a change), drawn dashed in the plot")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: print (and write) the tables from build/scale/results.json")
    p.add_argument("--keep-logs", action="store_true",
                   help="keep build/scale/<job>/ (rank outputs and reports)")
    args = p.parse_args(argv)
    args.nps = sorted({int(x) for x in args.np.split(",") if x.strip()})
    args.sim_nps = sim.sim_sizes(args)
    store = args.store_np if args.store_np is not None else f"{args.np},1024"
    args.store_nps = sorted({int(x) for x in store.split(",") if x.strip() and int(x) > 0})
    args.modes = [m.strip() for m in args.backend.split(",") if m.strip()]
    for m in args.modes:
        if m not in ("shm", "tcp"):
            p.error(f"--backend: unknown mode {m!r} (shm, tcp)")
    if any(n < 2 for n in args.nps):
        p.error("--np: every N must be at least 2 (a rank is killed)")
    return args


def raise_fd_limit(nps: List[int]) -> Dict[str, int]:
    """Raises this process's soft RLIMIT_NOFILE towards what the largest job needs (the
    ranks inherit it): each rank holds about 2(N-1) sockets today, and this process
    about 3 rendezvous connections per rank."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 4 * max(nps) + 256
    if soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(hard, need)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    return {"soft": soft, "hard": hard, "needed": need}


def describe_machine(limits: Dict[str, int]) -> str:
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    return (f"{os.cpu_count()} cores, {mem / 2**30:.0f} GiB, Linux {platform.release()}, "
            f"Python {platform.python_version()}, ulimit -n {limits['soft']} (hard "
            f"{limits['hard']})")


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def build_label(tree: str) -> str:
    """The tree's commit, and whether its core or package differ from it."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", "-C", tree, *argv], capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "csrc", "spark_hvd")
    except (OSError, subprocess.CalledProcessError):
        return f"the tree {tree} (no git)"
    return f"commit {commit}" + (" with uncommitted changes in csrc/ or spark_hvd/" if dirty
                                 else "")


def core_file(tree: str) -> Optional[str]:
    """The built extension the ranks load, to notice a rebuild during the run."""
    pkg = os.path.join(tree, "spark_hvd")
    names = [x for x in os.listdir(pkg) if x.startswith("_core") and x.endswith(".so")]
    return os.path.join(pkg, names[0]) if names else None


def configs(n: int, args: argparse.Namespace) -> List[dict]:
    """The jobs for n ranks: the main one (with the SIGKILL test), and the SIGSTOP one."""
    data = [MiB // 4]
    large_bytes = n * (3 * 64 * MiB + RANK_BASE_BYTES)
    large_note = ""
    if n > args.large_max_np:
        large_note = f"skipped: N > {args.large_max_np} (--large-max-np)"
    elif large_bytes > 0.7 * mem_available():
        large_note = (f"skipped: {large_bytes / 2**30:.1f} GiB needed, "
                      f"{mem_available() / 2**30:.1f} GiB available")
    else:
        data.append(16 * MiB)
    main = {"label": "main", "steady": True, "steady_s": args.steady_s, "data_s": args.data_s,
            "warmup": 3, "min_reps": args.min_reps, "min_reps_large": 2,
            "max_reps": args.max_reps, "data_elements": data, "idle_s": args.idle_s,
            "liveness": "kill" if n <= args.kill_max_np else None, "large_note": large_note,
            "sync_init": args.sync_init}
    jobs = [main]
    if n <= args.stop_max_np:
        jobs.append({"label": "stop", "liveness": "stop", "sync_init": args.sync_init})
    return jobs


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    args.tree = os.path.abspath(args.tree)
    sys.path.insert(0, args.tree)  # the bench's own spark_hvd: the rendezvous server
    os.makedirs(WORK, exist_ok=True)
    if args.report_only:
        results = read_json(RESULTS)
        if results is None:
            raise SystemExit(f"no results in {RESULTS}: run without --report-only first")
        return finish(results, args)
    limits = raise_fd_limit(args.nps or [2])  # (--np "": simulated rows only)
    results = read_json(RESULTS) if args.merge else None
    results = results or {"runs": {}}
    machine = describe_machine(limits)
    command = command_line(argv if argv is not None else sys.argv[1:], args.tree)
    build = args.build_label or build_label(args.tree)
    core = core_file(args.tree)
    settings = args.env + (["--sync-init"] if args.sync_init else [])  # the runs' "extra"
    core_mtime = os.path.getmtime(core) if core else None
    print(f"== bench/scale.py: N {args.nps}, modes {args.modes}, {args.ranks_per_host} ranks "
          f"per simulated host; {machine}, load {os.getloadavg()[0]:.1f}", flush=True)
    # So that a job's finally kills its ranks: SIGTERM, and SIGINT even where the shell
    # started this process with it ignored (a background job).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for n in args.store_nps:
        print(f"-- rendezvous probe, {n} clients", flush=True)
        results.setdefault("store", {})[str(n)] = dict(
            store_probe(n, args), date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            machine=machine)
        save(results)
    for mode in args.modes:
        # The smallest N whose job did not finish (in this run, or a merged earlier one of
        # the same build that this run does not redo): larger ones are not run.
        failed = [e["n"] for e in results["runs"].values()
                  if e["mode"] == mode and e.get("build") == build and e["n"] not in args.nps
                  and any(j["outcome"] != "ok" for j in e["jobs"].values())]
        stopped = min(failed) if failed else None
        for n in args.nps:
            why = None
            if stopped is not None and n > stopped:
                why = f"not run: N={stopped} did not finish"
            elif n * RANK_BASE_BYTES > 0.8 * mem_available():
                why = (f"not run: {n * RANK_BASE_BYTES / 2**30:.1f} GiB needed, "
                       f"{mem_available() / 2**30:.1f} GiB available")
            if why:
                print(f"-- {mode} N={n}: {why}", flush=True)
                results["runs"][f"{mode}/{n}"] = {
                    "n": n, "mode": mode, "skipped": why,
                    "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
                    "machine": machine, "command": command, "build": build, "env": settings,
                    "ranks_per_host": args.ranks_per_host, "jobs": {}}
                save(results)
                continue
            entry = {"n": n, "mode": mode, "ranks_per_host": args.ranks_per_host,
                     "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
                     "machine": machine, "load_at_start": os.getloadavg()[0],
                     "command": command, "build": build, "env": settings, "jobs": {}}
            for config in configs(n, args):
                label = config["label"]
                print(f"-- {mode} N={n} {label}: starting", flush=True)
                job = run_job(n, mode, args, config, label)
                entry["jobs"][label] = summary.summarize(job)
                print(f"-- {mode} N={n} {label}: {job['outcome']} in {job['wall_s']:.1f} s",
                      flush=True)
                if job["outcome"] != "ok":
                    print(summary.failure_text(job), flush=True)
                    stopped = n if stopped is None else min(stopped, n)
                    break
            if core and os.path.getmtime(core) != core_mtime:
                entry["core_rebuilt"] = True
                print(f"!! {core} was rebuilt during this run: these numbers mix builds",
                      flush=True)
                core_mtime = os.path.getmtime(core)
            results["runs"][f"{mode}/{n}"] = entry
            save(results)
    for n in args.sim_nps:  # bench/_scale_sim.py: N ranks' engines in one process
        results["runs"][f"sim/{n}"] = sim.entry(
            n, args, {"machine": machine, "command": command, "build": build, "env": args.env},
            mem_available())
        save(results)
    return finish(results, args)


def command_line(argv: List[str], tree: str) -> str:
    """What made these numbers, for the docs: the options, another checkout's path as TREE,
    the build label left out (the docs give the build apart)."""
    out, skip = ["bench/scale.py"], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--build-label":
            skip = True
        elif not a.startswith("--build-label="):
            out.append("TREE" if os.path.abspath(a) == tree and tree != ROOT else a)
    return shlex.join(out)


def save(results: dict) -> None:
    with open(RESULTS + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(RESULTS + ".tmp", RESULTS)


def finish(results: dict, args: argparse.Namespace) -> int:
    text = report.tables(results)
    print(text)
    if not args.no_write:
        baseline = read_json(args.baseline) if args.baseline else None
        if args.baseline and baseline is None:
            raise SystemExit(f"--baseline: cannot read {args.baseline}")
        report.write_docs(results, text, baseline)
        print(f"wrote {report.DOC} and {report.PLOT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
