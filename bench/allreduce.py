"""float32 allreduce: spark_hvd vs torch.distributed (gloo), side by side in the same run.

Launch (rank 0 prints the table)::

    python -m spark_hvd.runner -np 2 python bench/allreduce.py [--max-size 64MiB]

Every rank process initializes both spark_hvd and torch.distributed (gloo, TCP on
127.0.0.1, MASTER_PORT picked by rank 0 and shared through spark_hvd). For each size
the two libraries alternate: warmup, then ``--rounds`` rounds of [spark_hvd block,
torch block], each block N iterations (N scaled by size). A block's time is the
slowest rank's; the reported time per op is the median over rounds.

Columns follow nccl-tests: algbw = bytes / time, busbw = algbw * 2 (n - 1) / n.
Then "200 async allreduces of 4 KiB": spark_hvd enqueues all 200 and synchronizes;
torch runs 200 blocking all_reduce calls one by one, and (for fairness) 200 with
async_op=True then waits on them all.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import sys
import time

import numpy as np

import spark_hvd as hvd
from spark_hvd import _config

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
                "torch": statistics.median(theirs)}

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-size", type=parse_size, default=256 * MiB,
                   help="largest message, e.g. 64MiB (default 256MiB)")
    p.add_argument("--min-size", type=parse_size, default=0,
                   help="smallest message (default: all sizes)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per size")
    p.add_argument("--iters-scale", type=float, default=1.0,
                   help="multiplies the iterations per block")
    args = p.parse_args(argv)
    b = Bench(args)
    out = print if b.rank == 0 else (lambda *a, **k: None)
    n = b.size
    cpu = _config.cpu_operations() or _config.gloo_data_plane()
    backend = "mpi backend" if hvd.mpi_enabled() else f"{cpu or 'tcp'} backend"
    out(f"# float32 allreduce, {n} ranks: spark_hvd ({backend}"
        f") vs torch.distributed {b.torch.__version__} (gloo); median of {args.rounds} "
        "alternating rounds")
    out(f"# busbw = algbw * 2(n-1)/n; GB/s = 1e9 B/s")
    out(f"{'size':>10} {'iters':>6} | {'hvd us':>10} {'algbw':>7} {'busbw':>7} | "
        f"{'torch us':>10} {'algbw':>7} {'busbw':>7} | {'hvd/torch busbw':>15}")
    for nbytes in [s for s in SIZES if args.min_size <= s <= args.max_size]:
        row = b.size_row(nbytes)
        h, t = row["hvd"], row["torch"]
        out(f"{human(nbytes):>10} {row['iters']:>6} | {h * 1e6:>10.1f} "
            f"{nbytes / h / 1e9:>7.3f} {busbw(nbytes, h, n) / 1e9:>7.3f} | {t * 1e6:>10.1f} "
            f"{nbytes / t / 1e9:>7.3f} {busbw(nbytes, t, n) / 1e9:>7.3f} | {t / h:>14.2f}x")
        sys.stdout.flush()
    r = b.burst()
    out(f"\n# {BURST_N} allreduces of {human(BURST_BYTES)} (median of {max(5, args.rounds)})")
    out(f"spark_hvd, {BURST_N} async then synchronize: {r['hvd'] * 1e3:9.2f} ms")
    out(f"torch gloo, one by one (blocking):     {r['torch'] * 1e3:9.2f} ms   "
        f"speedup {r['torch'] / r['hvd']:.1f}x")
    out(f"torch gloo, async_op=True then wait:   {r['torch_async'] * 1e3:9.2f} ms   "
        f"speedup {r['torch_async'] / r['hvd']:.1f}x")
    b.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
