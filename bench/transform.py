"""Rows/s of TorchModel.transform against a constant UDF (what the executor JVM costs), a
row-at-a-time Python UDF and predict_batch_udf, on whichever pyspark runs it.

All run the same torch MLP (64 -> 256 -> 10, float32, one torch thread per task as
each executor has one core) on the same cached DataFrame of ``--rows`` rows with a 64-wide
Vector ``features`` column, in one ``local-cluster[2,1,1024]`` session whose executors and
driver run the JVM's default JIT (both tiers, as on a cluster; before 2026-12-06 the
executors ran C1 only, as the other benches' do to start faster, which tripled the JVM's
share, and until that evening the driver did, which doubled its analysis of each pass's
new plan: transform's ~0.04 s, the constant UDF's ~0.01 s), and write every
output with the ``noop`` sink (so nothing is pruned and nothing is collected).  Each line
also gives the executors' CPU seconds per pass (JVMs, Python workers; Linux):

* ``TorchModel.transform``: the UDF this pyspark offers (estimators/_predict_udf.py): a
  scalar-iterator Arrow UDF (``arrow_udf``, pyspark >= 4.1), else a scalar-iterator pandas
  UDF, on the features as floats (a dense Vector's stored values packed as one binary per
  row, ``VectorColumns.packed``), the Arrow batch to one tensor with one copy,
  ``inference_batch_size`` rows per model call, one torch thread (``spark.task.cpus``),
  the model unpickled once per Python worker, output a (float64) Vector column; on
  pyspark >= 4.1 also its pandas UDF path (``transform, pandas UDF``);
* a constant UDF of the same kind (``arrow_udf``, else ``pandas_udf``, scalar iterator) on
  ``vector_to_array(features, "float32")``, returning 0.0 per row: what the JVM costs (the
  cached scan, ``vector_to_array``, Arrow's writes and reads) with no model and no
  conversion, the yardstick transform should reach 0.9x of; the same constant UDF on
  transform's own input (``constant, own input``), which skips ``vector_to_array``'s boxing;
  and the constant UDF in Python workers given, once each, what transform's get after a
  model load (``constant, settled``: _model_base.settle_worker, the frozen heap and the
  zips on sys.path read once), the JVM's bound without pyspark's per-task Python costs;
* the constant UDF that also runs the MLP, on a tensor of zeros as many rows long as each
  batch (``constant + MLP``, settled workers): the constant's cost plus the model's own,
  the bound for any UDF that runs this model, which transform should reach 0.9x of; and
  ``transform, linear``: TorchModel.transform of a ``Linear(64, 10)`` (1/30 of the MLP's
  arithmetic), whose model costs next to nothing, against the constant UDF itself;
* transform's own UDF with a model returning zeros (``<kind> UDF, no model``): what
  transform costs without the model, output (a Vector) included.  Before pyspark 4.1 a
  vectorized UDF cannot return a Vector, so the JVM makes it from the UDF's doubles (as a
  dense Vector's struct, relabelled: ``VectorColumns.from_array``; measured 2026-12-06 on
  pyspark 3.5, a 10-wide output: 0.90x the rows/s of a constant UDF returning one double,
  against 0.77x through ``array_to_vector``);
* a row-at-a-time ``@udf`` calling the model on one row (the model cached per worker);
* ``pyspark.ml.functions.predict_batch_udf`` on ``vector_to_array(features, "float32")``
  with the same batch size, ``torch.set_num_threads(1)`` and the model unpickled once per
  Python worker in ``make_predict_fn``, output ``array<float>`` (the documented way to do
  batch inference in Spark; its pandas conversions are its own cost).

Where the time goes (2026-12-04, pyspark 4.3, CPU seconds per 200,000-row pass, summed over
both executors): the executor JVMs ~1.5 s for either (the cached scan, ``vector_to_array``
and Arrow's element-by-element writes), the Python workers 0.8 s for TorchModel (of which
the MLP ~0.3 s) against 1.8 s for predict_batch_udf; an Arrow UDF returning a constant takes
1.2 s + 0.5 s.  So the ratio is bounded by the JVM's share, the same for both.  On
2026-12-06, pyspark 3.5, after ``VectorColumns``: the constant pandas UDF 1.20 s (JVM) +
0.83 s (Python), transform's UDF with a zero model 1.19 + 0.88, transform 1.18 + 1.08:
against the constant, what transform has left is the MLP's own CPU (0.19 s on one core).

2026-12-06, later, C2 executors: after packing and the frozen worker heap, transform's UDF
with a zero model is 1.12x the constant UDF on 4.3 and 1.00x on 3.5 (0.83x on 4.0); the
MLP (0.11 s of one core per 200,000 rows alone) is what keeps transform at 0.69-0.77x.
Each contender runs in Python workers of its own (``workers``): transform freezes its
workers' heap out of pyspark's per-task ``gc.collect()``, which a peer sharing them would
enjoy too.

2026-12-06, afternoon: transform's columns built in 59-90 py4j calls per ``transform``
(~330-440 before: 0.1-0.15 s of the driver's per pass, which this bench pays every pass) and
its workers' zips read once (pyspark 3.5 and 4.0 had each task re-read pyspark.zip's
directory, 57 % of a 4.0 worker's busy time).  transform is then 1.07x and 1.12x the
constant UDF on 3.5 and 4.0, 0.86-0.93x on 4.3, where the MLP is 67 % of a worker's busy
time (docs/benchmarks.md).

2026-12-06, evening: the constant UDF bounds transform only where the model costs
nothing.  At 1,000,000 rows (0.74x the constant) a pass's executor CPU was the constant's
1.78 s against transform's 2.52 s, of which the MLP 0.55 s: on a machine whose cores the
JVMs and the Python workers share, that MLP alone puts transform under 0.9x whatever the
rest costs (JVM and Python without it: 1.97 s; the JVM's own floor, a packed input and a
double out, 1.29 s).  So the bench also times the two bounds above, ``constant + MLP`` and
the constant against ``transform, linear``, and gives each ratio as the ratio of medians
and as the median of each rep's own ratio (a rep's two passes lie within its ~15 s, the
medians' anywhere in the run: a change of the machine's load moves both of a rep's).

One warm-up pass each (Python workers, model caches), then ``--reps`` passes, the
contenders in a new (seeded) order each rep; the best and the median of each are reported,
with the load average (a shared machine).  Targets: TorchModel >= 1.5x predict_batch_udf,
>= 0.9x ``constant + MLP``, and ``transform, linear`` >= 0.9x the constant UDF.  Run it with
another environment's Python for another pyspark (``make old-sparks``):

    .venv/bin/python bench/transform.py [--rows 200000] [--batch-size 1024]
    .venv-spark35/bin/python bench/transform.py
"""

import argparse
import os
import random
import statistics
import sys
import time

from _spark import mlp, session

WIDTH, HIDDEN, CLASSES = 64, 256, 10


def data(spark, rows: int, partitions: int):
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F
    df = (spark.range(rows, numPartitions=partitions)
          .select("id", array_to_vector(F.array(*[F.rand(i) for i in range(WIDTH)]))
                  .alias("features")))
    df = df.cache()
    df.count()
    return df


def row_udf(net_bytes: bytes):
    from pyspark.sql import functions as F
    from pyspark.sql import types as T
    cache = {}

    def predict(v):
        import torch
        model = cache.get("m")
        if model is None:
            import cloudpickle
            torch.set_num_threads(1)
            model = cache["m"] = cloudpickle.loads(net_bytes)
        with torch.inference_mode():
            out = model(torch.tensor(v.toArray(), dtype=torch.float32).reshape(1, -1))
        return out[0].tolist()
    return F.udf(predict, T.ArrayType(T.DoubleType()))


def batch_udf(net_bytes: bytes, batch_size: int):
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql import types as T

    def make_predict_fn():
        import cloudpickle
        import torch
        torch.set_num_threads(1)
        model = cloudpickle.loads(net_bytes)

        def predict(inputs):
            with torch.inference_mode():
                return model(torch.from_numpy(inputs)).numpy()
        return predict
    return predict_batch_udf(make_predict_fn, return_type=T.ArrayType(T.FloatType()),
                             batch_size=batch_size, input_tensor_shapes=[[WIDTH]])


def constant_udf(kind: str, settle: bool = False, each_batch=None):
    """A scalar-iterator UDF of ``kind`` (``arrow`` or ``pandas``) giving 0.0 per row;
    ``settle``: each of its Python workers is given what transform gives its own after a
    model load (a "model" loaded once per worker into _model_base.MODEL_CACHE, whose
    settle_worker freezes the heap and keeps the zips read once); ``each_batch(rows)``, if
    given, is called on each batch's length before its zeros are made."""
    from typing import Iterator

    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    def settled():
        if settle:
            from spark_hvd.estimators._model_base import MODEL_CACHE
            MODEL_CACHE.get(("bench/transform.py", "settled"), object)
    if kind == "arrow":
        import pyarrow as pa

        def zeros_arrow(batches: Iterator[pa.Array]) -> Iterator[pa.Array]:
            import numpy as np
            settled()
            for batch in batches:
                if each_batch is not None:
                    each_batch(len(batch))
                yield pa.array(np.zeros(len(batch)))
        return F.arrow_udf(zeros_arrow, T.DoubleType())
    import pandas as pd

    def zeros_pandas(batches: Iterator[pd.Series]) -> Iterator[pd.Series]:
        import numpy as np
        settled()
        for batch in batches:
            if each_batch is not None:
                each_batch(len(batch))
            yield pd.Series(np.zeros(len(batch)))
    return F.pandas_udf(zeros_pandas, T.DoubleType())


def constant_with_model(kind: str, net_bytes: bytes, batch_size: int):
    """The constant UDF of ``kind`` that also runs the model (one torch thread) on as many
    rows as each batch has, ``batch_size`` at a time, on a tensor of zeros: the constant's
    cost plus the model's own, with no conversion of the input or the output, the least any
    UDF running this model can cost.  Its model is loaded once per Python worker into
    _model_base.MODEL_CACHE, as transform's, whose settle_worker spares the worker
    pyspark's per-task costs (with torch imported, its per-task ``gc.collect()`` alone
    tripled this UDF's Python time)."""
    def run_model(rows: int):
        import cloudpickle
        import torch

        from spark_hvd.estimators._model_base import MODEL_CACHE

        def load():
            torch.set_num_threads(1)
            return cloudpickle.loads(net_bytes), torch.zeros(batch_size, WIDTH)
        model, x = MODEL_CACHE.get(("bench/transform.py", "constant + MLP"), load)
        with torch.inference_mode():
            for start in range(0, rows, batch_size):
                model(x[:min(batch_size, rows - start)])
    return constant_udf(kind, each_batch=run_model)


def zero_model_udf(df, kind: str):
    """``df`` through transform's own UDF of ``kind`` with a model that returns zeros: the
    same columns in and out (a 10-wide Vector), no model."""
    import numpy as np

    from spark_hvd.estimators._predict_udf import VectorColumns, add_predictions

    def open_zero_model():
        return lambda arrays, batch_rows: [np.zeros((len(arrays[0]), CLASSES))]
    vectors = VectorColumns(df)
    features, packed = vectors.model_input(df["features"], "float32")
    return add_predictions(df, [features], [None], open_zero_model, ["features"], [[CLASSES]],
                           ["pred"], 1024, "", kind, vectors, packed=[packed])


def executor_cpu():
    """CPU seconds so far of this machine's executor JVMs and pyspark's Python workers
    (Linux /proc; None elsewhere)."""
    import glob
    if not os.path.isdir("/proc/self"):
        return None
    tick, jvm, python = os.sysconf("SC_CLK_TCK"), 0.0, 0.0
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat[:-4] + "cmdline", "rb") as f:
                cmd = f.read()
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        if b"CoarseGrainedExecutorBackend" in cmd:
            jvm += seconds
        elif b"pyspark.daemon" in cmd:  # the daemon and the workers it forks
            python += seconds
    return jvm, python


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--row-udf-rows", type=int, default=50_000,
                        help="rows for the (slow) row-at-a-time UDF")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--master", default="local-cluster[2,1,1024]")
    parser.add_argument("--executor-java-options", default="",
                        help="the executors' JVM options: by default the JVM's own (both JIT "
                             "tiers, as a cluster runs them), not the C1-only start-up flags "
                             "the other benches give them")
    parser.add_argument("--driver-java-options", default="",
                        help="the driver's JVM options, the JVM's own by default too: each "
                             "pass calls transform (or withColumn) again, which the driver "
                             "analyzes")
    args = parser.parse_args(argv)

    import cloudpickle
    import pyspark
    import torch
    from pyspark.ml.functions import vector_to_array

    from spark_hvd.estimators import TorchModel
    from spark_hvd.estimators._predict_udf import VectorColumns, udf_kind

    spark = session(args.master, "transform",
                    {"spark.executor.extraJavaOptions": args.executor_java_options,
                     "spark.driver.extraJavaOptions": args.driver_java_options})
    df = data(spark, args.rows, args.partitions)
    small = data(spark, args.row_udf_rows, args.partitions)
    net = mlp(WIDTH, HIDDEN, CLASSES).eval()
    blob = cloudpickle.dumps(net)
    model = TorchModel(model=net, feature_cols=["features"], output_cols=["pred"],
                       feature_shapes=[[WIDTH]], inference_batch_size=args.batch_size)
    predict_row, predict_batch = row_udf(blob), batch_udf(blob, args.batch_size)
    torch.manual_seed(0)
    linear = TorchModel(model=torch.nn.Linear(WIDTH, CLASSES).eval(), feature_cols=["features"],
                        output_cols=["pred"], feature_shapes=[[WIDTH]],
                        inference_batch_size=args.batch_size)

    def noop(frame):
        frame.write.format("noop").mode("overwrite").save()

    kind = udf_kind()
    constant, settled = constant_udf(kind), constant_udf(kind, settle=True)
    with_model = constant_with_model(kind, blob, args.batch_size)
    own_input = VectorColumns(df).to_array(df["features"], "float32")
    sc = spark.sparkContext

    def workers(pool, build):
        """``build()``'s DataFrame written, its UDFs run by Python workers of ``pool`` only:
        pyspark keeps a pool of workers per set of environment variables, which a UDF
        takes from ``sc.environment`` when it is first called.  transform leaves its
        workers settled (_model_base.settle_worker); a peer runs in workers of
        its own, as it would without spark_hvd."""
        def run():
            sc.environment["BENCH_TRANSFORM_WORKERS"] = pool
            noop(build())
        return run

    contenders = {
        "TorchModel.transform": (args.rows, workers("ours", lambda: model.transform(df))),
        f"constant {kind} UDF": (args.rows, workers("constant", lambda: df.withColumn(
            "pred", constant(vector_to_array("features", "float32"))))),
        "constant, own input": (args.rows, workers("constant", lambda: df.withColumn(
            "pred", constant(own_input)))),
        "constant, settled": (args.rows, workers("settled", lambda: df.withColumn(
            "pred", settled(vector_to_array("features", "float32"))))),
        "constant + MLP": (args.rows, workers("constant + MLP", lambda: df.withColumn(
            "pred", with_model(vector_to_array("features", "float32"))))),
        "transform, linear": (args.rows, workers("ours", lambda: linear.transform(df))),
        "predict_batch_udf": (args.rows, workers("predict_batch_udf", lambda: df.withColumn(
            "pred", predict_batch(vector_to_array("features", "float32"))))),
        "row-at-a-time udf": (args.row_udf_rows, workers("row", lambda: small.withColumn(
            "pred", predict_row("features")))),
    }
    contenders[f"{kind} UDF, no model"] = (args.rows,
                                           workers("ours", lambda: zero_model_udf(df, kind)))
    if kind == "arrow":
        contenders["transform, pandas UDF"] = (
            args.rows, workers("ours", lambda: model._transform_with(df, "pandas")))
        contenders["pandas UDF, no model"] = (
            args.rows, workers("ours", lambda: zero_model_udf(df, "pandas")))
    print(f"pyspark {pyspark.__version__} (transform: {kind} UDF); "
          f"{args.rows} rows x {WIDTH} features, MLP {WIDTH}-{HIDDEN}-{CLASSES}, "
          f"{args.partitions} partitions on {args.master}, batch {args.batch_size}; "
          f"{args.reps} reps; load {os.getloadavg()[0]:.1f}")
    for _, fn in contenders.values():
        fn()
    rates = {name: [] for name in contenders}
    cpu = {name: [] for name in contenders}
    order, shuffle = list(contenders), random.Random(0).shuffle
    for _ in range(args.reps):
        shuffle(order)  # a new order each rep: no contender always follows the same one
        for name in order:
            rows, fn = contenders[name]
            before = executor_cpu()
            start = time.perf_counter()
            fn()
            rates[name].append(rows / (time.perf_counter() - start))
            time.sleep(0.3)  # the Python workers' gc.collect() after each task, counted here
            after = executor_cpu()
            if before is not None:
                cpu[name].append((after[0] - before[0], after[1] - before[1]))
    best = {name: max(r) for name, r in rates.items()}
    median = {name: statistics.median(r) for name, r in rates.items()}
    base_best, base_median = best["predict_batch_udf"], median["predict_batch_udf"]
    for name in rates:
        used = ""
        if cpu[name]:
            used = (f"; CPU s/pass: JVMs {statistics.median(c[0] for c in cpu[name]):.2f}, "
                    f"Python {statistics.median(c[1] for c in cpu[name]):.2f}")
        print(f"{name:<22} best {best[name]:>10,.0f} rows/s {best[name] / base_best:5.2f}x   "
              f"median {median[name]:>10,.0f} rows/s {median[name] / base_median:5.2f}x "
              f"predict_batch_udf{used}")
    ratio = median["TorchModel.transform"] / base_median
    print(f"TorchModel / predict_batch_udf = {ratio:.2f} median (target >= 1.5): "
          f"{'met' if ratio >= 1.5 else 'NOT met'}; load {os.getloadavg()[0]:.1f}")
    for name, bound in (("TorchModel.transform", "constant + MLP"),
                        ("transform, linear", f"constant {kind} UDF"),
                        ("TorchModel.transform", f"constant {kind} UDF")):
        ratio = median[name] / median[bound]
        paired = statistics.median(a / b for a, b in zip(rates[name], rates[bound]))
        print(f"{name} / {bound} = {ratio:.2f} median, {paired:.2f} median of each rep's "
              f"(target >= 0.9): {'met' if min(ratio, paired) >= 0.9 else 'NOT met'}")
    for name, path in (("TorchModel.transform", kind), ("transform, pandas UDF", "pandas")):
        if name in median:
            bound = median[name] / median[f"constant {kind} UDF"]
            print(f"{name}, medians: / constant {kind} UDF = {bound:.2f}; / the constant "
                  f"on its input = "
                  f"{median[name] / median['constant, own input']:.2f}; / the constant in "
                  f"settled workers = {median[name] / median['constant, settled']:.2f}; / "
                  f"its UDF without the model = "
                  f"{median[name] / median[f'{path} UDF, no model']:.2f}")
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
