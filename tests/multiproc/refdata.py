"""Inputs and expected results computed from rank and size (numpy, no spark_hvd).

Every rank can compute every other rank's input, so each rank computes the
expected output of a collective itself. Values are small integers (halves for
floats) so sums and products of up to three ranks are exact in every dtype,
including int8, uint8, float16 and bfloat16.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(t) for t in (np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16)] \
    + [BF16] + [np.dtype(t) for t in (np.float32, np.float64, np.bool_)]
FLOATS = {np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)}
OPS = ["Sum", "Average", "Min", "Max", "Product"]


def dname(dt) -> str:
    return "bfloat16" if np.dtype(dt) == BF16 else np.dtype(dt).name


def is_bool(dt) -> bool:
    return np.dtype(dt) == np.bool_


def is_float(dt) -> bool:
    return np.dtype(dt) in FLOATS


def is_unsigned(dt) -> bool:
    return np.dtype(dt).kind == "u"


def values(dt, rank: int, shape: Sequence[int], salt: int = 0) -> np.ndarray:
    """Rank `rank`'s input: a deterministic mix of small values of dtype dt."""
    dt = np.dtype(dt)
    n = int(np.prod(shape, dtype=np.int64))
    base = (np.arange(n, dtype=np.int64) * 7 + rank * 3 + salt * 5) % 5  # 0..4
    if is_bool(dt):
        raw = (base % 2 == 1)
    elif is_unsigned(dt):
        raw = base + 1                                  # 1..5
    elif is_float(dt):
        raw = (base - 2).astype(np.float64) * 0.5       # -1.0 .. 1.0 by halves
        raw = np.where(base == 4, 1.5, raw)             # .. and a 1.5
    else:
        raw = base - 2                                  # -2..2
    return np.asarray(raw).astype(dt).reshape(shape)


def _wide(a: np.ndarray) -> np.ndarray:
    if is_bool(a.dtype):
        return a.astype(bool)
    return a.astype(np.float64) if is_float(a.dtype) else a.astype(np.int64)


def reduce(arrays: List[np.ndarray], op: str, dt, count: Optional[int] = None,
           prescale: float = 1.0, postscale: float = 1.0) -> np.ndarray:
    """The reduction of `arrays` (one per contributing rank) with the core's rules:
    Average multiplies the sum by postscale / count (integers: truncated toward zero),
    bool Sum/Max = or, Min/Product = and,
    Average divides by `count` (default: the number of arrays)."""
    dt = np.dtype(dt)
    stack = np.stack([_wide(a) for a in arrays])
    count = len(arrays) if count is None else count
    if is_bool(dt):
        if op in ("Sum", "Max"):
            out = stack.any(axis=0)
        elif op in ("Min", "Product"):
            out = stack.all(axis=0)
        else:
            raise ValueError(f"{op} on bool has no expected value")
        return out.astype(dt)
    if prescale != 1.0:
        stack = stack * prescale
        if not is_float(dt):
            stack = np.trunc(stack).astype(np.int64)
    # Average is Sum times postscale / count, in one multiply (Horovod's arithmetic):
    # integers go through float64 and are truncated toward zero.
    factor = postscale / count if op == "Average" else postscale
    if op == "Sum" or op == "Average":
        out = stack.sum(axis=0)
    elif op == "Min":
        out = stack.min(axis=0)
    elif op == "Max":
        out = stack.max(axis=0)
    elif op == "Product":
        out = stack.prod(axis=0)
    else:
        raise ValueError(op)
    if factor != 1.0:
        out = out * factor
        if not is_float(dt):
            out = np.trunc(out).astype(np.int64)
    return np.asarray(out).astype(dt)


def assert_same(got, want, what: str = "") -> None:
    """Exact for integers and bool, a few ulps for floats; dtype and shape must match."""
    got = np.asarray(got)
    want = np.asarray(want)
    prefix = f"{what}: " if what else ""
    assert got.dtype == want.dtype, f"{prefix}dtype {got.dtype} != expected {want.dtype}"
    assert got.shape == want.shape, f"{prefix}shape {got.shape} != expected {want.shape}"
    if is_float(want.dtype):
        rtol = {np.dtype(np.float16): 2e-3, BF16: 1e-2, np.dtype(np.float32): 1e-6}.get(
            want.dtype, 1e-12)
        g, w = got.astype(np.float64), want.astype(np.float64)
        if not np.allclose(g, w, rtol=rtol, atol=rtol):
            bad = np.flatnonzero(~np.isclose(g, w, rtol=rtol, atol=rtol))[:8]
            raise AssertionError(f"{prefix}values differ at flat indices {bad.tolist()}: got "
                                 f"{g.reshape(-1)[bad].tolist()}, expected "
                                 f"{w.reshape(-1)[bad].tolist()}")
    elif not np.array_equal(got, want):
        bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))[:8]
        raise AssertionError(f"{prefix}values differ at flat indices {bad.tolist()}: got "
                             f"{got.reshape(-1)[bad].tolist()}, expected "
                             f"{want.reshape(-1)[bad].tolist()}")


def even_rows(rows: int, n: int) -> List[int]:
    """Rows per rank of a reducescatter: the first rows % n ranks get one extra."""
    base, rem = divmod(rows, n)
    return [base + (1 if i < rem else 0) for i in range(n)]


class Checks:
    """Collects failed comparisons so a case runs all its collectives (keeping the
    ranks in step) and reports every mismatch at the end."""

    def __init__(self) -> None:
        self.failures: List[str] = []

    def same(self, got, want, what: str = "") -> None:
        try:
            assert_same(got, want, what)
        except AssertionError as e:
            self.failures.append(str(e))

    def true(self, cond: bool, what: str) -> None:
        if not cond:
            self.failures.append(what)

    def done(self) -> None:
        if self.failures:
            raise AssertionError(f"{len(self.failures)} check(s) failed:\n"
                                 + "\n".join(self.failures))


# -- the reduction order of tcp and shm (csrc/backends/host_reduce.h), bit for bit ----------

DIRECT_REDUCE_BYTES = 64 * 1024
DIRECT_MAX_RANKS = 4
RING_MIN_RANKS = 8
RING_STEP_BYTES = 1 << 20


def _pairwise(op: str, xs: List[np.ndarray]) -> np.ndarray:
    """host_reduce.h's pairwise order (recursive doubling's): with p the largest power of
    two <= n, y_i = x_i op x_(i+p) for i < n - p, then neighbours pairwise, lower first."""
    n = len(xs)
    p = 1 << (n.bit_length() - 1)
    ys = [_apply(op, xs[i], xs[i + p]) if i + p < n else xs[i] for i in range(p)]
    while len(ys) > 1:
        ys = [_apply(op, ys[j], ys[j + 1]) for j in range(0, len(ys), 2)]
    return ys[0]


def _f32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32)


def _scaled(x: np.ndarray, factor: float) -> np.ndarray:
    """ScaleBuffer (csrc/common/reduce.cc): float32 by the factor rounded to float32,
    float64 by the factor, float16/bfloat16 in float32 and rounded back."""
    if factor == 1.0:
        return x
    if x.dtype == np.float64:
        return x * factor
    return (np.float32(factor) * _f32(x)).astype(x.dtype)


def _apply(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The core's kernel op(a, b) for a float dtype: in float32 for the half types,
    rounded back; Min is `b < a ? b : a`, Max `a < b ? b : a` (which of two equal
    values, +0 and -0, comes out depends on the operands' order)."""
    dt = a.dtype
    x, y = (a, b) if dt == np.float64 else (_f32(a), _f32(b))
    if op in ("Sum", "Average"):
        out = x + y
    elif op == "Product":
        out = x * y
    elif op == "Min":
        out = np.where(y < x, y, x)
    else:
        out = np.where(x < y, y, x)
    return out.astype(dt)


def ordered_reduce(arrays: List[np.ndarray], op: str, prescale: float = 1.0,
                   postscale: float = 1.0) -> np.ndarray:
    """The allreduce of float `arrays` (one per rank, 1-D) exactly as tcp and shm compute
    it: prescaled inputs; up to DIRECT_REDUCE_BYTES (or fewer elements than ranks) in
    rank order, accumulator first (among more than DIRECT_MAX_RANKS ranks in the pairwise
    order of recursive doubling, as larger buffers among more than RING_MIN_RANKS ranks
    whose ring steps would move less than RING_STEP_BYTES); above, chunk
    c = [count*c//n, count*(c+1)//n) around the ring from rank c, the partial result as
    the right operand; then the post factor (Average: postscale / n)."""
    n, count = len(arrays), arrays[0].size
    xs = [_scaled(a, prescale) for a in arrays]
    nbytes = count * arrays[0].itemsize
    direct = nbytes <= DIRECT_REDUCE_BYTES or count < n
    halving = not direct and n > RING_MIN_RANKS and nbytes // n < RING_STEP_BYTES
    if (direct and n > DIRECT_MAX_RANKS) or halving:
        acc = _pairwise(op, xs)
    elif count * arrays[0].itemsize <= DIRECT_REDUCE_BYTES or count < n:
        acc = xs[0]
        for x in xs[1:]:
            acc = _apply(op, acc, x)
    else:
        acc = np.empty_like(xs[0])
        for c in range(n):
            lo, hi = count * c // n, count * (c + 1) // n
            part = xs[c][lo:hi]
            for k in range(1, n):
                part = _apply(op, xs[(c + k) % n][lo:hi], part)
            acc[lo:hi] = part
    factor = postscale / n if op == "Average" else postscale
    return _scaled(acc, factor)
