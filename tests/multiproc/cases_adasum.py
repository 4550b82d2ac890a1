"""op=Adasum in the core (csrc/backends/host_adasum.h), run by case_worker.py at 1-4 ranks.

Results are compared with adasum_ref.py, the same recursive vector-halving,
distance-doubling algorithm in numpy, to the tolerance of refdata.assert_same (the two
agree to the bit on x86-64). Each single-tensor op is synchronized before the next, and
fused cases use grouped_allreduce, so what the core fuses is what the reference fuses.
With a number of ranks that is not a power of two every Adasum is refused, as Horovod
refuses it.
"""

from __future__ import annotations

import numpy as np

import spark_hvd as hvd
from adasum_ref import adasum, tree
from harness import Registry, Skip, expect_error
from refdata import BF16, DTYPES, Checks, assert_same, dname, is_float

CASES = Registry()
FLOAT_DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
SHAPES = [(0,), (1,), (2,), (7,), (3, 5), (1031,)]


def _power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def _needs_power_of_two(ctx) -> None:
    if not _power_of_two(ctx.size):
        raise Skip(f"{ctx.size} ranks: Adasum is refused (adasum/refused/non_power_of_two)")


def _inputs(dt, rank: int, shapes, salt: int = 0):
    """Rank `rank`'s tensors: normal values, different per rank, shape and salt."""
    rng = np.random.default_rng(1000 * salt + rank)
    return [rng.standard_normal(s).astype(dt) for s in shapes]


def _single_case(dt):
    def fn(ctx):
        _needs_power_of_two(ctx)
        chk = Checks()
        for k, shape in enumerate(SHAPES):
            every = [_inputs(dt, r, [shape], salt=k) for r in range(ctx.size)]
            x = every[ctx.rank][0]
            before = x.copy()
            got = hvd.allreduce(x, op=hvd.Adasum, name=f"ada.{dname(dt)}.{k}")
            chk.same(got, adasum(every)[0], f"shape {shape}")
            chk.same(x, before, f"shape {shape}: the input was modified")
        chk.done()
    return fn


def _fused_case(dt):
    """Every shape in one grouped allreduce: fused, each tensor with its own coefficients."""
    def fn(ctx):
        _needs_power_of_two(ctx)
        chk = Checks()
        every = [_inputs(dt, r, SHAPES, salt=50) for r in range(ctx.size)]
        got = hvd.grouped_allreduce(every[ctx.rank], op=hvd.Adasum,
                                    name=f"ada.fused.{dname(dt)}")
        for shape, g, w in zip(SHAPES, got, adasum(every)):
            chk.same(g, w, f"fused, shape {shape}")
        chk.done()
    return fn


for _dt in FLOAT_DTYPES:
    CASES.add(f"adasum/single/{dname(_dt)}", _single_case(_dt))
    CASES.add(f"adasum/fused/{dname(_dt)}", _fused_case(_dt))


@CASES.case("adasum/scaled")
def _(ctx):
    _needs_power_of_two(ctx)
    chk = Checks()
    for dt in FLOAT_DTYPES:
        every = [_inputs(dt, r, [(5,), (40,)], salt=7) for r in range(ctx.size)]
        got = hvd.grouped_allreduce(every[ctx.rank], op=hvd.Adasum, prescale_factor=0.5,
                                    postscale_factor=3.0, name=f"ada.scaled.{dname(dt)}")
        for g, w in zip(got, adasum(every, prescale=0.5, postscale=3.0)):
            chk.same(g, w, f"{dname(dt)} prescale 0.5, postscale 3")
    chk.done()


@CASES.case("adasum/is_adasum")
def _(ctx):
    """Against the definition (a pairwise tree in float64), and its special cases:
    identical vectors give the vector, orthogonal ones their sum, zero is neutral."""
    _needs_power_of_two(ctx)
    n, r = ctx.size, ctx.rank
    every = [_inputs(np.float64, q, [(33,)], salt=9)[0] for q in range(n)]
    got = hvd.allreduce(every[r], op=hvd.Adasum, name="ada.tree")
    assert np.allclose(got, tree(every), rtol=1e-12, atol=1e-12), (got, tree(every))
    v = np.linspace(-1.0, 2.0, 9)
    assert np.allclose(hvd.allreduce(v, op=hvd.Adasum, name="ada.identical"), v, rtol=1e-12)
    e = np.zeros(n)
    e[r] = 1.5
    assert np.allclose(hvd.allreduce(e, op=hvd.Adasum, name="ada.orthogonal"), np.full(n, 1.5))
    z = v if r == 0 else np.zeros_like(v)
    assert np.allclose(hvd.allreduce(z, op=hvd.Adasum, name="ada.zero"), v, rtol=1e-12)


@CASES.case("adasum/large_bit_identical_on_every_rank")
def _(ctx):
    """A tensor large enough for the TCP mesh to move it in many pieces; every rank
    ends with the same bits."""
    _needs_power_of_two(ctx)
    every = [_inputs(np.float32, q, [(300_001,)], salt=11) for q in range(ctx.size)]
    got = hvd.allreduce(every[ctx.rank][0], op=hvd.Adasum, name="ada.large")
    assert_same(got, adasum(every)[0], "large")
    root = hvd.broadcast(got, 0, name="ada.large.bits")
    assert np.array_equal(got.view(np.uint32), root.view(np.uint32)), "ranks differ"


@CASES.case("adasum/process_set_of_two")
def _(ctx):
    """Adasum over a set of two ranks, whatever the job's size (the fix the
    non-power-of-two error suggests)."""
    ctx.skip_unless(ctx.size >= 2, "needs 2+ ranks")
    ps = hvd.add_process_set([0, 1])
    try:
        if ps.included():
            every = [_inputs(np.float32, q, [(17,)], salt=13) for q in range(2)]
            got = hvd.allreduce(every[ctx.rank][0], op=hvd.Adasum, process_set=ps,
                                name="ada.ps")
            assert_same(got, adasum(every)[0], "process set [0, 1]")
    finally:
        hvd.remove_process_set(ps)


@CASES.case("adasum/refused/non_power_of_two")
def _(ctx):
    ctx.skip_unless(not _power_of_two(ctx.size), f"{ctx.size} ranks is a power of two")
    for dt in FLOAT_DTYPES:
        err = expect_error(hvd.InvalidArgumentError, hvd.allreduce, np.ones(3, dt),
                           op=hvd.Adasum, name=f"ada.np2.{dname(dt)}")
        assert "power-of-two number of ranks" in str(err) and f"has {ctx.size} ranks" in str(err), \
            str(err)
    err = expect_error(hvd.InvalidArgumentError, hvd.grouped_allreduce,
                       [np.ones(2), np.ones(3)], op=hvd.Adasum, name="ada.np2.grouped")
    assert "power-of-two" in str(err), str(err)
    # nothing was left half submitted: the names are free for a Sum
    assert np.allclose(hvd.allreduce(np.ones(3), op=hvd.Sum, name="ada.np2.float64"),
                       np.full(3, ctx.size))


@CASES.case("adasum/refused/integer_and_bool")
def _(ctx):
    for dt in DTYPES:
        if is_float(dt):
            continue
        err = expect_error(hvd.InvalidArgumentError, hvd.allreduce, np.ones(3, dt),
                           op=hvd.Adasum, name=f"ada.int.{dname(dt)}")
        assert "floating-point" in str(err) and dname(dt) in str(err), str(err)
    hvd.barrier()  # no rank shuts down while another still checks (a refusal is local)


@CASES.case("adasum/refused/reducescatter")
def _(ctx):
    err = expect_error(hvd.InvalidArgumentError, hvd.reducescatter, np.ones(4),
                       op=hvd.Adasum, name="ada.rs")
    assert "reducescatter does not support op=Adasum" in str(err), str(err)
    hvd.barrier()
