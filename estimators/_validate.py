"""Check a DataFrame against the estimator's columns before any Spark job runs.

Everything here reads only the schema, except the final row check: one ``limit(num_proc)``
count, which stops as soon as it has found ``num_proc`` rows.
"""

from __future__ import annotations

import difflib
import numbers
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

from pyspark.sql import types as T

from spark_hvd.exceptions import InvalidArgumentError

SUPPORTED_TYPES = ("numeric scalars (byte, short, int, long, float, double, decimal), boolean, "
                   "Spark ML Vectors (dense or sparse) and arrays of numerics")

_HINTS = {
    "string": "index it first, e.g. pyspark.ml.feature.StringIndexer, or cast it to a number",
    "timestamp": "convert it to a number first, e.g. F.unix_timestamp(col)",
    "date": "convert it to a number first, e.g. F.datediff(col, F.lit('1970-01-01'))",
    "binary": "decode it into an array of numbers first",
    "map": "turn it into an array or separate numeric columns first",
    "struct": "select its numeric fields as separate columns first",
}


@dataclass(frozen=True)
class ColumnInfo:
    """What the validation found out about one column.

    ``kind`` is ``"scalar"`` (numbers, booleans), ``"vector"`` (pyspark.ml Vector) or
    ``"array"`` (array of numbers, possibly nested); ``role`` is ``"feature"``, ``"label"``,
    ``"sample_weight"`` or ``"validation"``.
    """

    name: str
    role: str
    kind: str
    spark_type: str


def as_column_list(value: Union[str, Sequence[str], None], what: str,
                   allow_empty: bool = False) -> List[str]:
    """``"a"`` -> ``["a"]``; a list of names as a list; anything else is an error."""
    if value is None:
        cols: List[str] = []
    elif isinstance(value, str):
        cols = [value]
    else:
        try:
            cols = list(value)
        except TypeError:
            cols = [value]  # type: ignore[list-item]
    if any(not isinstance(c, str) or not c for c in cols):
        raise InvalidArgumentError(f"{what} must be column names (strings), got {value!r}")
    if not cols and not allow_empty:
        raise InvalidArgumentError(f"{what} must name at least one column, got {value!r}")
    return cols


def _is_vector(dt: T.DataType) -> bool:
    return isinstance(dt, T.UserDefinedType) and type(dt).__name__ == "VectorUDT"


def _is_numeric_scalar(dt: T.DataType) -> bool:
    return isinstance(dt, (T.NumericType, T.BooleanType))


def _is_numeric_array(dt: T.DataType) -> bool:
    while isinstance(dt, T.ArrayType):
        dt = dt.elementType
    return _is_numeric_scalar(dt)


def column_kind(dt: T.DataType) -> Optional[str]:
    """``"scalar"``, ``"vector"``, ``"array"``, or None when training cannot use the type."""
    if _is_numeric_scalar(dt):
        return "scalar"
    if _is_vector(dt):
        return "vector"
    if isinstance(dt, T.ArrayType) and _is_numeric_array(dt):
        return "array"
    return None


def _suggest(name: str, columns: Sequence[str]) -> str:
    matches = [c for c in columns if c.lower() == name.lower() and c != name]
    matches += [c for c in difflib.get_close_matches(name, columns, n=3, cutoff=0.6)
                if c not in matches]
    return f" (did you mean {', '.join(repr(m) for m in matches[:3])}?)" if matches else ""


def _type_hint(dt: T.DataType) -> str:
    hint = _HINTS.get(dt.typeName())
    return f"; {hint}" if hint else ""


def check_validation(validation: Any, fields: Dict[str, T.StructField]) -> Optional[ColumnInfo]:
    """Check ``validation`` (None, a fraction in [0, 1) or a column name)."""
    if validation is None:
        return None
    if isinstance(validation, bool) or not isinstance(validation, (numbers.Real, str)):
        raise InvalidArgumentError(
            f"validation must be a fraction in [0, 1) or the name of a boolean/0-1 column, "
            f"got {validation!r}")
    if isinstance(validation, str):
        if validation not in fields:
            raise InvalidArgumentError(
                f"validation column '{validation}' is not in the DataFrame"
                f"{_suggest(validation, list(fields))}; columns are {list(fields)}")
        dt = fields[validation].dataType
        if not _is_numeric_scalar(dt):
            raise InvalidArgumentError(
                f"validation column '{validation}' has type {dt.simpleString()}; it must be "
                f"boolean or numeric (true / non-zero = validation row)")
        return ColumnInfo(validation, "validation", "scalar", dt.simpleString())
    if not 0 <= float(validation) < 1:
        raise InvalidArgumentError(
            f"validation={validation!r} is not a fraction in [0, 1): use e.g. validation=0.1 "
            f"to keep 10% of the rows for validation, or a boolean column name")
    return None


def validate_dataframe(df: Any, feature_cols: Union[str, Sequence[str]],
                       label_cols: Union[str, Sequence[str], None],
                       sample_weight_col: Optional[str] = None, validation: Any = None, *,
                       num_proc: int = 1, check_rows: bool = True) -> Dict[str, ColumnInfo]:
    """Check columns, types, ``validation`` and (one small job) that there are enough rows.

    Returns ``{column: ColumnInfo}`` for the feature, label and sample-weight columns (and the
    validation column when ``validation`` names one), in that order.  Raises
    InvalidArgumentError naming the problem and the fix; nothing is written.
    """
    features = as_column_list(feature_cols, "feature_cols")
    labels = as_column_list(label_cols, "label_cols", allow_empty=True)
    if sample_weight_col is not None and (not isinstance(sample_weight_col, str)
                                          or not sample_weight_col):
        raise InvalidArgumentError(
            f"sample_weight_col must be a column name or None, got {sample_weight_col!r}")
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise InvalidArgumentError(f"num_proc must be an integer >= 1, got {num_proc!r}")
    schema = df.schema
    fields = {f.name: f for f in schema.fields}
    roles = [(c, "feature") for c in features] + [(c, "label") for c in labels]
    if sample_weight_col is not None:
        roles.append((sample_weight_col, "sample_weight"))
    named = roles + ([(validation, "validation")] if isinstance(validation, str) else [])
    check_unique(schema.fieldNames(), named, _case_sensitive(df))

    missing = [f"{role} column '{c}'{_suggest(c, list(fields))}"
               for c, role in roles if c not in fields]
    if missing:
        raise InvalidArgumentError(
            f"not in the DataFrame: {'; '.join(missing)}. Its columns are {list(fields)}.")

    info: Dict[str, ColumnInfo] = {}
    bad: List[str] = []
    for c, role in roles:
        dt = fields[c].dataType
        kind = column_kind(dt)
        if role == "sample_weight" and kind != "scalar":
            bad.append(f"sample_weight_col '{c}' has type {dt.simpleString()}, it must be a "
                       f"numeric scalar")
        elif kind is None:
            bad.append(f"{role} column '{c}' has type {dt.simpleString()}{_type_hint(dt)}")
        elif c not in info:
            info[c] = ColumnInfo(c, role, kind, dt.simpleString())
    if bad:
        raise InvalidArgumentError(
            f"unsupported column type(s): {'; '.join(bad)}. Supported: {SUPPORTED_TYPES}.")

    val_info = check_validation(validation, fields)
    if val_info is not None and val_info.name not in info:
        info[val_info.name] = val_info

    if check_rows:
        check_enough_rows(df, num_proc)
    return info


def _case_sensitive(df: Any) -> bool:
    """Spark's ``spark.sql.caseSensitive`` (false unless set: then ``Label`` and ``label``
    are one name to Spark)."""
    try:
        value = df.sparkSession.conf.get("spark.sql.caseSensitive", "false")
    except Exception:  # a session without this conf API
        return False
    return str(value).strip().lower() == "true"


def check_unique(names: Sequence[str], roles: Sequence[Any], case_sensitive: bool) -> None:
    """Each column in ``roles`` (``(name, role)`` pairs) is one column of the DataFrame, not
    two of the same name (a join's output), which Spark refuses to pick from
    (AMBIGUOUS_REFERENCE)."""
    def key(n: str) -> str:
        return n if case_sensitive else n.lower()
    counts: Dict[str, List[str]] = {}
    for n in names:
        counts.setdefault(key(n), []).append(n)
    dups = [(c, role, counts[key(c)]) for c, role in roles if len(counts.get(key(c), [])) > 1]
    if dups:
        c, role, same = dups[0]
        spelt = (f" ({', '.join(repr(s) for s in same)}: Spark compares names without case "
                 f"unless spark.sql.caseSensitive=true)" if len(set(same)) > 1 else "")
        raise InvalidArgumentError(
            f"the DataFrame has {len(same)} columns named '{c}' (the {role} column){spelt}, so "
            f"Spark cannot tell which one to use; its columns are {list(names)}. Fix: keep "
            f"one of them, e.g. after a join select the columns you need "
            f"(df.select(left['{c}'], ...)) or rename one with .alias() or "
            f"withColumnRenamed before joining")


def check_enough_rows(df: Any, num_proc: int) -> None:
    """One ``limit(num_proc).count()`` job: the DataFrame must have at least num_proc rows."""
    check_row_count(df.limit(num_proc).count(), num_proc)


def check_row_count(found: int, num_proc: int) -> None:
    """``found`` rows of a ``limit(num_proc)``: an error unless there are num_proc."""
    if found == 0:
        raise InvalidArgumentError(
            "the DataFrame is empty: there is nothing to train on. Check the filters and "
            "joins that produce it (df.count() should be > 0).")
    if found < num_proc:
        raise InvalidArgumentError(
            f"the DataFrame has {found} row(s), fewer than num_proc={num_proc}: every "
            f"process needs at least one row. Use num_proc <= {found} or more data.")
