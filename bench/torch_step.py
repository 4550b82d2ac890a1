"""Training-step time: spark_hvd DistributedOptimizer vs torch DDP (gloo), same run.

    python bench/torch_step.py [--layers 25 --width 256 --batch 64]
    python bench/torch_step.py --autotune [--repeats 3]

The driver launches the worker twice through spark-hvdrun: with 2 ranks and with
1 rank (for scaling efficiency). Every worker rank builds the same MLP (``--layers``
Linear(width, width) layers: 2 x layers parameter tensors), the same per-rank
batch, one torch thread, SGD with momentum, and times full steps (zero_grad,
forward, MSE loss, backward, step) of both variants:

* ``spark_hvd``: ``hvd.DistributedOptimizer`` (per-parameter allreduces started
  by post-accumulate-grad hooks during backward, fused by the core);
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over a gloo process group
  (``init_process_group("gloo")`` on 127.0.0.1, port picked by rank 0 and shared
  through spark_hvd), default bucketing;
* ``local``: the same step without any communication (what 2 x 1-rank would be
  on this host at this moment, measured in the same run).

After a warmup the variants alternate in blocks (``--rounds`` rounds of
``--steps`` steps each, the first variant swapped every round) so that load from
other processes hits all alike. A step's time is the slowest rank's. Reported:
min and median step time per variant, CPU time per step (all threads, summed over
the ranks: on 2 shared cores this decides the step time), the spark_hvd / ddp ratio
of medians, and
scaling efficiency = 2-rank throughput / (2 x 1-rank throughput) per variant,
both from the separate 1-rank launch and against ``local`` in the same run (on a
shared or oversubscribed host the load differs between launches).

``--autotune`` compares SPARK_HVD_AUTOTUNE with the default fusion threshold and
cycle time instead: ``--repeats`` pairs of 2-rank launches, one with the defaults and
one with autotune, whose workers first train spark_hvd steps until rank 0's search
has ended (the launch with the defaults then trains as many steps first, so both are
warmed up alike; the other variants warm up as usual). Reported per pair: the
configuration autotune chose, the spark_hvd step time autotuned / default (medians),
and the same ratio with each launch's ``ddp`` as the yardstick (load differs between
launches); then the min and median of those ratios over the pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time

from spark_hvd import _config

MARK = "@@TORCHSTEP "
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=25)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=20, help="steps per block")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--cycle-time-ms", type=float, default=None,
                   help="SPARK_HVD_CYCLE_TIME_MS for the workers (default: the core's)")
    p.add_argument("--autotune", action="store_true",
                   help="compare SPARK_HVD_AUTOTUNE=1 with the defaults (see above)")
    p.add_argument("--repeats", type=int, default=3, help="launch pairs for --autotune")
    p.add_argument("--max-tune-steps", type=int, default=3000,
                   help="--autotune: give up waiting for the search after this many steps")
    p.add_argument("--tune-first", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pre-steps", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- worker ------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import spark_hvd.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    port = hvd.broadcast_object(free_port() if rank == 0 else None, 0, name="bench.port")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)

    def make_model():
        torch.manual_seed(0)
        layers = []
        for i in range(args.layers):
            layers.append(nn.Linear(args.width, args.width))
            if i < args.layers - 1:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, args.width, generator=g)

    hvd_model = make_model()
    hvd_opt = hvd.DistributedOptimizer(
        torch.optim.SGD(hvd_model.parameters(), lr=0.001, momentum=0.9),
        named_parameters=hvd_model.named_parameters())
    ddp_model = torch.nn.parallel.DistributedDataParallel(make_model())
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.001, momentum=0.9)
    local_model = make_model()  # no communication: each rank trains on its own
    local_opt = torch.optim.SGD(local_model.parameters(), lr=0.001, momentum=0.9)
    variants = {"spark_hvd": (hvd_model, hvd_opt), "ddp": (ddp_model, ddp_opt),
                "local": (local_model, local_opt)}

    def step(name):
        model, opt = variants[name]
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    tuned = None
    if args.tune_first or args.pre_steps:
        # Train until rank 0's autotune search has ended (rank 0 decides), or for as many
        # steps as the search took (the launch with the defaults: the same warm-up).
        from spark_hvd import _core

        tune_steps, searching = 0, args.tune_first
        while (searching or tune_steps < args.pre_steps) and tune_steps < args.max_tune_steps:
            for _ in range(10):
                step("spark_hvd")
            tune_steps += 10
            if searching:
                searching = hvd.broadcast_object(_core.tuned_parameters()["searching"], 0,
                                                 name="bench.searching")
        tuned = dict(_core.tuned_parameters(), steps=tune_steps)
        tuned.pop("history")

    times = {name: [] for name in variants}
    cpu = {name: [] for name in variants}  # process CPU seconds (all threads) per step
    for name in variants:
        for _ in range(args.warmup):
            step(name)
    for rnd in range(args.rounds):
        order = list(variants) if rnd % 2 == 0 else list(reversed(list(variants)))
        for name in order:
            dist.barrier()
            c0 = resource.getrusage(resource.RUSAGE_SELF)
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(name)
                times[name].append(time.perf_counter() - t0)
            c1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu[name].append((c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime)
                             / args.steps)
    # A step's time is the slowest rank's; CPU per step is summed over the ranks.
    everyone = hvd.allgather_object((times, cpu), name="bench.times")
    if rank == 0:
        slowest = {name: [max(ts[name][i] for ts, _ in everyone)
                          for i in range(len(times[name]))] for name in variants}
        cpu_sum = {name: [sum(c[name][i] for _, c in everyone) for i in range(args.rounds)]
                   for name in variants}
        sys.stdout.write(MARK + json.dumps({"size": size, "times": slowest, "cpu": cpu_sum,
                                            "tuned": tuned}) + "\n")
        sys.stdout.flush()
    dist.destroy_process_group()
    hvd.barrier()


# -- driver ------------------------------------------------------------------------

def launch(np: int, argv, cycle_time_ms, extra_env=None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), OMP_NUM_THREADS="1")
    if cycle_time_ms is not None:
        env[_config.CYCLE_TIME_MS_ENV_VAR] = str(cycle_time_ms)
    env.update(extra_env or {})
    cmd = [sys.executable, "-m", "spark_hvd.runner", "-np", str(np), sys.executable,
           os.path.abspath(__file__), "--worker", *argv]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        _, sep, payload = line.partition(MARK)
        if sep:
            return json.loads(payload)
    raise SystemExit(f"{np}-rank run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                     f"{proc.stderr[-3000:]}")


def compare_autotune(args, argv) -> None:
    """--autotune: pairs of 2-rank launches, defaults vs SPARK_HVD_AUTOTUNE=1."""
    argv = [a for a in argv if a != "--autotune"]
    print(f"MLP {args.layers} x Linear({args.width}, {args.width}), batch {args.batch} per rank, "
          f"2 ranks, {args.rounds} rounds x {args.steps} steps per variant, {args.repeats} "
          f"launch pairs ({_config.AUTOTUNE_ENV_VAR}=1, then the defaults); load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    ratios, vs_ddp = [], []
    print(f"{'pair':>4} {'default ms':>10} {'tuned ms':>9} {'tuned/default':>13} "
          f"{'(/ddp each)':>11}  chosen by autotune")
    for i in range(args.repeats):
        tuned = launch(2, argv + ["--tune-first"], args.cycle_time_ms,
                       {_config.AUTOTUNE_ENV_VAR: "1"})
        base = launch(2, argv + ["--pre-steps", str(tuned["tuned"]["steps"])],
                      args.cycle_time_ms)
        med = {k: {v: statistics.median(r["times"][v]) for v in ("spark_hvd", "ddp")}
               for k, r in (("base", base), ("tuned", tuned))}
        ratios.append(med["tuned"]["spark_hvd"] / med["base"]["spark_hvd"])
        vs_ddp.append((med["tuned"]["spark_hvd"] / med["tuned"]["ddp"])
                      / (med["base"]["spark_hvd"] / med["base"]["ddp"]))
        t = tuned["tuned"]
        chosen = (f"{t['fusion_threshold'] / (1 << 20):g} MiB, {t['cycle_time_ms']:g} ms "
                  f"after {t['steps']} steps{' (still searching)' if t['searching'] else ''}")
        print(f"{i:>4} {med['base']['spark_hvd'] * 1e3:>10.2f} "
              f"{med['tuned']['spark_hvd'] * 1e3:>9.2f} {ratios[-1]:>13.3f} "
              f"{vs_ddp[-1]:>11.3f}  {chosen}")
    print(f"autotuned / default step time: min {min(ratios):.3f}, median "
          f"{statistics.median(ratios):.3f}; against ddp in each launch: min {min(vs_ddp):.3f}, "
          f"median {statistics.median(vs_ddp):.3f} (<= 1.0: autotune no slower)")


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    argv = sys.argv[1:]
    if args.autotune:
        compare_autotune(args, argv)
        return
    print(f"MLP {args.layers} x Linear({args.width}, {args.width}) "
          f"({2 * args.layers} parameter tensors), batch {args.batch} per rank, 1 thread "
          f"per rank, {args.rounds} rounds x {args.steps} steps per variant, "
          f"SPARK_HVD_CYCLE_TIME_MS={args.cycle_time_ms or 'default'}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    runs = {n: launch(n, argv, args.cycle_time_ms) for n in (2, 1)}
    results = {n: r["times"] for n, r in runs.items()}
    med = {}
    print(f"{'variant':<10} {'ranks':>5} {'min ms':>8} {'median ms':>10} {'samples/s':>10} "
          f"{'CPU ms/step':>12}")
    for n in (2, 1):
        for name, ts in results[n].items():
            if n == 1 and name == "local":
                continue
            med[(name, n)] = statistics.median(ts)
            cpu_ms = statistics.median(runs[n]["cpu"][name]) * 1e3
            print(f"{name:<10} {n:>5} {min(ts) * 1e3:>8.2f} {med[(name, n)] * 1e3:>10.2f} "
                  f"{n * args.batch / med[(name, n)]:>10.0f} {cpu_ms:>12.2f}")
    ratio = med[("spark_hvd", 2)] / med[("ddp", 2)]
    print(f"step time spark_hvd / ddp (2 ranks, medians): {ratio:.3f}"
          f"  ({'meets' if ratio <= 0.85 else 'misses'} the <= 0.85 goal)")
    for name in ("spark_hvd", "ddp"):
        eff = med[(name, 1)] / med[(name, 2)]  # (2B / t2) / (2 * B / t1)
        in_run = med[("local", 2)] / med[(name, 2)]
        print(f"scaling efficiency {name}: {eff:.2f} (2-rank throughput / 2 x 1-rank, separate "
              f"launches); {in_run:.2f} against both ranks training locally in the same run")


if __name__ == "__main__":
    main()
