"""DataFrame -> Parquet in the Store, written by Spark, read back by spark_hvd.data.

``prepare_data`` does, in order:

1. Validate (``validate_dataframe``: columns, once each, types, ``validation``; not again
   when the caller passes its result, as fit does).  Nothing is written before all of it
   passed.
2. Key: a hash of the DataFrame's analyzed plan and every option that changes the output.
   If ``<dir>/_spark_hvd_meta.json`` exists for that key, the earlier write is reused as is
   (Petastorm's converter semantics: the cache follows the plan, not the data; if the files
   under an unchanged plan change, pass ``cache=False`` or build a new DataFrame).  ``<dir>``
   is ``<store>/intermediate_train_data/<key>``, or ``<parentCacheDirUrl>/<key>`` when the Spark
   conf ``petastorm.spark.converter.parentCacheDirUrl`` is set.
3. One ``limit(num_proc)`` job: enough rows for every rank, and the first row's shape of
   each array and Vector column (no job when the caller passes that first row: fit has it
   from its own checks).  Then the target must be writable (``Store.check_writable``:
   an error naming the store and the fix, not a Java stack trace from the job; not again
   when the caller has just checked the store, as fit has).
4. One Spark job writes everything: the needed columns only, Vectors turned into arrays by
   ``vector_to_array``, decimals cast to double, and a split column (``rand(seed) <
   validation`` or the validation column), so the train and validation sets are disjoint and
   complete by construction and the input is computed once.  Every row is checked as it is
   written (``_data_checks.py``): a null, an array or Vector whose length differs from the
   first row's, or (unless ``allow_nonfinite``) a NaN or infinite value of a floating-point
   column, fails the job with an error naming the column and what it found.  The writer
   (``writer=``) is Spark's (``partitionBy``, ``parquet.block.size`` for the row groups) for
   local, DBFS and HDFS stores, and the executors' own pyarrow through the Store for object
   stores (``_arrow_writer.py``: no Hadoop connector jar, and no rename-based commit).
5. Row counts, nulls inside arrays, per-row shapes and the value range of integer label
   columns come from the Parquet footers and the first row.
6. The marker file is written last (atomically).  If anything fails after the write started,
   the key's directory, and any parent directory this call created, are removed.

Two calls writing the same key at the same moment are not coordinated (the second overwrites
the first); run one fit per DataFrame and options at a time, or pass ``cache=False``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import posixpath
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pyarrow.parquet as pq

from spark_hvd.data import list_parquet_files
from spark_hvd.data import numpy_dtype_of, table_to_numpy
from spark_hvd.exceptions import InvalidArgumentError

from ._arrow_writer import codec, write_with_arrow
from ._data_checks import checked_column, data_error, is_floating, row_shape
from ._validate import ColumnInfo, as_column_list, check_row_count, validate_dataframe
from ._data_meta import FORMAT_VERSION, ColumnMeta, DataMeta
from .store import Store

logger = logging.getLogger(__name__)

PARENT_CACHE_DIR_CONF = "petastorm.spark.converter.parentCacheDirUrl"
META_FILE = "_spark_hvd_meta.json"
SPLIT_COL = "__spark_hvd_split"
DEFAULT_ROW_GROUP_SIZE_BYTES = 32 * 1024 * 1024
WRITERS = ("spark", "arrow")

__all__ = ["ColumnMeta", "DataMeta", "prepare_data", "validate_dataframe", "ColumnInfo"]


def _plan_fingerprint(df: Any) -> Optional[str]:
    """The analyzed plan (classic Spark), else the semantic hash (Spark Connect), else None."""
    try:
        jdf = df._jdf
    except Exception:  # Spark Connect: no JVM handle (may raise on attribute access)
        jdf = None
    if jdf is not None:
        try:
            return "plan:" + jdf.queryExecution().analyzed().toString()
        except Exception as exc:  # a py4j error: fall through to the semantic hash
            logger.debug("no analyzed plan for the cache key: %s", exc)
    semantic_hash = getattr(type(df), "semanticHash", None)
    if semantic_hash is not None:
        try:
            return f"semantic:{semantic_hash(df)}"
        except Exception as exc:
            logger.debug("no semantic hash for the cache key: %s", exc)
    return None


def _cache_key(df: Any, options: Dict[str, Any], cache: bool) -> Tuple[str, bool]:
    fingerprint = _plan_fingerprint(df) if cache else None
    if fingerprint is None:
        return "nocache-" + uuid.uuid4().hex[:24], False
    blob = json.dumps({"plan": fingerprint, "schema": df.schema.json(), "options": options,
                       "format": FORMAT_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32], True


def _target(df: Any, store: Store, key: str) -> Tuple[Store, str, List[str]]:
    """The Store and directory for ``key``, and the directories on the way (outermost first)."""
    try:
        parent = df.sparkSession.conf.get(PARENT_CACHE_DIR_CONF, None)
    except Exception:  # a session without this conf API
        parent = None
    if parent:
        target = Store.create(parent)
        return target, target.join(key), [target.prefix]
    return store, store.get_data_path(key), [store.prefix, store.get_data_path("")]


def _col(name: str) -> Any:
    from pyspark.sql import functions as F
    return F.col("`" + name.replace("`", "``") + "`")


def _output_frame(df: Any, info: Dict[str, ColumnInfo], validation: Any, seed: int,
                  vector_dtype: str, num_partitions: Optional[int],
                  shapes: Dict[str, Tuple[int, ...]], allow_nonfinite: bool = False) -> Any:
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    fields = {f.name: f.dataType for f in df.schema.fields}
    select = []
    for name, ci in info.items():
        if ci.role == "validation":
            continue
        raw = c = _col(name)
        if ci.kind == "vector":
            c = vector_to_array(c, dtype=vector_dtype)
        elif isinstance(fields[name], T.DecimalType):
            c = c.cast("double")
        finite = not allow_nonfinite and is_floating(fields[name])
        select.append(checked_column(raw, c, name, shapes.get(name, ()), finite).alias(name))
    if isinstance(validation, str):
        flag = _col(validation)
        is_val = F.coalesce(flag if isinstance(fields[validation], T.BooleanType)
                            else flag != 0, F.lit(False))
    elif validation:
        is_val = F.rand(seed) < F.lit(float(validation))
    else:
        is_val = F.lit(False)
    out = df.select(*select, F.when(is_val, "val").otherwise("train").alias(SPLIT_COL))
    return out.repartition(num_partitions) if num_partitions is not None else out


def _first_row_shapes(df: Any, info: Dict[str, ColumnInfo], num_proc: int,
                      first_row: Any = None) -> Dict[str, Tuple[int, ...]]:
    """The first row's shape of every array and Vector column; without ``first_row``, from
    one ``limit(num_proc)`` job, which also needs num_proc rows (else the error)."""
    from pyspark.sql import functions as F
    names = [n for n, ci in info.items() if ci.kind in ("vector", "array")]
    if first_row is None:
        rows = df.select(*[_col(n) for n in names] or [F.lit(1)]).limit(num_proc).collect()
        check_row_count(len(rows), num_proc)
        first_row = rows[0]
    return {n: row_shape(n, first_row[n]) for n in names}


def _write_parquet(out: Any, target: Store, base: str, writer: str, row_group_size_bytes: int,
                   compression: Optional[str]) -> None:
    """Step 4's write, by Spark or by the executors through the Store; a row check's failure
    becomes its InvalidArgumentError."""
    try:
        if writer == "arrow":
            write_with_arrow(out, target, base, SPLIT_COL, row_group_size_bytes, compression)
            return
        spark_writer = (out.write.mode("overwrite")
                        .option("parquet.block.size", str(row_group_size_bytes)))
        if compression is not None:
            spark_writer = spark_writer.option("compression", compression)
        spark_writer.partitionBy(SPLIT_COL).parquet(target.to_spark_path(base))
    except Exception as exc:
        error = data_error(exc)
        if error is None:
            raise
        raise error from None


def _describe(target: Store, path: str, info: Dict[str, ColumnInfo]) -> Tuple[int, Dict[str, Any]]:
    """Rows, null counts of scalar columns, the first row's arrays and the value ranges of
    integer label columns, from the footers."""
    fs, files = list_parquet_files(path, target.filesystem)
    rows, nulls = 0, {}
    ranges: Dict[str, Any] = {n: [None, None] for n, ci in info.items() if ci.role == "label"}
    first: Optional[Tuple[str, int, Any]] = None
    for f in files:
        md = pq.read_metadata(f, filesystem=fs)
        rows += md.num_rows
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            if rg.num_rows and first is None:
                first = (f, g, md)
            for j in range(rg.num_columns):
                col = rg.column(j)
                path = col.path_in_schema  # "x.list.element": the elements of x's arrays
                name = next((n for n in info if path == n or path.startswith(n + ".")), None)
                st = col.statistics
                if name and st is not None and st.has_null_count and st.null_count:
                    nulls[name] = nulls.get(name, 0) + st.null_count
                if name in ranges and rg.num_rows:
                    _widen(ranges, name, col.physical_type, st)
    shapes: Dict[str, Any] = {}
    if first is not None:
        f, g, md = first
        names = [n for n in info if info[n].role != "validation"]
        table = pq.ParquetFile(f, filesystem=fs, metadata=md).read_row_group(g, columns=names)
        arrays = table_to_numpy(table.slice(0, 1), names, f" in '{f}'")
        shapes = {n: (str(a.dtype), tuple(a.shape[1:])) for n, a in arrays.items()}
        schema = md.schema.to_arrow_schema()
        for n in names:  # scalars: the Parquet type, not a row's value, says the dtype
            if info[n].kind == "scalar":
                dt = numpy_dtype_of(schema.field(n).type)
                shapes[n] = (str(dt) if dt is not None else shapes[n][0], ())
    return rows, {"nulls": nulls, "shapes": shapes, "ranges": ranges}


def _widen(ranges: Dict[str, Any], name: str, physical_type: str, st: Any) -> None:
    """Widen ``ranges[name]`` by a column chunk's statistics; a chunk without them (or not
    of integers) makes the range unknown for good (``False``)."""
    span = ranges[name]
    if span[0] is False:
        return
    if physical_type not in ("INT32", "INT64") or st is None or not st.has_min_max:
        ranges[name] = [False, False]
        return
    lo, hi = int(st.min), int(st.max)
    ranges[name] = [lo if span[0] is None else min(span[0], lo),
                    hi if span[1] is None else max(span[1], hi)]


def _value_range(*found: Dict[str, Any], name: str) -> Optional[Tuple[int, int]]:
    """``name``'s range over the splits' ``_describe`` results (None: unknown)."""
    spans = [f["ranges"][name] for f in found if name in f["ranges"]]
    if any(sp[0] is False for sp in spans):
        return None
    spans = [sp for sp in spans if sp[0] is not None]  # [None, None]: a split without rows
    if not spans:
        return None
    return (min(sp[0] for sp in spans), max(sp[1] for sp in spans))


def _remove_created(target: Store, base: str, parents: List[str], existed: List[bool]) -> None:
    try:
        target.delete(base)
        for p, had in reversed(list(zip(parents, existed))):
            if not had and target.exists(p) and not target.listdir(p):
                target.filesystem.delete_dir(p)
    except Exception as exc:  # never hide the original error
        logger.warning("could not remove the partial data under %s: %s", base, exc)


def _check_int(name: str, value: Any, minimum: Optional[int]) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or \
            (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise InvalidArgumentError(f"{name} must be an integer{bound}, got {value!r}")


def prepare_data(df: Any, store: Store, feature_cols: Sequence[str],
                 label_cols: Sequence[str], sample_weight_col: Optional[str] = None,
                 validation: Any = None, *, num_proc: int = 1, seed: int = 0,
                 num_partitions: Optional[int] = None,
                 row_group_size_bytes: int = DEFAULT_ROW_GROUP_SIZE_BYTES,
                 vector_dtype: str = "float64", compression: Optional[str] = None,
                 cache: bool = True, writer: Optional[str] = None,
                 allow_nonfinite: bool = False, first_row: Any = None,
                 column_info: Optional[Dict[str, ColumnInfo]] = None,
                 store_checked: bool = False) -> DataMeta:
    """Write the columns training needs as Parquet into the Store (or reuse an earlier write).

    Parameters
    ----------
    df : pyspark.sql.DataFrame
    store : Store
    feature_cols, label_cols : list of str
    sample_weight_col : str, optional
    validation : float in [0, 1) or str, optional
        A fraction of rows (drawn with ``seed``) or a boolean / 0-1 column (true or non-zero:
        validation row; null: training row).
    num_proc : int
        Ranks that will read the data: each split needs at least that many rows.
    num_partitions : int, optional
        Repartition to this many partitions (about as many files per split) before writing.
        By default the DataFrame's partitioning is kept: the reader shards by rows, not by
        file or row group, so every rank gets ``rows // num_proc`` or one more row whatever
        the file layout, and finding the current partition count would run the query early
        under adaptive execution.  Repartition when the DataFrame has very few partitions
        (a slow, serial write) or very many tiny ones.
    row_group_size_bytes : int
        Parquet ``parquet.block.size``.
    vector_dtype : {"float64", "float32"}
        Element type of Vector columns after ``vector_to_array``.
    cache : bool
        Reuse an earlier write of the same plan and options (see the module docstring).
    writer : {"spark", "arrow"}, optional
        Who writes the Parquet files: Spark's writer (to ``store.to_spark_path``), or each
        executor through the Store with pyarrow (see ``_arrow_writer.py``).  By default
        ``"arrow"`` for object stores (s3, gs, abfss...: no Hadoop connector needed) and
        ``"spark"`` for the others.  Both give the same files to the reader.
    allow_nonfinite : bool
        Let NaN and infinite values of floating-point columns through; by default a row
        holding one fails the write with an error naming the column, the value and where it
        is (the check runs with the others of step 4, in the same job).
    first_row : Row, optional
        The first row of a ``limit(num_proc)`` of ``df`` with the feature, label and weight
        columns, when the caller already ran that job and checked its row count (fit does):
        step 3's job is then not run again.
    column_info : dict, optional
        What ``validate_dataframe`` returned for these arguments, when the caller already ran
        it (fit does): step 1 is then not run again.
    store_checked : bool
        The caller has just checked ``store.check_writable()`` (fit does): step 3 does not
        check it again (it still checks a parent cache directory of the Spark conf).

    Returns
    -------
    DataMeta
    """
    feature_cols = as_column_list(feature_cols, "feature_cols")
    label_cols = as_column_list(label_cols, "label_cols", allow_empty=True)
    _check_int("row_group_size_bytes", row_group_size_bytes, 1)
    _check_int("seed", seed, None)
    if num_partitions is not None:
        _check_int("num_partitions", num_partitions, 1)
    if vector_dtype not in ("float64", "float32"):
        raise InvalidArgumentError(
            f"vector_dtype must be 'float64' or 'float32', got {vector_dtype!r}")
    if writer not in (None,) + WRITERS:
        raise InvalidArgumentError(f"writer must be one of {WRITERS} or None, got {writer!r}")
    if not isinstance(store, Store):
        raise InvalidArgumentError(
            f"store must be a Store (e.g. Store.create('/path')), got {type(store).__name__}")
    if not isinstance(allow_nonfinite, bool):
        raise InvalidArgumentError(f"allow_nonfinite must be True or False, got "
                                   f"{allow_nonfinite!r}")
    info = column_info if column_info is not None else validate_dataframe(
        df, feature_cols, label_cols, sample_weight_col, validation, num_proc=num_proc,
        check_rows=False)
    has_val = isinstance(validation, str) or bool(validation)
    options = {"features": feature_cols, "labels": label_cols, "weight": sample_weight_col,
               "validation": validation,
               "seed": seed if has_val and not isinstance(validation, str) else None,
               "num_partitions": num_partitions,
               "row_group_size_bytes": row_group_size_bytes, "vector_dtype": vector_dtype,
               "compression": compression, "allow_nonfinite": allow_nonfinite}
    key, cacheable = _cache_key(df, options, cache)
    target, base, parents = _target(df, store, key)
    writer = writer or ("arrow" if target.object_store else "spark")
    if writer == "arrow":
        codec(compression)  # an unknown codec fails here, before any job
    marker = posixpath.join(base, META_FILE)

    if cacheable and target.exists(marker):
        try:
            meta = DataMeta.from_json(target.read_bytes(marker).decode(), store=target)
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring the unreadable %s (%s); writing again", marker, exc)
        else:
            if target.exists(meta.train_path):
                logger.info("reusing the training data written earlier under %s", base)
                _check_split_rows(meta.train_rows, meta.val_rows, has_val, validation, num_proc)
                return dataclasses.replace(meta, num_proc=num_proc)

    # After the cache lookup: a reuse needs no Spark job.
    shapes = _first_row_shapes(df, info, num_proc, first_row)
    if not (store_checked and target is store):
        target.check_writable()
    existed = [target.exists(p) for p in parents]
    out = _output_frame(df, info, validation, seed, vector_dtype, num_partitions, shapes,
                        allow_nonfinite)
    try:
        _write_parquet(out, target, base, writer, row_group_size_bytes, compression)
        meta = _inspect(target, base, key, info, feature_cols, label_cols, sample_weight_col,
                        has_val, validation, num_proc)
        target.write_bytes_atomic(marker, meta.to_json().encode())
    except BaseException:
        _remove_created(target, base, parents, existed)
        raise
    return meta


def _check_split_rows(train_rows: int, val_rows: int, has_val: bool, validation: Any,
                      num_proc: int) -> None:
    if train_rows < num_proc:
        raise InvalidArgumentError(
            f"the training split has {train_rows} row(s), fewer than num_proc={num_proc}. "
            f"Use a smaller validation share, num_proc <= {train_rows}, or more data.")
    if has_val and val_rows < num_proc:
        raise InvalidArgumentError(
            f"validation={validation!r} selected {val_rows} row(s), fewer than "
            f"num_proc={num_proc}: every process needs a validation row. Use a larger "
            f"validation share, more data, or validation=None.")


def _inspect(target: Store, base: str, key: str, info: Dict[str, ColumnInfo],
             feature_cols: List[str], label_cols: List[str], sample_weight_col: Optional[str],
             has_val: bool, validation: Any, num_proc: int) -> DataMeta:
    train_path = posixpath.join(base, f"{SPLIT_COL}=train")
    val_path = posixpath.join(base, f"{SPLIT_COL}=val")
    if not target.exists(train_path):
        raise InvalidArgumentError(
            f"validation={validation!r} put every row in the validation set; nothing is "
            f"left to train on. Use a smaller fraction or a column that is false for most rows.")
    train_rows, found = _describe(target, train_path, info)
    val_rows, val_found = (_describe(target, val_path, info) if target.exists(val_path)
                           else (0, {"nulls": {}, "shapes": {}, "ranges": {}}))
    nulls = {n: found["nulls"].get(n, 0) + val_found["nulls"].get(n, 0)
             for n in set(found["nulls"]) | set(val_found["nulls"])}
    if nulls:  # the rows were checked while written: these are nulls inside arrays
        listing = ", ".join(f"'{n}' ({c})" for n, c in sorted(nulls.items()))
        raise InvalidArgumentError(
            f"null values inside the arrays of {listing}; training data must not contain "
            f"nulls. Replace them first, e.g. F.transform('{min(nulls)}', lambda x: "
            f"F.coalesce(x, F.lit(0.0))), or drop those rows.")
    _check_split_rows(train_rows, val_rows, has_val, validation, num_proc)
    columns = {}
    for name, ci in info.items():
        if ci.role == "validation":
            continue
        dtype, shape = found["shapes"][name]
        span = _value_range(found, val_found, name=name) if ci.role == "label" else None
        columns[name] = ColumnMeta(name, dtype, shape, ci.kind, ci.spark_type, span)
    return DataMeta(key=key, train_path=train_path, val_path=val_path if has_val else None,
                    train_rows=train_rows, val_rows=val_rows if has_val else 0,
                    columns=columns, feature_cols=feature_cols, label_cols=label_cols,
                    sample_weight_col=sample_weight_col, num_proc=num_proc, store=target)
