"""What ``prepare_data`` returns: the materialized data's description (:class:`DataMeta`),
which travels to every rank inside the training config.

Apart from materialize.py (which re-exports these classes), so that unpickling it on a rank
imports neither pyspark nor the write path (``pyspark.ml`` alone took 1-3 s of every rank's
start).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from spark_hvd.data import make_reader
from spark_hvd.exceptions import InvalidArgumentError

from .store import Store

FORMAT_VERSION = 2  # 2: ColumnMeta.value_range; the non-finite check


@dataclass(frozen=True)
class ColumnMeta:
    """One column as the reader delivers it: a batch holds ``dtype`` arrays of shape
    ``(rows,) + shape``; ``kind`` and ``spark_type`` say where it came from.
    ``value_range`` is ``(smallest, largest)`` value of an integer label column over every
    row of both splits (from the Parquet footers' statistics; None for other columns or
    when a file has none): fit checks the loss on them before training."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    kind: str
    spark_type: str
    value_range: Optional[Tuple[int, int]] = None


@dataclass
class DataMeta:
    """The materialized training data, as ``prepare_data`` returns it.

    ``train_path`` and ``val_path`` are directories in ``store.filesystem``'s namespace holding
    Parquet files.  Read them on a rank with
    ``meta.make_reader("train", rank=r, size=n, batch_size=b)`` (or
    ``spark_hvd.data.make_reader(meta.train_path, filesystem=meta.store.filesystem, ...)``):
    a Vector column of size 64 arrives as a ``float64`` array of shape ``(rows, 64)``, see
    ``columns``.  ``store`` is the Store the data lives in (the parent cache dir's when that
    Spark conf is set); it is picklable, so the whole DataMeta travels to executors.
    """

    key: str
    train_path: str
    val_path: Optional[str]
    train_rows: int
    val_rows: int
    columns: Dict[str, ColumnMeta]
    feature_cols: List[str]
    label_cols: List[str]
    sample_weight_col: Optional[str]
    num_proc: int
    store: Optional[Store] = field(default=None, compare=False)

    def make_reader(self, split: str = "train", *, rank: int, size: int, batch_size: int,
                    columns: Optional[Sequence[str]] = None, **kwargs: Any) -> Any:
        """A reader over the ``"train"`` or ``"val"`` data (see spark_hvd.data.make_reader)."""
        path = {"train": self.train_path, "val": self.val_path}.get(split, "")
        if not path:
            raise InvalidArgumentError(
                f"no {split!r} data: split must be 'train' or 'val' (val only when prepared "
                f"with validation)")
        kwargs.setdefault("filesystem", self.store.filesystem if self.store else None)
        return make_reader(path, rank=rank, size=size, batch_size=batch_size,
                           columns=list(columns) if columns else list(self.columns), **kwargs)

    def to_json(self) -> str:
        d = asdict(self)
        d.pop("store")
        d["format_version"] = FORMAT_VERSION
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, store: Optional[Store] = None) -> "DataMeta":
        d = json.loads(text)
        if d.pop("format_version", None) != FORMAT_VERSION:
            raise ValueError("unknown DataMeta format")
        d["columns"] = {k: ColumnMeta(**{**v, "shape": tuple(v["shape"]), "value_range": (
            tuple(v["value_range"]) if v.get("value_range") is not None else None)})
                        for k, v in d["columns"].items()}
        return cls(store=store, **d)
