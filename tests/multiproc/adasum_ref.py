"""Adasum as the core computes it (csrc/backends/host_adasum.h), rank by rank, in numpy.

The recursive vector-halving, distance-doubling algorithm with the same split of the
fused vector, the same per-tensor dot products (float64, summed element by element in
order, then over each block by recursive doubling) and the same arithmetic per dtype
(combination in float64 for float32/float64, in float32 for float16/bfloat16, rounded
to the dtype at every level), so the core's result should match it to the last bit or
so. ``tree`` is the textbook definition (pairwise binary tree in float64), for checking
that the algorithm computes Adasum at all.
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np

from refdata import BF16

MIN_NORM_SQ = 1e-8  # below it a coefficient stays 1 (Horovod's guard)


def _half(dt) -> bool:
    return np.dtype(dt) in (np.dtype(np.float16), BF16)


def _scale(x: np.ndarray, factor: float) -> np.ndarray:
    """The core's ScaleBuffer: float32 and halves by the factor rounded to float32."""
    if factor == 1.0:
        return x
    if x.dtype == np.float64:
        return x * factor
    return (x.astype(np.float32) * np.float32(factor)).astype(x.dtype)


def _seqsum(v: np.ndarray) -> float:
    """Sum in float64, element by element in order (as the core's loop)."""
    return float(np.cumsum(v, dtype=np.float64)[-1]) if v.size else 0.0


def _dots(mine: np.ndarray, theirs: np.ndarray):
    x, y = mine.astype(np.float64), theirs.astype(np.float64)
    return _seqsum(x * y), _seqsum(x * x), _seqsum(y * y)


def _combine(mine: np.ndarray, theirs: np.ndarray, cm: float, ct: float) -> np.ndarray:
    if _half(mine.dtype):
        fm, ft = np.float32(cm), np.float32(ct)
        return (fm * mine.astype(np.float32) + ft * theirs.astype(np.float32)).astype(mine.dtype)
    return (cm * mine.astype(np.float64) + ct * theirs.astype(np.float64)).astype(mine.dtype)


def _coefficient(dot: float, normsq: float) -> float:
    return 1.0 - dot / (2.0 * normsq) if normsq >= MIN_NORM_SQ else 1.0


def adasum(inputs: Sequence[Sequence[np.ndarray]], prescale: float = 1.0,
           postscale: float = 1.0) -> List[np.ndarray]:
    """inputs[r]: rank r's tensors (one fused allreduce; same shapes and dtype on every
    rank, a power-of-two number of ranks). Returns the result tensors."""
    p = len(inputs)
    assert p & (p - 1) == 0, f"{p} ranks: not a power of two"
    shapes = [np.shape(t) for t in inputs[0]]
    offsets = np.concatenate([[0], np.cumsum([int(np.prod(s)) for s in shapes])]).astype(int)
    n = int(offsets[-1])
    w = [_scale(np.concatenate([np.asarray(t).reshape(-1) for t in ts]), prescale)
         for ts in inputs]
    held = [(0, n)] * p
    d = 1
    while d < p:
        keep = []
        for r in range(p):
            lo, hi = held[r]
            mid = lo + (hi - lo) // 2
            keep.append((lo, mid) if r & d == 0 else (mid, hi))
        # each rank's (a.b, |a|^2, |b|^2) per tensor over its part; a = the lower rank's
        sums = []
        for r in range(p):
            lo, hi = keep[r]
            partner = r ^ d
            own = np.zeros(3 * (len(offsets) - 1))
            for i in range(len(offsets) - 1):
                a, b = max(lo, offsets[i]), min(hi, offsets[i + 1])
                if a >= b:
                    continue
                dot, mm, tt = _dots(w[r][a:b], w[partner][a:b])
                lower = r & d == 0
                own[3 * i:3 * i + 3] = (dot, mm, tt) if lower else (dot, tt, mm)
            sums.append(own)
        k = 1
        while k <= d:  # recursive doubling over the block of 2d ranks
            sums = [sums[r] + sums[r ^ k] for r in range(p)]
            k <<= 1
        new_w = [x.copy() for x in w]
        for r in range(p):
            lo, hi = keep[r]
            lower = r & d == 0
            for i in range(len(offsets) - 1):
                a, b = max(lo, offsets[i]), min(hi, offsets[i + 1])
                if a >= b:
                    continue
                dot, aa, bb = sums[r][3 * i:3 * i + 3]
                ca, cb = _coefficient(dot, aa), _coefficient(dot, bb)
                new_w[r][a:b] = _combine(w[r][a:b], w[r ^ d][a:b], ca if lower else cb,
                                         cb if lower else ca)
        w = new_w
        held = keep
        d <<= 1
    # the allgather phase: every element comes from the one rank that computed it
    out = np.empty(n, dtype=w[0].dtype)
    for r in range(p):
        lo, hi = held[r]
        out[lo:hi] = w[r][lo:hi]
    out = _scale(out, postscale)
    return [out[offsets[i]:offsets[i + 1]].reshape(s) for i, s in enumerate(shapes)]


def tree(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """Textbook Adasum of 2^k vectors in float64: (v0, v1), (v2, v3), ... pairwise up."""
    def pair(a, b):
        dot = float(a @ b)
        return _coefficient(dot, float(a @ a)) * a + _coefficient(dot, float(b @ b)) * b

    level = [np.asarray(v, dtype=np.float64).reshape(-1) for v in vectors]
    while len(level) > 1:
        level = [pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]
