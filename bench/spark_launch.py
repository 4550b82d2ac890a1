"""Launch overhead of ``spark_hvd.spark.run`` and of its TorchDistributor drop-in
(``spark_hvd.spark.TorchDistributor``) against pyspark's TorchDistributor.

Each runs a function that does nothing as 2 processes, one Spark barrier task
each, in the same ``local-cluster[2,1,1024]`` session, interleaved, after one
warm-up run each (the first job of a session also pays for starting executors and
Python workers).  Prints min and median wall time per launcher and the ratios to
pyspark's.

    PYTHONPATH=. .venv/bin/python bench/spark_launch.py [--reps 5] [--num-proc 2]
"""

import argparse
import logging
import os
import statistics
import sys
import time

from _spark import session


def noop():
    return None


def _session(master: str):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pythonpath = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
    os.environ["PYTHONPATH"] = pythonpath
    return session(master, "launch", {"spark.executorEnv.PYTHONPATH": pythonpath})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--master", default="local-cluster[2,1,1024]")
    args = parser.parse_args(argv)

    spark = _session(args.master)
    from pyspark.ml.torch.distributor import TorchDistributor

    import spark_hvd.spark
    from spark_hvd.spark import TorchDistributor as DropIn

    logging.getLogger("TorchDistributor").setLevel(logging.ERROR)
    launchers = {
        "spark_hvd.spark.run": lambda: spark_hvd.spark.run(noop, num_proc=args.num_proc,
                                                           verbose=0),
        "spark_hvd TorchDistributor": lambda: DropIn(num_processes=args.num_proc,
                                                     local_mode=False, use_gpu=False,
                                                     verbose=0).run(noop),
        "TorchDistributor": lambda: TorchDistributor(num_processes=args.num_proc,
                                                     local_mode=False,
                                                     use_gpu=False).run(noop),
    }
    times = {name: [] for name in launchers}
    try:
        for launch in launchers.values():  # warm-up
            launch()
        for _ in range(args.reps):
            for name, launch in launchers.items():
                start = time.perf_counter()
                launch()
                times[name].append(time.perf_counter() - start)
    finally:
        spark.stop()

    print(f"\nlaunch of a no-op function as {args.num_proc} processes on {args.master}, "
          f"{args.reps} repetitions each, interleaved (seconds)")
    print(f"{'launcher':<28}{'min':>8}{'median':>8}   all")
    for name, ts in times.items():
        print(f"{name:<28}{min(ts):>8.3f}{statistics.median(ts):>8.3f}   "
              + " ".join(f"{t:.3f}" for t in ts))
    theirs = times["TorchDistributor"]
    for name in ("spark_hvd.spark.run", "spark_hvd TorchDistributor"):
        ours = times[name]
        print(f"ratio {name} / pyspark TorchDistributor: median "
              f"{statistics.median(ours) / statistics.median(theirs):.2f}, "
              f"min {min(ours) / min(theirs):.2f} (target <= 0.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
