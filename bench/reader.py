"""Rows/s into torch batches: spark_hvd's reader against raw pyarrow on the same files.

The dataset is written once with pyarrow in the layout Spark gives it (several files of
several row groups; a ``features`` list<double> column of width 64, as ``vector_to_array``
writes it, and a ``label`` long).  Each contender turns every row into torch tensors
(``features`` float32 ``(batch, 64)``, ``label`` int64) in batches of ``--batch-size``:

* ``spark_hvd``: ``ParquetShardReader(rank=0, size=1, shuffle=False)`` + ``TorchBatches``
  (background prefetch thread), and again with ``shuffle=True`` (row groups permuted, rows
  mixed through the shuffle buffer) for reference;
* ``pyarrow``: ``ParquetFile.iter_batches`` over the files, list column flattened to
  numpy and reshaped, ``torch.from_numpy``: the least a hand-written loop does;
* ``petastorm``: ``make_batch_reader`` on the same files (its pool of ``--workers``
  threads), and spark_hvd's ``reader="petastorm"`` (``PetastormBatchReader``: the same pool,
  equal steps per rank, rows checked against the footers) + ``TorchBatches``, when
  petastorm imports: in the compat environment (``make compat``, petastorm 0.13.1 needs
  pyarrow <= 14).

Each is run ``--reps`` times interleaved after a warm-up pass (the page cache is then warm
for all); the best rate is reported.  Target: spark_hvd >= 0.8x pyarrow.

    .venv/bin/python bench/reader.py [--rows 400000] [--batch-size 256]
    .venv-compat/bin/python bench/reader.py --workers 2     # both readers, petastorm too
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

WIDTH = 64


def write_dataset(root: str, rows: int, files: int, row_group_rows: int) -> None:
    rng = np.random.default_rng(0)
    per_file = rows // files
    for f in range(files):
        n = per_file if f < files - 1 else rows - per_file * (files - 1)
        values = rng.random(n * WIDTH)
        features = pa.ListArray.from_arrays(
            pa.array(np.arange(0, (n + 1) * WIDTH, WIDTH, dtype=np.int32)), pa.array(values))
        table = pa.table({"features": features,
                          "label": pa.array(rng.integers(0, 10, n), pa.int64())})
        pq.write_table(table, os.path.join(root, f"part-{f:05d}.parquet"),
                       row_group_size=row_group_rows)


def spark_hvd_rows(root: str, batch_size: int, shuffle: bool, reader_kind: str = "arrow",
                   **kw) -> int:
    import torch
    from spark_hvd.data import make_reader
    from spark_hvd.data.torch import TorchBatches
    reader = make_reader(root, reader=reader_kind, rank=0, size=1, batch_size=batch_size,
                         shuffle=shuffle, columns=["features", "label"], **kw)
    rows = 0
    for x, y in TorchBatches(reader, ["features"], ["label"], dtype=torch.float32).epoch(0):
        rows += x.shape[0]
    return rows


def pyarrow_rows(root: str, batch_size: int) -> int:
    import torch
    rows = 0
    for name in sorted(os.listdir(root)):
        pf = pq.ParquetFile(os.path.join(root, name))
        for batch in pf.iter_batches(batch_size=batch_size, columns=["features", "label"]):
            feats = batch.column(0)
            flat = feats.flatten().to_numpy(zero_copy_only=False)
            x = torch.from_numpy(flat.reshape(len(feats), WIDTH)).to(torch.float32)
            y = torch.from_numpy(batch.column(1).to_numpy())
            rows += x.shape[0] + 0 * y.shape[0]
    return rows


def petastorm_rows(root: str, batch_size: int, workers: int) -> int:
    from spark_hvd.data.petastorm_reader import import_make_batch_reader
    make_batch_reader = import_make_batch_reader()
    rows = 0
    with make_batch_reader("file://" + root, num_epochs=1, workers_count=workers) as reader:
        for batch in reader:
            rows += len(batch.label)
    return rows


def best_rate(fn, reps: int, expected: int) -> float:
    best = 0.0
    for _ in range(reps):
        start = time.perf_counter()
        got = fn()
        took = time.perf_counter() - start
        if got != expected:
            raise SystemExit(f"{fn} read {got} rows, expected {expected}")
        best = max(best, got / took)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--row-group-rows", type=int, default=25_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="petastorm's pool threads")
    args = parser.parse_args(argv)

    import torch
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="spark_hvd_bench_reader_")
    try:
        write_dataset(root, args.rows, args.files, args.row_group_rows)
        size_mb = sum(os.path.getsize(os.path.join(root, f)) for f in os.listdir(root)) / 2**20
        print(f"{args.rows} rows ({WIDTH} float64 features + label) in {args.files} files, "
              f"{size_mb:.0f} MiB, batch {args.batch_size}; best of {args.reps}")
        contenders = {
            "spark_hvd (shuffle=False)": lambda: spark_hvd_rows(root, args.batch_size, False),
            "pyarrow iter_batches": lambda: pyarrow_rows(root, args.batch_size),
            "spark_hvd (shuffle=True)": lambda: spark_hvd_rows(root, args.batch_size, True),
        }
        try:
            from spark_hvd.data.petastorm_reader import import_make_batch_reader
            import_make_batch_reader()
            contenders["petastorm make_batch_reader"] = lambda: petastorm_rows(
                root, args.batch_size, args.workers)
            contenders["spark_hvd reader='petastorm'"] = lambda: spark_hvd_rows(
                root, args.batch_size, False, "petastorm", workers_count=args.workers)
        except ImportError as exc:
            print(f"petastorm: not measured, it does not import here ({exc})".splitlines()[0])
        for fn in contenders.values():  # warm-up: page cache, imports
            fn()
        rates = {name: 0.0 for name in contenders}
        for _ in range(args.reps):  # interleaved, so drift in machine load hits all alike
            for name, fn in contenders.items():
                rates[name] = max(rates[name], best_rate(fn, 1, args.rows))
        base = rates["pyarrow iter_batches"]
        for name, rate in rates.items():
            print(f"{name:<30} {rate / 1e6:7.3f} M rows/s   {rate / base:5.2f}x pyarrow")
        ratio = rates["spark_hvd (shuffle=False)"] / base
        print(f"spark_hvd / pyarrow = {ratio:.2f} (target >= 0.80): "
              f"{'met' if ratio >= 0.8 else 'NOT met'}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
