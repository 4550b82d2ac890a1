"""Lifetime of in-flight ops, run by case_worker.py on 2 and 3 ranks: handles dropped
before their ops complete (every op kind, hundreds of times, with the freed memory
reused and scribbled on), an exception between submit and synchronize, a group whose
member is invalid, names in flight twice; then ordinary collectives, right results,
and a bounded RSS.

How a dropped handle is caught using freed memory: in each round one rank keeps its
handles and checks the results, the others drop theirs at once and overwrite freshly
allocated memory of the same sizes. The keeper's results are right only if every
dropping rank's engine still read that rank's own, intact buffers.
"""

from __future__ import annotations

import gc
import os

import numpy as np

import spark_hvd as hvd
from harness import Registry, Skip, expect_error, wait_for
from refdata import Checks, assert_same, values

CASES = Registry()
HANG_S = 20.0
SCRIBBLE = 0x5A


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _scribble(sizes) -> list:
    """Fresh allocations of the freed sizes, overwritten: what a use-after-free would read."""
    return [np.full(max(1, s), SCRIBBLE, np.uint8) for s in sizes]


def _submit_round(tag: str, me: int, n: int, big: bool):
    """Starts one op of every kind; returns (handles with their expected results, the
    byte sizes of the buffers handed to the core)."""
    elems = (1 << 18) if big else 256  # 1 MiB or 1 KiB of float32
    x = values(np.float32, me, (elems,))
    rows = 2 * n
    a2a = values(np.float32, me, (rows, 3), salt=2)
    rs = values(np.float32, me, (rows, 5), salt=3)
    g = [values(np.float32, me, (7,), salt=4), values(np.float64, me, (33,), salt=5)]
    hs = [
        (hvd.allreduce_async(x, op=hvd.Sum, name=f"{tag}.ar"),
         lambda: sum(values(np.float32, r, (elems,)) for r in range(n))),
        (hvd.allgather_async(values(np.int32, me, (me + 1, 4)), name=f"{tag}.ag"),
         lambda: np.concatenate([values(np.int32, r, (r + 1, 4)) for r in range(n)])),
        (hvd.broadcast_async(values(np.float64, me, (65,)), n - 1, name=f"{tag}.bc"),
         lambda: values(np.float64, n - 1, (65,))),
        (hvd.alltoall_async(a2a, name=f"{tag}.a2a"),
         lambda: np.concatenate([values(np.float32, r, (rows, 3), salt=2)[2 * me:2 * me + 2]
                                 for r in range(n)])),
        (hvd.reducescatter_async(rs, op=hvd.Sum, name=f"{tag}.rs"),
         lambda: sum(values(np.float32, r, (rows, 5), salt=3)
                     for r in range(n))[2 * me:2 * me + 2]),
        (hvd.grouped_allreduce_async(g, op=hvd.Sum, name=f"{tag}.gar"),
         lambda: [sum(values(np.float32, r, (7,), salt=4) for r in range(n)),
                  sum(values(np.float64, r, (33,), salt=5) for r in range(n))]),
    ]
    sizes = [x.nbytes, (me + 1) * 16, 65 * 8, a2a.nbytes, rs.nbytes, 28, 33 * 8]
    return hs, sizes


def _dropped_rounds(ctx, rounds: int, big_every: int, prefix: str) -> None:
    n, me = ctx.size, ctx.rank
    chk = Checks()
    for i in range(rounds):
        keeper = i % n
        hs, sizes = _submit_round(f"{prefix}.{i}", me, n, big=i % big_every == 0)
        if me != keeper:
            del hs  # every handle dropped while its op is (most likely) in flight
            gc.collect()
            junk = _scribble(sizes)  # noqa: F841 - reuses the freed memory
            continue
        for j, (h, want) in enumerate(hs):
            got = wait_for(h, HANG_S, f"{prefix} round {i} op {j}", ctx)
            if isinstance(got, tuple):  # alltoall: (rows, received splits)
                got = got[0]
            expected = want()
            if isinstance(expected, list):
                for k, (gk, wk) in enumerate(zip(got, expected)):
                    chk.same(gk, wk, f"round {i} op {j}.{k}")
            else:
                chk.same(got, expected, f"round {i} op {j}")
    chk.done()


def _healthy(ctx, tag: str) -> None:
    n = ctx.size
    got = hvd.allreduce(np.arange(10, dtype=np.float32), op=hvd.Sum, name=f"{tag}.healthy")
    assert_same(got, np.arange(10, dtype=np.float32) * n)
    got = hvd.allgather(np.full((1, 2), ctx.rank, np.int64), name=f"{tag}.healthy.ag")
    assert_same(got, np.repeat(np.arange(n, dtype=np.int64), 2).reshape(n, 2))


@CASES.case("lifetime/dropped_handles_every_op", timeout_s=120)
def _(ctx):
    if ctx.size < 2:
        raise Skip("a dropping rank needs a peer that keeps its handles and checks")
    _dropped_rounds(ctx, rounds=120, big_every=10, prefix="drop")
    _healthy(ctx, "drop")


@CASES.case("lifetime/unclaimed_results_do_not_leak", timeout_s=120)
def _(ctx):
    """Allgathers whose results nobody claims (their output is allocated by the core)
    and dropped allreduces: RSS stays within 5 % after a warm-up."""
    if ctx.size < 2:
        raise Skip("runs with the multi-rank cases")
    row = values(np.float32, ctx.rank, (8192,))  # 32 KiB a rank a gather

    def burst(start: int, count: int) -> None:
        for i in range(start, start + count):
            hvd.allgather_async(row, name=f"leak.ag.{i}")
            hvd.allreduce_async(row, name=f"leak.ar.{i}")
            if i % 100 == 99:  # every rank's ops are done before the next hundred
                hvd.barrier()
        hvd.barrier()
        gc.collect()

    burst(0, 300)
    before = _rss_bytes()
    burst(300, 1500)
    after = _rss_bytes()
    _healthy(ctx, "leak")
    growth = (after - before) / before
    assert growth < 0.05, (f"RSS grew {100 * growth:.1f} % ({before >> 20} -> {after >> 20} MiB) "
                           "over 1500 unclaimed allgathers and allreduces")


@CASES.case("lifetime/buffers_released_by_the_time_the_wait_returns", timeout_s=60)
def _(ctx):
    """The core holds an op's owner (its input and output arrays) until the op is done;
    a release on a thread without the GIL (the engine's) is queued for the next binding
    call. The engine drops an op's entries before completing it, so the waiter's own
    release of that queue frees them: a step's arrays are gone once its last synchronize
    returns, not kept until some later call (a fused step of 1 MiB tensors: 20 MiB).
    Completing first left the last ops' arrays alive after about half the steps at 2
    ranks (the soak case's RSS stepped by 20 MiB)."""
    import weakref

    if ctx.size < 2:
        raise Skip("one rank runs every cycle on the waiting thread: no engine-thread release")
    kept = 0
    for step in range(30):
        xs = [np.full(1 << 18, float(i), np.float32) for i in range(20)]
        refs = [weakref.ref(x) for x in xs]
        hs = [hvd.allreduce_async(x, op=hvd.Sum, name=f"release.{i}") for i, x in enumerate(xs)]
        del xs
        for i, h in enumerate(hs):
            assert hvd.synchronize(h)[0] == float(i * ctx.size)
        del hs
        kept += sum(r() is not None for r in refs)
    assert kept == 0, f"{kept} input arrays of 600 ops still held after their steps"


@CASES.case("lifetime/exception_between_submit_and_synchronize")
def _(ctx):
    """What an exception does in a training step: the handles die in the unwinding."""
    n, me = ctx.size, ctx.rank

    def step(i: int) -> None:
        hs = [hvd.allreduce_async(values(np.float32, me, (4096,), salt=k), op=hvd.Sum,
                                  name=f"exc.{i}.{k}") for k in range(8)]
        hs.append(hvd.allgather_async(values(np.float32, me, (3, 3)), name=f"exc.{i}.ag"))
        raise RuntimeError("the model raised")

    for i in range(50):
        try:
            step(i)
        except RuntimeError:
            pass
        gc.collect()
        junk = _scribble([4096 * 4] * 8)  # noqa: F841
    hvd.barrier()
    want = sum(values(np.float32, r, (4096,), salt=3) for r in range(n))
    assert_same(hvd.allreduce(values(np.float32, me, (4096,), salt=3), op=hvd.Sum,
                              name="exc.after"), want)
    _healthy(ctx, "exc")


@CASES.case("lifetime/group_with_an_invalid_member_is_not_submitted")
def _(ctx):
    """A member that fails validation (bool with Average) part-way: no member is left
    in flight, and the group's name and its members' names are free again."""
    n, me = ctx.size, ctx.rank
    good = [values(np.float32, me, (5,)), values(np.float32, me, (6,), salt=1)]
    err = expect_error(hvd.InvalidArgumentError, hvd.grouped_allreduce_async,
                       good + [np.array([True, False])], name="grp")
    assert "bool" in str(err), str(err)
    got = hvd.grouped_allreduce(good, op=hvd.Sum, name="grp")
    want = [sum(values(np.float32, r, (5,)) for r in range(n)),
            sum(values(np.float32, r, (6,), salt=1) for r in range(n))]
    for g, w in zip(got, want):
        assert_same(g, w)
    assert_same(hvd.allreduce(good[0], op=hvd.Sum, name="grp.0"), want[0])


@CASES.case("lifetime/same_name_twice_in_flight_fails_at_submit")
def _(ctx):
    """The second op under an in-flight name is refused at once, naming the tensor; the
    first completes; a group naming one tensor twice is refused whole."""
    n, me = ctx.size, ctx.rank
    x = values(np.float32, me, (5,))
    want = sum(values(np.float32, r, (5,)) for r in range(n))
    if me == n - 1:  # late: the others' first 'twice' is surely still in flight
        hvd.barrier()
    h1 = hvd.allreduce_async(x, op=hvd.Sum, name="twice")
    if me != n - 1:
        err = expect_error(hvd.InvalidArgumentError, hvd.allreduce_async, x, op=hvd.Sum,
                           name="twice")
        assert "'twice'" in str(err) and "in flight" in str(err), str(err)
        hvd.barrier()
    assert_same(wait_for(h1, HANG_S, "the first 'twice'", ctx), want)
    from spark_hvd import _ops
    with_dup = expect_error(hvd.InvalidArgumentError, _grouped_twice, _ops, x)
    assert "'twice.dup'" in str(with_dup), str(with_dup)
    assert_same(hvd.allreduce(x, op=hvd.Sum, name="twice.dup"), want)


def _grouped_twice(_ops, x) -> None:
    with _ops.submit_together():
        hvd.allreduce_async(x, op=hvd.Sum, name="twice.dup")
        hvd.allreduce_async(x, op=hvd.Sum, name="twice.dup")
