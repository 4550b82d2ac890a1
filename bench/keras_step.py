"""Keras ``model.fit`` step time on 2 workers: spark_hvd's DistributedOptimizer against
``tf.distribute.MultiWorkerMirroredStrategy``, same model, data and global batch, same run.

    python bench/keras_step.py [--steps 300] [--rounds 2] [--width 256] [--batch 64]

The driver (this script without ``--worker``) runs, ``--rounds`` times and alternating:
  - spark_hvd: ``spark-hvdrun -np 2`` ranks, each fitting its half of the data with
    batch/2 rows per step through ``DistributedOptimizer(SGD)``;
  - MWMS: two processes with TF_CONFIG naming two local workers on 127.0.0.1 (free ports
    picked here), fitting a ``tf.data`` pipeline of the global batch that the strategy
    shards (auto-shard policy DATA) under ``strategy.scope()``;
  - and, for scale, one plain process fitting the global batch alone.
Each worker times every step in a callback (end of batch to end of batch) after
``--warmup`` steps; worker 0 reports. Both TensorFlow setups use one intra-op and one
inter-op thread per process (the collectives' own threads come on top).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MARK = "@@BENCH "


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=["hvd", "mwms", "local"], help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=300, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=20, help="untimed first steps")
    p.add_argument("--rounds", type=int, default=2, help="runs of each setup, alternating")
    p.add_argument("--batch", type=int, default=64, help="global batch (split over 2 workers)")
    p.add_argument("--width", type=int, default=256, help="hidden units of the 3-layer MLP")
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    return p.parse_args(argv)


# -- worker side ---------------------------------------------------------------------

def build(args):
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    rows = args.batch * 32
    x = rng.randn(rows, args.features).astype(np.float32)
    y = rng.randint(0, 10, size=rows).astype(np.int32)
    model = keras.Sequential([keras.Input((args.features,)),
                              keras.layers.Dense(args.width, activation="relu"),
                              keras.layers.Dense(args.width, activation="relu"),
                              keras.layers.Dense(10)])
    return model, x, y


def step_timer():
    import keras

    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    return StepTimer()


def report(args, kind: str, timer, extra=None) -> None:
    ends = timer.ends[args.warmup:]
    steps_ms = [1000 * (b - a) for a, b in zip(ends, ends[1:])]
    print(MARK + json.dumps({"kind": kind, "steps_ms": steps_ms, **(extra or {})}), flush=True)


def worker(args) -> None:
    import keras
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    total = args.steps + args.warmup + 1
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    timer = step_timer()
    if args.worker == "hvd":
        import spark_hvd.tensorflow.keras as hvd

        hvd.init()
        model, x, y = build(args)
        n, r = hvd.size(), hvd.rank()
        ds = (tf.data.Dataset.from_tensor_slices((x[r::n], y[r::n])).repeat()
              .batch(args.batch // n).prefetch(4))
        model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss,
                      jit_compile=False)
        model.fit(ds, steps_per_epoch=total, epochs=1, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), timer])
        if r == 0:
            report(args, "spark_hvd", timer)
    elif args.worker == "mwms":
        keras.config.disable_traceback_filtering()
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        with strategy.scope():
            model, x, y = build(args)
            model.compile(keras.optimizers.SGD(0.01), loss, jit_compile=False)
            # Keras 3.15's fit() builds metrics and optimizer from a first batch through
            # strategy.reduce("MEAN", <tuple of PerReplica>), which MWMS rejects
            # ("Attempt to convert a value (PerReplica...) to a Tensor"); build from a plain
            # batch here instead and skip that step.
            model._symbolic_build(data_batch=(x[:args.batch // 2], y[:args.batch // 2], None))
        model._maybe_symbolic_build = lambda *a, **k: None
        # And each step's logs go through strategy.reduce("MEAN", scalar, axis=0), which
        # fails for scalars; report worker 0's own values instead (no metric collective
        # per step, as on the spark_hvd side).
        import keras.src.backend.tensorflow.trainer as keras_tf_trainer

        keras_tf_trainer.reduce_per_replica = lambda values, strategy, reduction: \
            tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0], values)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = \
            tf.data.experimental.AutoShardPolicy.DATA
        ds = (tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(args.batch)
              .with_options(options).prefetch(4))
        model.fit(ds, steps_per_epoch=total, epochs=1, verbose=0, callbacks=[timer])
        if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
            report(args, "MWMS", timer, {"replicas": strategy.num_replicas_in_sync})
    else:
        model, x, y = build(args)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(args.batch).prefetch(4)
        model.compile(keras.optimizers.SGD(0.01), loss, jit_compile=False)
        model.fit(ds, steps_per_epoch=total, epochs=1, verbose=0, callbacks=[timer])
        report(args, "1 process", timer)


# -- driver side ---------------------------------------------------------------------

def free_ports(k: int):
    socks = [socket.socket() for _ in range(k)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def env() -> dict:
    e = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    e.pop("TF_CONFIG", None)
    return e


def worker_argv(args, kind: str):
    return [sys.executable, os.path.abspath(__file__), "--worker", kind,
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
            "--width", str(args.width), "--features", str(args.features)]


def parse(out: str, what: str) -> dict:
    for line in out.splitlines():
        idx = line.find(MARK)
        if idx >= 0:
            return json.loads(line[idx + len(MARK):])
    raise RuntimeError(f"{what}: no result; output tail:\n" + "\n".join(out.splitlines()[-30:]))


def run_hvd(args) -> dict:
    proc = subprocess.run([sys.executable, "-m", "spark_hvd.runner", "-np", "2",
                           *worker_argv(args, "hvd")], env=env(), capture_output=True,
                          text=True, timeout=args.timeout)
    return parse(proc.stdout + proc.stderr, "spark_hvd")


def run_mwms(args) -> dict:
    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    for i in range(2):
        e = env()
        e["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
        procs.append(subprocess.Popen(worker_argv(args, "mwms"), env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=args.timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError("MWMS worker failed:\n" + "\n".join(o[-3000:] for o in outs))
    return parse(outs[0], "MWMS")


def run_local(args) -> dict:
    proc = subprocess.run(worker_argv(args, "local"), env=env(), capture_output=True, text=True,
                          timeout=args.timeout)
    return parse(proc.stdout + proc.stderr, "1 process")


def summary(label: str, steps_ms) -> str:
    return (f"{label:<28} min {min(steps_ms):7.2f} ms  median {statistics.median(steps_ms):7.2f}"
            f" ms  ({len(steps_ms)} steps)")


def driver(args) -> None:
    print(f"model: MLP {args.features}-{args.width}-{args.width}-10, SGD, global batch "
          f"{args.batch} ({args.batch // 2} per worker), {args.steps} timed steps after "
          f"{args.warmup} warmup, {args.rounds} round(s); host: {os.cpu_count()} CPUs, load "
          f"average {os.getloadavg()[0]:.1f}", flush=True)
    results = {"spark_hvd": [], "MWMS": [], "1 process": []}
    for rnd in range(args.rounds):
        for name, fn in (("spark_hvd", run_hvd), ("MWMS", run_mwms), ("1 process", run_local)):
            t0 = time.monotonic()
            res = fn(args)
            results[name].extend(res["steps_ms"])
            print(summary(f"round {rnd + 1} {name}", res["steps_ms"]) +
                  f"  [{time.monotonic() - t0:.0f} s incl. start-up]", flush=True)
    print()
    for name, steps in results.items():
        print(summary(name + " (all rounds)", steps))
    hvd_med = statistics.median(results["spark_hvd"])
    mwms_med = statistics.median(results["MWMS"])
    print(f"\nmedian step time ratio spark_hvd / MWMS = {hvd_med / mwms_med:.2f}  "
          f"(min ratio {min(results['spark_hvd']) / min(results['MWMS']):.2f}; below 1 means "
          "spark_hvd is faster)")


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
