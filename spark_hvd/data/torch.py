"""numpy batches -> torch tensors, zero-copy (``torch.from_numpy``).

Tensors made from a zero-copy batch share memory with Arrow's read-only buffers: treat them as
read-only (cast, move to a device or clone before writing in place).  torch warns about
non-writable arrays once per process; this module silences that one warning only.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..exceptions import InvalidArgumentError

_NOT_WRITABLE = "The given NumPy array is not writable"


def _torch() -> Any:
    import torch  # lazily: spark_hvd.data works without torch
    return torch


def array_to_tensor(name: str, arr: np.ndarray) -> Any:
    """One numpy column as a tensor sharing its memory."""
    torch = _torch()
    if arr.dtype == object or arr.dtype.kind in "USMm":
        raise InvalidArgumentError(
            f"column '{name}' has numpy dtype {arr.dtype}, which has no tensor equivalent; "
            f"train on numeric, boolean or array columns (index strings with StringIndexer).")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NOT_WRITABLE, category=UserWarning)
        return torch.from_numpy(arr)


def to_torch(batch: Mapping[str, np.ndarray]) -> Dict[str, Any]:
    """``{column: numpy array}`` -> ``{column: torch.Tensor}`` without copying."""
    return {name: array_to_tensor(name, arr) for name, arr in batch.items()}


Tensors = Union[Any, List[Any]]


class TorchBatches:
    """Iterate a reader as ``(features, labels)`` or ``(features, labels, weights)``.

    Parameters
    ----------
    reader : ParquetShardReader (or any iterable of numpy batches with ``len()``)
    feature_cols, label_cols : list of str
    sample_weight_col : str, optional
        When given, each item is a 3-tuple with the weight tensor last.
    dtype : torch.dtype, optional
        Cast floating-point features and labels to it (e.g. ``torch.float32`` for Vectors,
        which are float64); integer and bool columns are left alone.
    device : torch.device or str, optional
        Move tensors there (``non_blocking`` copies).
    as_lists : bool
        ``features``/``labels`` are lists of tensors, one per column.  By default a single
        column gives the tensor itself and several give a list.

    Iterating runs the reader's next epoch; ``epoch(e)`` runs epoch ``e``.
    """

    def __init__(self, reader: Any, feature_cols: Sequence[str], label_cols: Sequence[str],
                 sample_weight_col: Optional[str] = None, *, dtype: Any = None,
                 device: Any = None, as_lists: bool = False) -> None:
        self.reader = reader
        self.feature_cols = [feature_cols] if isinstance(feature_cols, str) else list(feature_cols)
        self.label_cols = [label_cols] if isinstance(label_cols, str) else list(label_cols)
        self.sample_weight_col = sample_weight_col
        self.dtype, self.device, self.as_lists = dtype, device, as_lists

    def __len__(self) -> int:
        return len(self.reader)

    def __iter__(self) -> Iterator[Tuple[Any, ...]]:
        return self._convert(iter(self.reader))

    def epoch(self, epoch: int) -> Iterator[Tuple[Any, ...]]:
        return self._convert(self.reader.epoch(epoch))

    def _tensor(self, name: str, arr: np.ndarray) -> Any:
        t = array_to_tensor(name, arr)
        if self.dtype is not None and t.is_floating_point():
            t = t.to(self.dtype)
        if self.device is not None:
            t = t.to(self.device, non_blocking=True)
        return t

    def _group(self, batch: Mapping[str, np.ndarray], cols: Sequence[str]) -> Tensors:
        tensors = [self._tensor(c, batch[c]) for c in cols]
        return tensors if self.as_lists or len(tensors) != 1 else tensors[0]

    def _convert(self, batches: Iterator[Mapping[str, np.ndarray]]) -> Iterator[Tuple[Any, ...]]:
        try:
            for batch in batches:
                out: Tuple[Any, ...] = (self._group(batch, self.feature_cols),
                                        self._group(batch, self.label_cols))
                if self.sample_weight_col is not None:
                    out += (self._tensor(self.sample_weight_col, batch[self.sample_weight_col]),)
                yield out
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()
