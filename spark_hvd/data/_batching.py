"""Turn a stream of column chunks (``{column: numpy array}``) into batches of given sizes.

``sequential_batches`` keeps the row order and hands out views when a batch lies inside one
chunk (zero-copy); ``shuffled_batches`` mixes rows through a buffer of about
``buffer_rows`` rows:

1. Fill: pull chunks until the buffer holds ``buffer_rows + k`` rows (or the input ends),
   where ``k`` is the next batch size.
2. Mix: concatenate what is left of the buffer with the new chunks and permute it.
3. Emit from the front of the permuted buffer while more than ``buffer_rows // 2`` rows stay
   behind (or the input has ended), so leftover rows are mixed again with the next chunks.

Each row is copied about twice, whatever the batch size.
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, Sequence

import numpy as np

from ._rows import RowsMissingError

Columns = Dict[str, np.ndarray]


def _rows(chunk: Columns) -> int:
    return len(next(iter(chunk.values()))) if chunk else 0


def _concat(chunks: Sequence[Columns]) -> Columns:
    if len(chunks) == 1:
        return chunks[0]
    return {name: np.concatenate([c[name] for c in chunks]) for name in chunks[0]}


def _slice(chunk: Columns, start: int, stop: int) -> Columns:
    return {name: arr[start:stop] for name, arr in chunk.items()}


def _next(source: Iterator[Columns]) -> Columns:
    try:
        return next(source)
    except StopIteration:
        raise RowsMissingError(
            "the rows read ran out before the planned batches were full") from None


def sequential_batches(chunks: Iterable[Columns], sizes: Sequence[int]) -> Iterator[Columns]:
    """Batches of ``sizes`` rows in input order."""
    source = iter(chunks)
    pending: List[Columns] = []   # chunks not fully used; pending[0] starts at ``pos``
    pos = 0
    available = 0
    last: Columns = {}
    for k in sizes:
        while available < k:
            chunk = _next(source)
            n = _rows(chunk)
            last = chunk
            if n:
                pending.append(chunk)
                available += n
        if k == 0:
            yield _slice(pending[0] if pending else last, 0, 0)
            continue
        first = pending[0]
        if _rows(first) - pos >= k:         # inside one chunk: views, no copy
            out = _slice(first, pos, pos + k)
            pos += k
            if pos == _rows(first):
                pending.pop(0)
                pos = 0
        else:
            parts, need = [], k
            while need:
                head = pending[0]
                take = min(need, _rows(head) - pos)
                parts.append(_slice(head, pos, pos + take))
                need -= take
                pos += take
                if pos == _rows(head):
                    pending.pop(0)
                    pos = 0
            out = _concat(parts)
        available -= k
        yield out


def shuffled_batches(chunks: Iterable[Columns], sizes: Sequence[int], buffer_rows: int,
                     rng: np.random.Generator) -> Iterator[Columns]:
    """Batches of ``sizes`` rows, mixed through a shuffle buffer (see the module docstring)."""
    source = iter(chunks)
    exhausted = False
    buf: Columns = {}
    pos = 0          # rows of ``buf`` before ``pos`` were already emitted
    keep = buffer_rows // 2
    for k in sizes:
        left = _rows(buf) - pos
        if left - k < keep and not exhausted or left < k:
            new: List[Columns] = []
            have = left
            while have < buffer_rows + k:
                try:
                    chunk = next(source)
                except StopIteration:
                    exhausted = True
                    break
                if _rows(chunk) or not buf:
                    new.append(chunk)
                    have += _rows(chunk)
            parts = ([_slice(buf, pos, _rows(buf))] if buf else []) + new
            merged = _concat(parts)
            perm = rng.permutation(_rows(merged))
            buf = {name: arr[perm] for name, arr in merged.items()}
            pos = 0
            if _rows(buf) < k:
                _next(iter(()))
        yield _slice(buf, pos, pos + k)
        pos += k
