"""What ``fit`` checks on the driver before any rank starts, apart from the params: the zero
batch of the dry run, ``input_shapes``/``label_shapes`` against the data's shapes, and the
errors of the dry run, the checkpoint check and the label check (see ``_estimator_base``;
the frameworks' dry runs are in ``torch_estimator.py`` and ``keras_estimator.py``).
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from spark_hvd.exceptions import InvalidArgumentError

from ._data_checks import row_shape
from ._trainer_common import apply_transformation

_SPARK_NUMPY = {"double": np.float64, "float": np.float32, "decimal": np.float64,
                "bigint": np.int64, "int": np.int32, "smallint": np.int16, "tinyint": np.int8,
                "boolean": np.bool_}


def zero_batch(df: Any, first: Any, columns: Sequence[str], rows: int = 2
               ) -> Dict[str, np.ndarray]:
    """Zeros shaped like ``rows`` rows of each column as the reader will deliver them."""
    from pyspark.ml.linalg import Vector
    from pyspark.sql import types as T
    fields = {f.name: f.dataType for f in df.schema.fields}
    out = {}
    for c in columns:
        value, dt = first[c], fields[c]
        shape = row_shape(c, value)  # a null is an error
        if isinstance(value, Vector):
            dtype = np.float64
        else:
            while isinstance(dt, T.ArrayType):
                dt = dt.elementType
            dtype = _SPARK_NUMPY.get(dt.simpleString().split("(")[0], np.float64)
        out[c] = np.zeros((rows,) + shape, dtype=dtype)
    return out


def describe_arrays(arrays: Dict[str, Any], cols: Sequence[str]) -> str:
    return ", ".join(f"'{c}' {tuple(arrays[c].shape)} {arrays[c].dtype}" for c in cols)


def transformed(p: Dict[str, Any], zeros: Dict[str, np.ndarray]) -> Dict[str, Any]:
    """The zero batch through ``transformation_fn`` (an error names the batch it got), its
    columns checked against ``input_shapes`` and ``label_shapes`` (``check_shapes``)."""
    if p["transformation_fn"] is None:
        batch = dict(zeros)
    else:
        try:
            batch = apply_transformation(p["transformation_fn"], zeros)
        except Exception as exc:
            raise InvalidArgumentError(
                f"transformation_fn fails on a batch of zeros ("
                f"{describe_arrays(zeros, list(zeros))}): {type(exc).__name__}: {exc}") from exc
    check_shapes(p, batch)
    return batch


def check_shapes(p: Dict[str, Any], batch: Dict[str, Any]) -> None:
    """Each shape of ``input_shapes`` / ``label_shapes`` can hold its column's rows: a full
    shape (``[-1, ...]``, batch first) or a per-row shape with as many elements per row as
    the column has (a reshape that cannot work is an error naming the param, not a raw
    reshape error from the dry run)."""
    for what, cols in (("input_shapes", p["feature_cols"]), ("label_shapes",
                                                            p["label_cols"] or [])):
        shapes = p[what]
        if shapes is None:
            continue
        for c, shape in zip(cols, shapes):
            if c not in batch:
                continue  # transformation_fn dropped it: the dry run names it
            arr = np.asarray(batch[c])
            per_row = int(np.prod(arr.shape[1:])) if arr.ndim else 1
            dims = shape[1:] if shape and shape[0] == -1 else shape  # a row's dimensions
            known = int(np.prod([d for d in dims if d != -1]))
            if (per_row % known == 0) if -1 in dims else known == per_row:
                continue
            holds = f"a multiple of {known}" if -1 in dims else str(known)
            raise InvalidArgumentError(
                f"{what} gives column '{c}' the shape {list(shape)}, which holds {holds} "
                f"element(s) per row, but each row of '{c}' has {per_row} (shape "
                f"{tuple(arr.shape[1:])}). Fix: give a shape with {per_row} element(s) per row "
                f"(e.g. [-1, {per_row}]; -1 first is the batch dimension), one per column, or "
                f"leave {what} unset")


def input_shape_error(given: str, exc: Exception) -> InvalidArgumentError:
    """The dry run's error when the model cannot run on the feature columns."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()  # Keras' terminal bold
    return InvalidArgumentError(
        f"the model cannot run on the feature columns: a batch of 2 rows gives {given}, and "
        f"calling the model on them fails with {type(exc).__name__}: {text}. Fix: make the "
        f"model's input layer match these shapes, or set input_shapes (e.g. input_shapes="
        f"[[-1, 1, 8, 8]]) to reshape each feature column")


def checkpoint_error(store: Any, run_id: str, exc: Exception) -> InvalidArgumentError:
    """The error when the checkpoint of ``run_id`` cannot be read."""
    return InvalidArgumentError(
        f"cannot read the checkpoint of run_id '{run_id}' in {store}: {exc}. Use another "
        f"run_id, or delete {store.get_checkpoint_path(run_id)}")


def no_checkpoint_error(store: Any, run_id: str) -> InvalidArgumentError:
    """The error when a finished training left no checkpoint (it always writes one)."""
    return InvalidArgumentError(f"training finished but no checkpoint was found under "
                                f"{store.get_checkpoint_path(run_id)}")


def loss_error(pairs: str, exc: Exception) -> InvalidArgumentError:
    """The dry run's error when the loss fails on the outputs and labels."""
    return InvalidArgumentError(
        f"the loss fails on the model's outputs and the labels ({pairs}): "
        f"{type(exc).__name__}: {exc}. Fix: for class indices cast the label column to an "
        f"integer type (df.withColumn('label', F.col('label').cast('long'))), make the "
        f"model's output match the label's shape, or set label_shapes")


def check_outputs(outputs: Sequence[Any], labels: Sequence[str], rows: int = 2) -> None:
    """The model returns one output per label, each with the batch as first dimension."""
    if len(outputs) < len(labels):
        raise InvalidArgumentError(
            f"the model returns {len(outputs)} output(s) but label_cols has {len(labels)} "
            f"columns {labels}: return one output per label column")
    bad = [i for i, o in enumerate(outputs)
           if len(getattr(o, "shape", ())) == 0 or o.shape[0] != rows]
    if bad:
        raise InvalidArgumentError(
            f"model output {bad[0]} is not a tensor with the batch as its first dimension "
            f"(for {rows} rows it is {getattr(outputs[bad[0]], 'shape', type(outputs[bad[0]]))})")


def label_range_error(spans: Dict[str, Tuple[int, int]], output_shapes: List[List[int]],
                      exc: Exception) -> InvalidArgumentError:
    """The error when the loss fails on the smallest and largest values of the label
    columns (``spans``), having passed on zeros: a class index out of range."""
    cause = exc.__cause__ if isinstance(exc, InvalidArgumentError) and exc.__cause__ else exc
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*|\s*\[Op:[^\]]*\].*$", "", str(cause))
    held = ", ".join(f"'{c}' from {lo} to {hi}" for c, (lo, hi) in spans.items())
    outputs = ", ".join(str(tuple(s)) for s in output_shapes)
    return InvalidArgumentError(
        f"the label column(s) hold values the loss refuses: {held} (over every row, from "
        f"the training data's Parquet statistics), and the loss fails on a batch holding "
        f"the smallest and the largest of them"
        + (f" with the model's per-row output shape(s) {outputs}" if outputs else "")
        + f": {type(cause).__name__}: {text}. Fix: for a classification loss the labels "
        f"must be class indices from 0 to the number of the model's outputs - 1: re-index "
        f"the labels (e.g. pyspark.ml.feature.StringIndexer), filter out the other rows, or "
        f"give the model as many outputs as there are classes")
