"""Checks of every row, made inside the Spark job that writes the training data.

The dry run of ``fit`` builds the model for the shapes of the first row; a later row whose
array or Vector has another length, or a null, would make a rank fail seconds into training,
and a NaN or an infinity would train the model into NaN weights.  Each column the job writes
is therefore wrapped in ``CASE WHEN`` branches that call Spark's ``raise_error`` with a
message naming the column, the row's length and the expected one, or the non-finite value,
its place in the row and the task's partition (``checked_column``; the non-finite check is
skipped with ``allow_nonfinite``).  The checks run on the executors as the rows are written:
no extra pass over the data, and only ``size()`` for one-dimensional arrays (nested arrays also need
Spark's higher-order functions).  ``data_error`` turns the failed job back into one
InvalidArgumentError on the driver, without Spark's stack trace.  Nulls *inside* arrays are
counted from the Parquet footers after the write (materialize.py), which costs nothing.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

from pyspark.ml.linalg import Vector

from spark_hvd.exceptions import InvalidArgumentError

_TAG = "spark_hvd-row-check"
_MESSAGE = re.compile(f"<{_TAG}>(.*?)</{_TAG}>", re.DOTALL)


def row_shape(name: str, value: Any) -> tuple:
    """The per-row shape of a Vector or (nested) array value: its lengths, depth by depth,
    following the first element."""
    if value is None:
        raise InvalidArgumentError(
            f"column '{name}' is null in the first row; training data must not contain nulls. "
            f"Drop or fill them first, e.g. df.na.drop(subset=['{name}']).")
    if isinstance(value, Vector):
        return (value.size,)
    shape = []
    while isinstance(value, (list, tuple)):
        shape.append(len(value))
        value = value[0] if value else None
    return tuple(shape)


def _fail(*parts: Any) -> Any:
    from pyspark.sql import functions as F
    return F.raise_error(F.concat(F.lit(f"<{_TAG}>"), *parts, F.lit(f"</{_TAG}>")))


def checked_column(raw: Any, c: Any, name: str, shape: Sequence[int],
                   finite: bool = False) -> Any:
    """Column ``c`` (``raw`` converted: Vectors as arrays) as it is, or the job fails on the
    first row where ``raw`` is null or ``c``'s lengths differ from ``shape`` (the first
    row's; ``()`` for a scalar column: only nulls are checked), or, with ``finite`` (a
    floating-point column), where a value of ``c`` is NaN or infinite.  The null test comes
    first, on ``raw``: ``vector_to_array`` itself fails on a null, with a Java stack trace."""
    from pyspark.sql import functions as F
    lit = F.lit
    no_nulls = (f"training data must not contain nulls. Drop or fill them first, e.g. "
                f"df.na.drop(subset=['{name}'])")
    expr = F.when(raw.isNull(), _fail(lit(f"column '{name}' has null values; {no_nulls}")))
    if shape:
        expr = expr.when(F.size(c) != shape[0], _fail(
            lit(f"column '{name}' has a row of length "), F.size(c).cast("string"),
            lit(f", expected {shape[0]} (the length of the first row); every row of an array "
                f"or Vector column must have the same length. Pad or trim the rows, or filter "
                f"out the others, e.g. df.filter(F.size('{name}') == {shape[0]})")))
    arrays = F.array(c)  # the arrays at depth 0, then 1...: flatten() goes one level down
    for depth, width in enumerate(shape[1:], start=2):
        arrays = F.flatten(arrays)
        lengths = F.transform(arrays, lambda a: F.coalesce(F.size(a), lit(-1)))
        wrong = F.get(F.filter(lengths, lambda n: n != width), 0)  # null when none
        expr = expr.when(F.exists(arrays, lambda a: a.isNull()), _fail(lit(
            f"column '{name}' has a null array at depth {depth}; {no_nulls}")))
        expr = expr.when(wrong.isNotNull(), _fail(
            lit(f"column '{name}' has a row with an array of length "), wrong.cast("string"),
            lit(f" at depth {depth}, expected {width} (as in the first row, whose shape is "
                f"{tuple(shape)}); every row must have the same shape")))
    if finite:
        expr = _nonfinite_check(expr, c, name, len(shape))
    return expr.otherwise(c)


def _nonfinite_check(expr: Any, c: Any, name: str, depth: int) -> Any:
    """``expr`` with one more branch: the job fails on a row of ``c`` (a floating-point
    scalar, or arrays ``depth`` deep) holding NaN or an infinity, naming the value, where
    it is in the row and the task's partition.  The value and position are computed only
    for that row (a CASE WHEN branch's value); every row pays one ``exists`` over its
    elements."""
    from pyspark.sql import functions as F
    lit = F.lit

    def bad(x: Any) -> Any:
        return F.isnan(x) | (F.abs(x) == lit(float("inf")))

    fix = (f"training on them gives a NaN loss. Drop or fill those rows first (e.g. "
           f"df.na.drop(subset=['{name}']) for scalars, df.filter(~F.exists('{name}', lambda x: "
           f"F.isnan(x))) for arrays), or pass allow_nonfinite=True if the model and loss "
           f"handle them")
    where = [lit(" in a row of partition "), F.spark_partition_id().cast("string"),
             lit(" of the DataFrame (as Spark numbers them); ")]
    if depth == 0:
        return expr.when(bad(c), _fail(lit(f"column '{name}' has the non-finite value "),
                                       c.cast("string"), *where, lit(fix)))
    flat = c
    for _ in range(depth - 1):
        flat = F.flatten(flat)
    # The first bad element's index: array_min skips the nulls of the good ones.
    index = F.array_min(F.transform(flat, lambda x, i: F.when(bad(x), i)))
    at = "element " if depth == 1 else "element (in row-major order) "
    return expr.when(F.exists(flat, bad), _fail(
        lit(f"column '{name}' has the non-finite value "), F.get(flat, index).cast("string"),
        lit(f" at {at}"), index.cast("string"), *where, lit(fix)))


def is_floating(dt: Any) -> bool:
    """Whether a Spark type is float or double, or an array (of arrays...) of them; Spark
    ML Vectors hold doubles."""
    from pyspark.sql import types as T
    if type(dt).__name__ == "VectorUDT":
        return True
    while isinstance(dt, T.ArrayType):
        dt = dt.elementType
    return isinstance(dt, (T.FloatType, T.DoubleType))


def data_error(exc: BaseException) -> Optional[InvalidArgumentError]:
    """The InvalidArgumentError a row check raised inside the failed Spark job ``exc``."""
    found = _MESSAGE.search(str(exc))
    if found is None:
        return None
    return InvalidArgumentError(found.group(1) + ".")
