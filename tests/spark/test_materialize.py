"""estimators.materialize on a local[2] Spark: validation, the write, the cache, the reader."""

import os
import pickle
import posixpath

import numpy as np
import pytest

from _s3 import s3_endpoint, s3_url, spark_s3_environment  # noqa: F401 (fixtures)
from estimators import materialize
from estimators.materialize import META_FILE, DataMeta, prepare_data, validate_dataframe
from estimators.store import Store
from spark_hvd.exceptions import InvalidArgumentError

N = 120
WIDTH = 8


def _row(i):
    from pyspark.ml.linalg import Vectors
    vec = (Vectors.dense([float(i)] * WIDTH) if i % 3 else
           Vectors.sparse(WIDTH, [0, WIDTH - 1], [float(i), float(i)]))
    return (i, vec, float(i % 4), 1.0 + (i % 2), i % 5 == 0, i % 7 == 0 and 1 or 0, f"n{i}")


@pytest.fixture(scope="module")
def df(spark_local):
    cols = ["id", "features", "label", "w", "is_val", "fold", "name"]
    return spark_local.createDataFrame([_row(i) for i in range(N)], cols).repartition(3)


@pytest.fixture
def store(tmp_path):
    return Store.create(str(tmp_path / "store"))


@pytest.fixture
def writes(monkeypatch):
    """Counts the Spark writes prepare_data starts."""
    calls = []
    real = materialize._write_parquet

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(materialize, "_write_parquet", counting)
    return calls


def _listing(root):
    out = []
    for base, dirs, files in os.walk(root):
        out += [os.path.relpath(os.path.join(base, n), root) for n in dirs + files]
    return sorted(out)


def _ids(meta, split, size, batch_size=7, epoch=0):
    """Every rank's ids for one epoch, checking equal steps."""
    per_rank = []
    for rank in range(size):
        reader = meta.make_reader(split, rank=rank, size=size, batch_size=batch_size)
        batches = list(reader.epoch(epoch))
        assert len(batches) == len(reader)
        per_rank.append(batches)
    assert len({len(b) for b in per_rank}) == 1, "ranks took different numbers of steps"
    for batches in per_rank:
        assert sum(len(b["id"]) for b in batches) > 0, "a rank got no data"
    return [i for batches in per_rank for b in batches for i in b["id"].tolist()], per_rank


def test_prepare_then_read_every_row_once(df, store):
    meta = prepare_data(df, store, ["features", "id"], ["label"], "w", num_proc=3, seed=1)
    assert meta.train_rows == N and meta.val_path is None and meta.val_rows == 0
    assert meta.columns["features"].dtype == "float64"
    assert meta.columns["features"].shape == (WIDTH,)
    assert meta.columns["features"].kind == "vector"
    assert (meta.columns["id"].dtype, meta.columns["id"].shape) == ("int64", ())
    assert list(meta.columns) == ["features", "id", "label", "w"]
    assert meta.train_path.startswith(store.get_data_path(meta.key))
    assert pickle.loads(pickle.dumps(meta)) == meta
    for size in (1, 2, 3):
        ids, per_rank = _ids(meta, "train", size, epoch=size)
        assert sorted(ids) == list(range(N))
    batch = per_rank[0][0]
    assert batch["features"].shape[1:] == (WIDTH,)
    assert np.array_equal(batch["features"][:, 0], batch["id"].astype(np.float64))
    assert np.array_equal(batch["w"], 1.0 + batch["id"] % 2)


def test_validation_fraction(df, store):
    meta = prepare_data(df, store, ["features", "id"], ["label"], validation=0.25, num_proc=2,
                        seed=3)
    assert meta.train_rows + meta.val_rows == N and 0 < meta.val_rows < N
    train, _ = _ids(meta, "train", 2)
    val, _ = _ids(meta, "val", 2)
    assert not set(train) & set(val)
    assert sorted(train + val) == list(range(N))


@pytest.mark.parametrize("column, chosen", [("is_val", lambda i: i % 5 == 0),
                                            ("fold", lambda i: i % 7 == 0)])
def test_validation_column(df, store, column, chosen):
    meta = prepare_data(df, store, ["features", "id"], ["label"], validation=column,
                        num_proc=2)
    val, _ = _ids(meta, "val", 2)
    assert sorted(val) == [i for i in range(N) if chosen(i)]
    assert meta.val_rows == len(val) and meta.train_rows == N - len(val)
    assert column not in meta.columns


def test_cache_reuse_and_new_key(df, store, writes):
    args = (df, store, ["features", "id"], ["label"], "w")
    first = prepare_data(*args, num_proc=2)
    marker = os.path.join(store.get_data_path(first.key), META_FILE)
    mtime = os.stat(marker).st_mtime_ns
    again = prepare_data(*args, num_proc=2)
    assert again == first and len(writes) == 1
    assert os.stat(marker).st_mtime_ns == mtime
    more_procs = prepare_data(*args, num_proc=3)  # same data, re-checked for 3 ranks
    assert more_procs.key == first.key and more_procs.num_proc == 3 and len(writes) == 1
    with pytest.raises(InvalidArgumentError, match=f"num_proc={N + 1}"):
        prepare_data(*args, num_proc=N + 1)
    assert len(writes) == 1 and os.path.exists(marker)
    other = prepare_data(*args, num_proc=2, row_group_size_bytes=1 << 20)
    assert other.key != first.key and len(writes) == 2
    assert os.path.exists(marker)  # another key's data is left alone
    fresh = prepare_data(*args, num_proc=2, cache=False)
    assert fresh.key.startswith("nocache-") and len(writes) == 3


def test_a_changed_plan_is_a_new_key(df, store, writes, spark_local):
    """The key follows the DataFrame: a filter, or other rows of the same schema, are
    written anew, never served from the first write."""
    args = (store, ["features", "id"], ["label"])
    first = prepare_data(df, *args, num_proc=2)
    filtered = prepare_data(df.filter("id >= 10"), *args, num_proc=2)
    other = spark_local.createDataFrame([_row(i) for i in range(N, N + 30)], df.columns)
    others = prepare_data(other, *args, num_proc=2)
    assert len({first.key, filtered.key, others.key}) == 3 and len(writes) == 3
    assert sorted(_ids(filtered, "train", 2)[0]) == list(range(10, N))
    assert sorted(_ids(others, "train", 2)[0]) == list(range(N, N + 30))


def test_parent_cache_dir_conf(df, store, tmp_path, spark_local):
    parent = tmp_path / "petastorm_cache"
    spark_local.conf.set(materialize.PARENT_CACHE_DIR_CONF, "file://" + str(parent))
    try:
        meta = prepare_data(df, store, ["features"], ["label"], num_proc=2)
    finally:
        spark_local.conf.unset(materialize.PARENT_CACHE_DIR_CONF)
    assert meta.train_path.startswith(str(parent / meta.key))
    assert os.path.exists(parent / meta.key / META_FILE)
    assert not os.path.exists(store.get_data_path(meta.key))
    assert meta.make_reader(rank=0, size=1, batch_size=N).num_rows == N


def test_uneven_partitions_still_feed_every_rank(spark_local, store):
    from pyspark.sql import functions as F
    # range() splits [0, 40) into [0, 20) and [20, 40); the filter leaves 1 row and 20 rows.
    uneven = (spark_local.range(0, 40, numPartitions=2).filter("id >= 19")
              .select("id", F.array(F.col("id").cast("double"), F.lit(1.0)).alias("x"),
                      (F.col("id") % 2).alias("y")))
    assert uneven.rdd.glom().map(len).collect() == [1, 20]
    for num_partitions in (None, 3):  # None keeps the 1-row and 20-row files
        meta = prepare_data(uneven, store, ["x", "id"], ["y"], num_proc=3,
                            num_partitions=num_partitions)
        ids, _ = _ids(meta, "train", 3, batch_size=4)
        assert sorted(ids) == list(range(19, 40))


@pytest.mark.parametrize("kwargs, message", [
    (dict(feature_cols=["featurs"]), r"feature column 'featurs' \(did you mean 'features'"),
    (dict(label_cols=["Label"]), r"label column 'Label' \(did you mean 'label'"),
    (dict(feature_cols=["features", "name"]), r"'name' has type string.*StringIndexer"),
    (dict(sample_weight_col="features"), r"sample_weight_col 'features'.*numeric scalar"),
    (dict(validation=1.5), r"validation=1\.5 is not a fraction"),
    (dict(validation=True), r"validation must be a fraction"),
    (dict(validation="isval"), r"validation column 'isval'.*did you mean 'is_val'"),
    (dict(validation="name"), r"validation column 'name' has type string"),
    (dict(num_proc=0), r"num_proc must be an integer >= 1"),
    (dict(vector_dtype="int8"), r"vector_dtype"),
])
def test_bad_arguments_write_nothing(df, store, writes, kwargs, message):
    os.makedirs(store.prefix)
    open(os.path.join(store.prefix, "keep.txt"), "w").close()
    before = _listing(store.prefix)
    args = dict(feature_cols=["features"], label_cols=["label"])
    args.update(kwargs)
    with pytest.raises(InvalidArgumentError, match=message):
        prepare_data(df, store, **args)
    assert _listing(store.prefix) == before and not writes


@pytest.mark.parametrize("make, num_proc, message", [
    (lambda df: df.filter("id < 0"), 1, r"DataFrame is empty"),
    (lambda df: df.limit(2), 3, r"2 row\(s\), fewer than num_proc=3"),
])
def test_too_few_rows_write_nothing(df, store, writes, make, num_proc, message):
    with pytest.raises(InvalidArgumentError, match=message):
        prepare_data(make(df), store, ["features"], ["label"], num_proc=num_proc)
    assert not os.path.exists(store.prefix) and not writes


@pytest.mark.parametrize("validation, message", [
    (0.01, r"selected \d row\(s\), fewer than num_proc=2"),
    ("fold", r"selected 1 row\(s\), fewer than num_proc=2"),
])
def test_errors_found_after_the_write_remove_it(df, store, writes, validation, message):
    small = df.filter("id < 7")  # fold is 1 for id 0 only
    with pytest.raises(InvalidArgumentError, match=message):
        prepare_data(small, store, ["features"], ["label"], validation=validation, num_proc=2)
    assert len(writes) == 1
    assert not os.path.exists(store.prefix)  # the store root was created by the call: gone


def test_nulls_are_refused_and_cleaned_up(spark_local, store, writes):
    os.makedirs(store.get_data_path("other-key"))
    before = _listing(store.prefix)
    data = spark_local.createDataFrame([(float(i), None if i == 3 else 1.0) for i in range(8)],
                                       "x double, y double")
    with pytest.raises(InvalidArgumentError, match=r"^column 'y' has null values; training "
                                                   r"data must not contain nulls"):
        prepare_data(data, store, ["x"], ["y"])
    assert _listing(store.prefix) == before and len(writes) == 1


def _vectors(spark, sizes, nulls=()):
    from pyspark.ml.linalg import Vectors
    rows = [(i, None if i in nulls else Vectors.dense([1.0] * n), float(i % 2))
            for i, n in enumerate(sizes)]
    return spark.createDataFrame(rows, ["id", "features", "label"]).repartition(2)


def _nan_at(element):
    """The features Vector of row 3 with NaN at ``element`` (as a Vector again)."""
    from pyspark.ml.functions import array_to_vector, vector_to_array
    from pyspark.sql import functions as F
    return array_to_vector(F.transform(
        vector_to_array("features"), lambda x, i: F.when((i == element) & (F.col("id") == 3),
                                                         F.lit(float("nan"))).otherwise(x)))


_RAGGED = (lambda s: _vectors(s, [4] * 10 + [5] + [4] * 9),
           r"^column 'features' has a row of length 5, expected 4 \(the length of the first "
           r"row\)")
_NULL_INSIDE = (lambda s: s.createDataFrame([(i, [float(i), None if i == 6 else 1.0])
                                             for i in range(8)], "id long, features array<double>"),
                r"^null values inside the arrays of 'features' \(1\)")


@pytest.mark.parametrize("make, message, writer", [
    _RAGGED + ("spark",),
    _RAGGED + ("arrow",),
    (lambda s: _vectors(s, [4] * 20, nulls={13}),
     r"^column 'features' has null values; training data must not contain nulls\. Drop or "
     r"fill them first, e\.g\. df\.na\.drop\(subset=\['features'\]\)\.$", "spark"),
    (lambda s: s.createDataFrame([(i, [[1, 2], [3, 4 + i]] if i != 5 else [[1, 2], [3]])
                                  for i in range(8)], "id long, features array<array<int>>"),
     r"^column 'features' has a row with an array of length 1 at depth 2, expected 2 ", "spark"),
    _NULL_INSIDE + ("spark",),
    _NULL_INSIDE + ("arrow",),
    (lambda s: s.createDataFrame([(float("-inf") if i == 5 else float(i), [1.0, 2.0])
                                  for i in range(8)], "id double, features array<double>"),
     r"^column 'id' has the non-finite value -Infinity in a row of partition \d+ of the "
     r"DataFrame \(as Spark numbers them\); training on them gives a NaN loss\. .*"
     r"allow_nonfinite=True", "spark"),
    (lambda s: _vectors(s, [4] * 6).withColumn("features", _nan_at(2)),
     r"^column 'features' has the non-finite value NaN at element 2 in a row of partition",
     "arrow"),
    (lambda s: s.createDataFrame([(i, [[1.0, 2.0], [3.0, float("inf") if i == 3 else 4.0]])
                                  for i in range(8)], "id long, features array<array<float>>"),
     r"^column 'features' has the non-finite value Infinity at element \(in row-major order\) "
     r"3 in a row of partition", "spark"),
], ids=["ragged-spark", "ragged-arrow", "null-vector", "ragged-nested", "null-inside-spark",
        "null-inside-arrow", "inf-label", "nan-vector", "inf-nested"])
def test_ragged_rows_and_nulls_fail_the_write_naming_the_column(spark_local, store, writes,
                                                                 make, message, writer):
    """Caught while materializing, not by a rank seconds into training: the error names the
    column, the row's length and the expected one, or the non-finite value (a float label,
    a Vector's element, a nested array's) and where it is; nothing is left in the store."""
    with pytest.raises(InvalidArgumentError, match=message) as err:
        prepare_data(make(spark_local), store, ["features"], ["id"], writer=writer)
    assert "Py4J" not in str(err.value) and "at org.apache" not in str(err.value)
    assert len(writes) == 1 and not os.path.exists(store.prefix)


def test_an_unwritable_store_fails_before_any_write(df, tmp_path, writes):
    (tmp_path / "file").write_text("")
    store = Store.create(str(tmp_path / "file" / "store"))
    with pytest.raises(InvalidArgumentError, match=r"^the store file://.* is not writable: "):
        prepare_data(df, store, ["features"], ["label"])
    assert not writes


def test_the_arrow_writer_gives_the_reader_the_same_data(df, store, writes):
    """writer='arrow' (the executors write through the store, as for object stores): the same
    rows, splits and columns as Spark's writer, small row groups as asked."""
    by_spark = prepare_data(df, store, ["features", "id"], ["label"], "w", validation=0.25,
                            num_proc=2, seed=3)
    by_arrow = prepare_data(df, store, ["features", "id"], ["label"], "w", validation=0.25,
                            num_proc=2, seed=3, writer="arrow", cache=False,
                            row_group_size_bytes=1024)
    assert by_arrow.columns == by_spark.columns
    assert (by_arrow.train_rows, by_arrow.val_rows) == (by_spark.train_rows, by_spark.val_rows)
    for split in ("train", "val"):
        assert sorted(_ids(by_arrow, split, 2)[0]) == sorted(_ids(by_spark, split, 2)[0])
    files = [f for f in _listing(store.get_data_path(by_arrow.key)) if f.endswith(".parquet")]
    assert files and all(f.split("/")[-1].startswith("part-") for f in files)
    assert not [f for f in _listing(store.get_data_path(by_arrow.key)) if "tmp" in f]
    from spark_hvd.data import ParquetShardReader
    assert len(ParquetShardReader(by_arrow.train_path, rank=0, size=1,
                                  batch_size=8).row_groups) > len(files)


def test_the_arrow_writer_keeps_only_the_manifest(spark_local, store):
    """A file under the data directory that no successful task reported (what a failed or
    speculative attempt leaves) is removed once the job is done."""
    from estimators._arrow_writer import write_with_arrow
    split = materialize.SPLIT_COL
    rows = spark_local.createDataFrame(
        [(i, "val" if i % 3 == 0 else "train") for i in range(30)], f"x long, {split} string")
    base = store.get_data_path("k")
    stray = posixpath.join(base, f"{split}=train", "part-00007.parquet")

    class LeavesAStray:
        def mapInArrow(self, fn, schema):
            store.write_bytes_atomic(stray, b"from an attempt Spark gave up on")
            return rows.repartition(2).mapInArrow(fn, schema)

    manifest = write_with_arrow(LeavesAStray(), store, base, split, 1 << 20, None)
    assert sum(r["rows"] for r in manifest) == 30
    assert sorted(_listing(base)) == sorted(
        [f"{split}=train", f"{split}=val"]
        + [posixpath.relpath(r["path"], base) for r in manifest])
    assert not os.path.exists(stray)


def test_prepare_on_s3(df, spark_local, s3_endpoint, s3_url, writes):
    """An s3:// store (moto's server): the executors write the Parquet files through s3fs
    (Spark here has no S3 connector), the marker is reused, every row is read once."""
    s3 = Store.create(s3_url)
    with spark_s3_environment(spark_local, s3_endpoint):
        meta = prepare_data(df, s3, ["features", "id"], ["label"], validation=0.2, num_proc=2,
                            seed=5)
        again = prepare_data(df, s3, ["features", "id"], ["label"], validation=0.2,
                             num_proc=2, seed=5)
    assert again == meta and len(writes) == 1 and writes[0][3] == "arrow"
    assert meta.train_path.startswith(s3.prefix + "/intermediate_train_data/")
    assert s3.exists(posixpath.join(s3.get_data_path(meta.key), META_FILE))
    clone = pickle.loads(pickle.dumps(meta))  # as the ranks get it
    train, _ = _ids(clone, "train", 2)
    val, _ = _ids(clone, "val", 2)
    assert sorted(train + val) == list(range(N)) and not set(train) & set(val)


def test_validate_dataframe_returns_column_info(df):
    info = validate_dataframe(df, ["features", "id"], "label", "w", "is_val", num_proc=2)
    assert list(info) == ["features", "id", "label", "w", "is_val"]
    assert info["features"].kind == "vector" and info["features"].role == "feature"
    assert info["is_val"].role == "validation"


def test_arrays_and_float32_vectors(spark_local, store):
    data = spark_local.createDataFrame(
        [(i, [float(i), 2.0 * i, 3.0], [[1, 2], [3, i]]) for i in range(6)],
        "id long, arr array<double>, nested array<array<int>>")
    meta = prepare_data(data, store, ["arr", "nested"], ["id"], num_proc=2)
    assert (meta.columns["arr"].dtype, meta.columns["arr"].shape) == ("float64", (3,))
    assert (meta.columns["nested"].dtype, meta.columns["nested"].shape) == ("int32", (2, 2))
    batch = next(iter(meta.make_reader(rank=0, size=1, batch_size=6).epoch(0)))
    assert batch["nested"].shape == (6, 2, 2)
    assert np.array_equal(batch["nested"][:, 1, 1], batch["id"].astype(np.int32))


def test_data_meta_json_round_trip(df, store):
    meta = prepare_data(df, store, ["features"], ["label"], num_proc=1, vector_dtype="float32")
    assert meta.columns["features"].dtype == "float32"
    again = DataMeta.from_json(meta.to_json(), store=meta.store)
    assert again == meta
