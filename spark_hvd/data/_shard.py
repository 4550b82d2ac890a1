"""The sharding plan: which rows each rank reads in an epoch, and in how many batches.

Pure logic over row-group sizes (no I/O), so it is tested exhaustively without files.

The contract, for ``N`` rows in total, ``size`` ranks and a batch size ``B``:

1. Every rank derives the same row-group order for epoch ``e``: the identity, or (with
   shuffling) a permutation drawn from a generator seeded by ``(seed, e)``.  The order only
   depends on the metadata, the seed and the epoch, so the ranks agree without talking.
2. Laid end to end in that order, the row groups form one global row range ``[0, N)``.
   Rank ``r`` owns ``[r*N//size, (r+1)*N//size)``: contiguous, disjoint, covering ``[0, N)``,
   and each rank's share is ``N//size`` or ``N//size + 1`` rows.
3. Every rank takes ``steps = ceil(N / (size*B))`` steps (``ceil(max share / B)``).  A rank
   splits its rows into exactly ``steps`` batches whose sizes differ by at most one, so no
   batch exceeds ``B``.  Only when ``B == 1`` and ``size`` does not divide ``N`` can a rank
   have fewer rows than steps; it then ends the epoch with one zero-row batch.
4. With ``drop_last``, every batch has exactly ``B`` rows: ``steps = (N//size) // B`` and
   each rank reads only the first ``steps*B`` rows of its range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np

from ..exceptions import InvalidArgumentError


@dataclass(frozen=True)
class RowGroup:
    """One Parquet row group: ``file`` is an index into the reader's file list."""

    file: int
    index: int
    num_rows: int


@dataclass(frozen=True)
class Slice:
    """Rows ``[start, stop)`` of one row group."""

    group: RowGroup
    start: int
    stop: int

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


def check_shardable(num_rows: int, size: int, batch_size: int, drop_last: bool,
                    what: str = "the dataset") -> None:
    """Raise InvalidArgumentError when ``num_rows`` cannot give every rank a batch."""
    if num_rows < size:
        raise InvalidArgumentError(
            f"{what} has {num_rows} rows but {size} ranks read it: every rank needs at least "
            f"one row. Use more data or fewer processes (num_proc <= {max(num_rows, 1)}).")
    if drop_last and num_rows // size < batch_size:
        raise InvalidArgumentError(
            f"{what} has {num_rows} rows, {num_rows // size} per rank, fewer than "
            f"batch_size={batch_size}; with drop_last=True no rank would get a full batch. "
            f"Use batch_size <= {num_rows // size} or drop_last=False.")


def steps_per_epoch(num_rows: int, size: int, batch_size: int, drop_last: bool = False) -> int:
    """The number of batches every rank yields per epoch (see the module docstring)."""
    if drop_last:
        return (num_rows // size) // batch_size
    return -(-num_rows // (size * batch_size))


def rank_range(num_rows: int, rank: int, size: int) -> Tuple[int, int]:
    """Rank ``rank``'s global row range ``[lo, hi)`` in the epoch's row-group order."""
    return rank * num_rows // size, (rank + 1) * num_rows // size


def epoch_order(num_groups: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The row-group order of an epoch: identical on every rank for the same arguments."""
    if not shuffle:
        return np.arange(num_groups)
    return np.random.default_rng([seed, epoch]).permutation(num_groups)


def slices_for_range(groups: Sequence[RowGroup], order: Sequence[int],
                     lo: int, hi: int) -> List[Slice]:
    """The pieces of the row groups, taken in ``order``, that overlap global rows ``[lo, hi)``."""
    out: List[Slice] = []
    offset = 0
    for i in order:
        group = groups[int(i)]
        begin, end = offset, offset + group.num_rows
        offset = end
        if end <= lo or group.num_rows == 0:
            continue
        if begin >= hi:
            break
        out.append(Slice(group, max(lo, begin) - begin, min(hi, end) - begin))
    return out


def batch_sizes(num_rows: int, steps: int) -> List[int]:
    """Split ``num_rows`` into ``steps`` sizes differing by at most one, larger ones first."""
    if steps <= 0:
        return []
    base, extra = divmod(num_rows, steps)
    return [base + 1] * extra + [base] * (steps - extra)


@dataclass(frozen=True)
class EpochPlan:
    """What one rank reads in one epoch: the slices in order and the batch sizes."""

    slices: Tuple[Slice, ...]
    batch_sizes: Tuple[int, ...]

    @property
    def num_rows(self) -> int:
        return sum(self.batch_sizes)


def plan_epoch(groups: Sequence[RowGroup], *, rank: int, size: int, batch_size: int,
               epoch: int, seed: int, shuffle: bool, drop_last: bool) -> EpochPlan:
    """The full plan of rank ``rank`` for ``epoch``."""
    total = sum(g.num_rows for g in groups)
    steps = steps_per_epoch(total, size, batch_size, drop_last)
    lo, hi = rank_range(total, rank, size)
    if drop_last:
        hi = lo + steps * batch_size
    order = epoch_order(len(groups), seed, epoch, shuffle)
    slices = slices_for_range(groups, order, lo, hi)
    return EpochPlan(tuple(slices), tuple(batch_sizes(hi - lo, steps)))
