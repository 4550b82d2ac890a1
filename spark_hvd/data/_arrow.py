"""Arrow -> numpy, column by column, without a per-row Python loop.

* Primitive columns (ints, floats) come out zero-copy: the numpy array is a read-only view of
  the Arrow buffer.  Booleans are bit-packed in Arrow, so they are copied once.
* List columns (``list``, ``large_list``, ``fixed_size_list``, as Spark writes arrays and
  ``vector_to_array`` results) become ``(rows, width, ...)`` arrays: the flattened child
  values are converted (zero-copy for primitives) and reshaped.  Every row must have the same
  width; nested lists give 3-D and deeper arrays.
* Nulls in numeric and list columns are refused with the column name and the fix: a silent
  NaN or a ragged row is worse than an early error.
* Other types (strings, timestamps...) fall back to ``to_numpy(zero_copy_only=False)``.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.types as pat

from ..exceptions import InvalidArgumentError

_VECTOR_FIELDS = {"type", "size", "indices", "values"}


def _is_list(t: pa.DataType) -> bool:
    return pat.is_list(t) or pat.is_large_list(t) or pat.is_fixed_size_list(t)


def _fail_nulls(name: str, arr: pa.Array, where: str) -> None:
    raise InvalidArgumentError(
        f"column '{name}' has {arr.null_count} null value(s){where}; training data must "
        f"not contain nulls. Drop or fill them before training, e.g. "
        f"df.na.drop(subset=['{name}']) or df.na.fill(...).")


def _list_to_numpy(name: str, arr: pa.Array, where: str) -> np.ndarray:
    n = len(arr)
    if pat.is_fixed_size_list(arr.type):
        width = arr.type.list_size
    else:
        offsets = arr.offsets.to_numpy()
        widths = np.diff(offsets)
        width = int(widths[0]) if n else 0
        if n and (widths.min() != width or widths.max() != width):
            raise InvalidArgumentError(
                f"column '{name}' holds arrays of different lengths (from {int(widths.min())} "
                f"to {int(widths.max())}){where}; a column becomes one (rows, width) tensor, "
                f"so every row needs the same length. Pad or truncate the arrays, or, for "
                f"Vectors, make them all the same size.")
    values = arr.flatten()
    inner = array_to_numpy(name, values, where)
    return inner.reshape((n, width) + inner.shape[1:])


def array_to_numpy(name: str, arr: pa.Array, where: str = "") -> np.ndarray:
    """One Arrow array as a numpy array (see the module docstring for the rules)."""
    t = arr.type
    if pat.is_dictionary(t):
        arr = arr.dictionary_decode()
        t = arr.type
    if pat.is_struct(t) and _VECTOR_FIELDS <= {f.name for f in t}:
        raise InvalidArgumentError(
            f"column '{name}' is a Spark ML Vector stored as a struct; convert it before "
            f"writing with pyspark.ml.functions.vector_to_array(col) (prepare_data does this).")
    if _is_list(t):
        if arr.null_count:
            _fail_nulls(name, arr, where)
        return _list_to_numpy(name, arr, where)
    if pat.is_integer(t) or pat.is_floating(t) or pat.is_boolean(t):
        if arr.null_count:
            _fail_nulls(name, arr, where)
        return arr.to_numpy(zero_copy_only=False)
    return arr.to_numpy(zero_copy_only=False)


def column_to_numpy(name: str, col: pa.ChunkedArray, where: str = "") -> np.ndarray:
    """A (chunked) table column as one numpy array; concatenates only if it has many chunks."""
    chunks = col.chunks
    if len(chunks) == 1:
        return array_to_numpy(name, chunks[0], where)
    if not chunks:
        return array_to_numpy(name, pa.array([], type=col.type), where)
    return np.concatenate([array_to_numpy(name, c, where) for c in chunks])


def table_to_numpy(table: pa.Table, columns: Optional[Sequence[str]] = None,
                   where: str = "") -> Dict[str, np.ndarray]:
    """A table as ``{column: numpy array}`` in ``columns`` order (all columns by default)."""
    names = list(columns) if columns is not None else table.column_names
    return {n: column_to_numpy(n, table.column(n), where) for n in names}


def numpy_dtype_of(t: pa.DataType) -> Optional[np.dtype]:
    """The numpy dtype a column of Arrow type ``t`` converts to (leaf type for lists)."""
    while _is_list(t):
        t = t.value_type
    if pat.is_dictionary(t):
        t = t.value_type
    try:
        return np.dtype(t.to_pandas_dtype())
    except (NotImplementedError, TypeError):
        return None
