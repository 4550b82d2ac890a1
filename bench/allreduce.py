"""float32 allreduce: spark_hvd on shm, tcp and Open MPI vs torch.distributed (gloo).

Run (the driver launches one job per backend and prints one table)::

    python bench/allreduce.py [--np 2] [--backends shm,tcp,mpi] [--max-size 64MiB] [--repeat N]

Each job (``spark-hvdrun -np N python bench/allreduce.py --worker``; ``--mpi`` for the
``mpi`` backend, i.e. Open MPI's own shared-memory transport under ``mpirun``, where
openmpi-bin is installed) initializes both spark_hvd and torch.distributed (gloo, TCP
on 127.0.0.1, MASTER_PORT picked by rank 0 and shared through spark_hvd). For each size
the two libraries alternate: warmup, then ``--rounds`` rounds of [spark_hvd block,
torch block], each block N iterations (N scaled by size). A block's time is the slowest
rank's; reported per size are the min and the median over rounds. Every job measures
torch gloo again; the ratios use the torch gloo of the same job (the same minutes of
load), and the backends' ratios to each other their medians. ``--repeat N`` runs the
jobs N times in turn and reports, per size, the best and the median over jobs, and each
backend pair's ratio per round of jobs (printed, and their median): this VM has slow
phases that last seconds to minutes and hit every backend, so one job per backend can
compare a good phase with a bad one.

Columns follow nccl-tests: algbw = bytes / time, busbw = algbw * 2 (n - 1) / n.
Then "200 async allreduces of 4 KiB": spark_hvd enqueues all 200 and synchronizes;
torch runs 200 blocking all_reduce calls one by one, and (for fairness) 200 with
async_op=True then waits on them all.

``--hosts HxL`` (e.g. ``4x4``) runs on a cluster in a box instead (tests/cluster/box.py,
root only): H hosts as network namespaces, each link capped at ``--rate`` (default
1gbit), L ranks per host started over ssh. Two jobs in turn, ``--repeat`` times: flat
(SPARK_HVD_HIERARCHICAL_ALLREDUCE/_ALLGATHER=0: allreduce as a tcp ring over all ranks in
host order, allgather flat on tcp) and hierarchical (=1: shm within each host, tcp
across). Each times allreduce and allgather (numpy, the slowest rank per block) from
``--min-size`` (default 1 MiB) to ``--max-size``; an allgather's size is what each rank
ends with (every rank gives size/n), as in nccl-tests. Reported per size: busbw best /
median over rounds and jobs, hierarchical over flat, and the tcp bytes one rank sends
per op (``_core.traffic()``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

import spark_hvd as hvd
from spark_hvd import _config

MARK = "@@ALLREDUCE "
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KiB, MiB = 1024, 1024 * 1024
SIZES = [4, 64, KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB,
         256 * MiB]
BURST_N, BURST_BYTES = 200, 4 * KiB


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 64K, 64MiB)")
    return int(m.group(1)) * {"": 1, "k": KiB, "m": MiB, "g": 1024 * MiB}[m.group(2).lower()]


def human(n: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def iterations(nbytes: int, scale: float) -> int:
    """About 32 MiB of traffic per block, 3..500 iterations."""
    return max(3, min(500, int(scale * 32 * MiB / max(nbytes, 16 * KiB))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Bench:
    def __init__(self, args) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()
        port = hvd.broadcast_object(free_port() if self.rank == 0 else None, root_rank=0,
                                    name="bench.port")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=self.rank, world_size=self.size)
        self.args = args

    def slowest(self, seconds: float) -> float:
        """The slowest rank's time for a block."""
        return float(hvd.allreduce(np.array([seconds]), op=hvd.Max, name="bench.time")[0])

    def time_hvd(self, x, iters: int, name: str) -> float:
        # In place on a torch tensor, as torch.distributed's all_reduce is: the
        # numpy API returns a fresh array per call, which would time an allocation.
        import spark_hvd.torch as hvd_torch

        hvd.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            hvd_torch.allreduce_(x, op=hvd.Sum, name=name)
        return self.slowest(time.perf_counter() - t0) / iters

    def time_torch(self, t, iters: int) -> float:
        self.dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            self.dist.all_reduce(t)
        return self.slowest(time.perf_counter() - t0) / iters

    def check(self, nbytes: int) -> None:
        n = nbytes // 4
        got = hvd.allreduce(np.full(n, self.rank + 1.0, np.float32), op=hvd.Sum,
                            name=f"bench.check.{nbytes}")
        want = self.size * (self.size + 1) / 2
        assert np.all(got == want), f"spark_hvd allreduce of {human(nbytes)} is wrong"
        t = self.torch.full((n,), self.rank + 1.0, dtype=self.torch.float32)
        self.dist.all_reduce(t)
        assert bool((t == want).all()), f"torch all_reduce of {human(nbytes)} is wrong"

    def size_row(self, nbytes: int) -> dict:
        n = nbytes // 4
        iters = iterations(nbytes, self.args.iters_scale)
        x = self.torch.ones(n, dtype=self.torch.float32)
        t = self.torch.ones(n, dtype=self.torch.float32)
        name = f"bench.ar.{nbytes}"
        self.check(nbytes)
        warm = max(2, iters // 10)
        self.time_hvd(x, warm, name)
        self.time_torch(t, warm)
        ours, theirs = [], []
        for _ in range(self.args.rounds):
            ours.append(self.time_hvd(x, iters, name))
            theirs.append(self.time_torch(t, iters))
        return {"bytes": nbytes, "iters": iters, "hvd": statistics.median(ours),
                "torch": statistics.median(theirs), "hvd_min": min(ours),
                "torch_min": min(theirs)}

    def burst(self) -> dict:
        n = BURST_BYTES // 4
        xs = [np.full(n, float(i), np.float32) for i in range(BURST_N)]
        ts = [self.torch.full((n,), float(i)) for i in range(BURST_N)]

        def ours() -> float:
            hvd.barrier()
            t0 = time.perf_counter()
            hs = [hvd.allreduce_async(x, op=hvd.Sum, name=f"bench.burst.{i}")
                  for i, x in enumerate(xs)]
            outs = [hvd.synchronize(h) for h in hs]
            dt = time.perf_counter() - t0
            assert outs[-1][0] == (BURST_N - 1) * self.size
            return self.slowest(dt)

        def blocking() -> float:
            self.dist.barrier()
            t0 = time.perf_counter()
            for t in ts:
                self.dist.all_reduce(t)
            return self.slowest(time.perf_counter() - t0)

        def asynchronous() -> float:
            self.dist.barrier()
            t0 = time.perf_counter()
            works = [self.dist.all_reduce(t, async_op=True) for t in ts]
            for w in works:
                w.wait()
            return self.slowest(time.perf_counter() - t0)

        for fn in (ours, blocking, asynchronous):  # warmup
            fn()
        runs = {"hvd": [], "torch": [], "torch_async": []}
        for _ in range(max(5, self.args.rounds)):
            runs["hvd"].append(ours())
            runs["torch"].append(blocking())
            runs["torch_async"].append(asynchronous())
        return {k: statistics.median(v) for k, v in runs.items()}

    def close(self) -> None:
        self.dist.destroy_process_group()
        hvd.shutdown()


def busbw(nbytes: int, seconds: float, n: int) -> float:
    return nbytes / seconds * (2 * (n - 1) / n if n > 1 else 1.0)


def worker(args) -> None:
    """One job: prints its table (rank 0) and each row as a MARK line for the driver."""
    b = Bench(args)
    out = print if b.rank == 0 else (lambda *a, **k: None)
    n = b.size
    cpu = _config.cpu_operations() or _config.gloo_data_plane()
    backend = "mpi" if hvd.mpi_enabled() else (cpu or "shm")
    out(f"# float32 allreduce, {n} ranks: spark_hvd ({backend} backend) vs torch.distributed "
        f"{b.torch.__version__} (gloo); median of {args.rounds} alternating rounds")
    out(f"{'size':>10} {'iters':>6} | {'hvd us':>10} {'busbw':>7} | {'torch us':>10} "
        f"{'busbw':>7} | {'hvd/torch busbw':>15}")
    for nbytes in [s for s in SIZES if args.min_size <= s <= args.max_size]:
        row = b.size_row(nbytes)
        h, t = row["hvd"], row["torch"]
        out(f"{human(nbytes):>10} {row['iters']:>6} | {h * 1e6:>10.1f} "
            f"{busbw(nbytes, h, n) / 1e9:>7.3f} | {t * 1e6:>10.1f} "
            f"{busbw(nbytes, t, n) / 1e9:>7.3f} | {t / h:>14.2f}x", flush=True)
        out(MARK + json.dumps(dict(row, backend=backend, ranks=n)), flush=True)
    r = b.burst()
    out(f"# {BURST_N} allreduces of {human(BURST_BYTES)}: spark_hvd async {r['hvd'] * 1e3:.2f} ms, "
        f"torch one by one {r['torch'] * 1e3:.2f} ms, torch async {r['torch_async'] * 1e3:.2f} ms")
    out(MARK + json.dumps({"burst": r, "backend": backend, "ranks": n}), flush=True)
    b.close()


def parse_hosts(text: str) -> tuple:
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", text)
    if not m or int(m.group(1)) < 2 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"--hosts {text!r}: HOSTSxRANKS, e.g. 4x4")
    return int(m.group(1)), int(m.group(2))


def _tcp_bytes() -> int:
    from spark_hvd import _core

    return _core.traffic()["tcp"]["data"]["bytes"]


def hosts_worker(args) -> None:
    """One job on the box: a MARK line per (op, size) from rank 0."""
    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    mode = "hierarchical" if os.environ.get("SPARK_HVD_HIERARCHICAL_ALLREDUCE") == "1" else "flat"
    for nbytes in [s for s in SIZES if args.min_size <= s <= args.max_size]:
        x = np.full(nbytes // 4, rank + 1.0, np.float32)
        piece = np.full(nbytes // 4 // n, rank + 1.0, np.float32)
        ops = {"allreduce": lambda: hvd.allreduce(x, op=hvd.Sum, name=f"h.ar.{nbytes}"),
               "allgather": lambda: hvd.allgather(piece, name=f"h.ag.{nbytes}")}
        got = ops["allreduce"]()
        assert np.all(got == n * (n + 1) / 2), f"allreduce of {human(nbytes)} is wrong"
        got = ops["allgather"]()
        assert np.all(got == np.repeat(np.arange(1.0, n + 1), len(piece))), "allgather wrong"
        iters = iterations(nbytes, args.iters_scale)
        for op, call in ops.items():
            times, sent = [], 0
            for _ in range(1 + args.rounds):  # the first round warms up
                hvd.barrier()
                before, t0 = _tcp_bytes(), time.perf_counter()
                for _ in range(iters):
                    call()
                dt = float(hvd.allreduce(np.array([time.perf_counter() - t0]), op=hvd.Max,
                                         name="h.time")[0]) / iters
                times.append(dt)
                sent = (_tcp_bytes() - before) // iters
            if rank == 0:
                print(MARK + json.dumps({"mode": mode, "op": op, "bytes": nbytes, "iters": iters,
                                         "times": times[1:], "tcp_bytes": sent}), flush=True)
    hvd.shutdown()


def hosts_driver(args) -> None:
    """The flat and hierarchical jobs on a box of --hosts, in turn; one table."""
    n_hosts, per_host = args.hosts
    sys.path.insert(0, os.path.join(ROOT, "tests", "cluster"))
    import box as box_mod

    print(f"# allreduce and allgather (float32), {n_hosts} hosts x {per_host} ranks in a box "
          f"(network namespaces, links capped at {args.rate}), {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}; flat and hierarchical jobs in turn, {args.repeat} each; "
          f"{args.rounds} rounds per size and job", flush=True)
    b = box_mod.up(hosts=n_hosts, rate=args.rate, spark=False)
    rows: dict = {}
    try:
        spec = ",".join(f"{h}:{per_host}" for h in b.names)
        for _ in range(args.repeat):
            for mode in ("flat", "hierarchical"):
                flag = "1" if mode == "hierarchical" else "0"
                env = b.env(dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
                    p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
                    SPARK_HVD_HIERARCHICAL_ALLREDUCE=flag, SPARK_HVD_HIERARCHICAL_ALLGATHER=flag))
                cmd = [sys.executable, "-m", "spark_hvd.runner", "--network-interface",
                       b.driver_addr, "-np", str(n_hosts * per_host), "-H", spec,
                       sys.executable, os.path.abspath(__file__), "--worker",
                       "--hosts", f"{n_hosts}x{per_host}", "--min-size", str(args.min_size),
                       "--max-size", str(args.max_size), "--rounds", str(args.rounds),
                       "--iters-scale", str(args.iters_scale)]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=7200)
                if proc.returncode != 0:
                    raise SystemExit(f"the {mode} job failed (exit {proc.returncode}):\n"
                                     f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
                for line in proc.stdout.splitlines():
                    _, sep, payload = line.partition(MARK)
                    if sep:
                        r = json.loads(payload)
                        row = rows.setdefault((r["op"], r["bytes"], r["mode"]), {"times": []})
                        row["times"] += r["times"]
                        row["tcp_bytes"] = r["tcp_bytes"]
    finally:
        box_mod.down()
    n = n_hosts * per_host
    factor = {"allreduce": 2 * (n - 1) / n, "allgather": (n - 1) / n}
    med = statistics.median
    print(f"# busbw GB/s (best / median over {args.rounds} x {args.repeat} rounds; allreduce "
          f"algbw * 2(n-1)/n, allgather algbw * (n-1)/n); hier/flat: ratio of median busbw; "
          f"tcp MiB: sent by one rank per op")
    print(f"{'op':>9} {'size':>8} | {'flat best / med':>17} {'tcp MiB':>8} | "
          f"{'hier best / med':>17} {'tcp MiB':>8} | {'hier/flat':>9}")
    for op in ("allreduce", "allgather"):
        for nbytes in sorted({k[1] for k in rows if k[0] == op}):
            cells, bw = [], {}
            for mode in ("flat", "hierarchical"):
                r = rows[(op, nbytes, mode)]
                bw[mode] = nbytes / med(r["times"]) * factor[op] / 1e9
                best = nbytes / min(r["times"]) * factor[op] / 1e9
                cells.append(f"{best:>8.3f} / {bw[mode]:>6.3f} {r['tcp_bytes'] / MiB:>8.1f}")
            print(f"{op:>9} {human(nbytes):>8} | {cells[0]} | {cells[1]} | "
                  f"{bw['hierarchical'] / bw['flat']:>8.2f}x", flush=True)


def launch(backend: str, args) -> tuple:
    """One job on `backend`: its size rows and its burst."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), OMP_NUM_THREADS="1")
    flags = ["--mpi"] if backend == "mpi" else []
    if backend != "mpi":
        env[_config.CPU_OPERATIONS_ENV_VAR] = backend
    cmd = [sys.executable, "-m", "spark_hvd.runner", *flags, "-np", str(args.np),
           sys.executable, os.path.abspath(__file__), "--worker",
           "--max-size", str(args.max_size), "--min-size", str(args.min_size),
           "--rounds", str(args.rounds), "--iters-scale", str(args.iters_scale)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    rows, burst = {}, None
    for line in proc.stdout.splitlines():
        _, sep, payload = line.partition(MARK)
        if sep:
            rec = json.loads(payload)
            if "burst" in rec:
                burst = rec["burst"]
            else:
                rows[rec["bytes"]] = rec
    if proc.returncode != 0 or burst is None:
        raise SystemExit(f"the {backend} job failed (exit {proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return rows, burst


def driver(args) -> None:
    backends = [b for b in args.backends.split(",") if b]
    if "mpi" in backends and (shutil.which("mpirun") is None or not hvd.mpi_built()):
        print("# mpi left out: no mpirun on PATH or spark_hvd built without MPI")
        backends.remove("mpi")
    print(f"# float32 allreduce, {args.np} ranks on {os.cpu_count()} cores (load average "
          f"{os.getloadavg()[0]:.1f}{', oversubscribed' if args.np > os.cpu_count() else ''})"
          f"; one job per backend: {', '.join(backends)}; each vs torch gloo in the same job; "
          f"min / median of {args.rounds} rounds"
          + (f"; {args.repeat} rounds of jobs, in turn" if args.repeat > 1 else ""))
    print("# busbw = algbw * 2(n-1)/n in GB/s; ratios of medians: busbw over torch gloo's in "
          "the same job, and over the other backends'")
    # --repeat N: the jobs run N times in turn (b1, b2, ..., b1, b2, ...), so that every
    # backend meets the machine's slow phases alike; a ratio between backends is taken per
    # round of jobs (a pair run minutes apart would compare two phases), then summarized.
    jobs = {b: [] for b in backends}
    for _ in range(args.repeat):
        for b in backends:
            jobs[b].append(launch(b, args))
    med = statistics.median
    head = " | ".join(f"{b + ' busbw min/med':>20}" for b in backends)
    ratios = " ".join(f"{b + '/torch':>10}" for b in backends)
    first = backends[0]
    others = " ".join(f"{first + '/' + b:>9}" for b in backends[1:])
    print(f"{'size':>8} | {head} | {'torch gloo':>20} | {ratios} {others}")
    for nbytes in sorted(jobs[first][0][0]):
        cells, vs_torch, bw = [], [], {}
        for b in backends:
            rows = [rows[nbytes] for rows, _ in jobs[b]]
            bw[b] = [busbw(nbytes, row["hvd"], args.np) for row in rows]
            best = max(busbw(nbytes, row["hvd_min"], args.np) for row in rows)
            cells.append(f"{best / 1e9:>9.3f} / {med(bw[b]) / 1e9:>8.3f}")
            vs_torch.append(f"{med(row['torch'] / row['hvd'] for row in rows):>9.2f}x")
        t = [rows[nbytes] for rows, _ in jobs[first]]
        tcell = (f"{max(busbw(nbytes, r['torch_min'], args.np) for r in t) / 1e9:>9.3f} / "
                 f"{med(busbw(nbytes, r['torch'], args.np) for r in t) / 1e9:>8.3f}")
        vs = " ".join(f"{med(x / y for x, y in zip(bw[first], bw[b])):>8.2f}x"
                      for b in backends[1:])
        print(f"{human(nbytes):>8} | {' | '.join(cells)} | {tcell} | {' '.join(vs_torch)} {vs}")
        if args.repeat > 1:
            for b in backends[1:]:
                each = " ".join(f"{x / y:.2f}" for x, y in zip(bw[first], bw[b]))
                print(f"{'':>8}   {first}/{b} in each round of jobs: {each}")
    if 4 in jobs[first][0][0]:
        print("# latency of one 4 B allreduce through the API (median over jobs): " + ", ".join(
            f"{b} {med(rows[4]['hvd'] for rows, _ in jobs[b]) * 1e6:.0f} us"
            for b in backends) + f"; torch gloo "
            f"{med(rows[4]['torch'] for rows, _ in jobs[first]) * 1e6:.0f} us")
    for b in backends:
        r = {k: med(burst[k] for _, burst in jobs[b]) for k in ("hvd", "torch", "torch_async")}
        print(f"# {BURST_N} x {human(BURST_BYTES)} async on {b}: {r['hvd'] * 1e3:.2f} ms; torch "
              f"gloo one by one {r['torch'] * 1e3:.2f} ms ({r['torch'] / r['hvd']:.1f}x), async "
              f"{r['torch_async'] * 1e3:.2f} ms ({r['torch_async'] / r['hvd']:.1f}x)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=2, help="ranks per job (default 2)")
    p.add_argument("--backends", default="shm,tcp,mpi",
                   help="spark_hvd CPU backends, one job each (default shm,tcp,mpi)")
    p.add_argument("--max-size", type=parse_size, default=256 * MiB,
                   help="largest message, e.g. 64MiB (default 256MiB)")
    p.add_argument("--min-size", type=parse_size, default=0,
                   help="smallest message (default: all sizes)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per size")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the backends' jobs this many times in turn; the table gives the "
                        "best and the median over jobs, ratios between backends per round of jobs")
    p.add_argument("--iters-scale", type=float, default=1.0,
                   help="multiplies the iterations per block")
    p.add_argument("--hosts", type=parse_hosts, default=None, metavar="HxL",
                   help="on a cluster in a box (root): H hosts of L ranks, flat vs "
                        "hierarchical allreduce and allgather (see above)")
    p.add_argument("--rate", default="1gbit",
                   help="with --hosts: each host's link cap in tc units (default 1gbit)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.hosts and not args.min_size:
        args.min_size = MiB
    if args.worker:
        (hosts_worker if args.hosts else worker)(args)
    elif args.hosts:
        hosts_driver(args)
    else:
        driver(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
