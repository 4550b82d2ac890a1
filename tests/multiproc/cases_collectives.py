"""The op matrix: every op x every dtype, run by case_worker.py on 1, 2 and 3 ranks.

Each case computes its expectation from rank and size (refdata.py); tensor names
are explicit and unique per case.
"""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np

import spark_hvd as hvd
from _ranks import open_sockets
from harness import Registry, Skip, expect_error, wait_for
from refdata import (BF16, DTYPES, OPS, Checks, assert_same, dname, even_rows, is_bool, is_float,
                     ordered_reduce, reduce, values)

CASES = Registry()
OP = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max,
      "Product": hvd.Product}
# Zero-length, one element, odd lengths, a 2-D odd shape, and one longer than a
# handful of elements per rank so ring/halving algorithms split it unevenly.
# 0-d tensors have their own cases (zero_dim/*).
SHAPES = [(0,), (1,), (7,), (3, 5), (1031,)]


def _concat(parts, tail_shape, dt) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros((0,) + tuple(tail_shape), dt)


# -- response cache ---------------------------------------------------------------

@CASES.case("cache/repeated_steps_then_changes")
def _(ctx):
    """Repeated steps are answered by the response cache (this rank's hits and misses
    counted by the core), a changed request is not, and the results stay right. First
    in the module: the op matrix's names fill the cache (SPARK_HVD_CACHE_CAPACITY, 1024),
    and a full cache takes no new name."""
    from spark_hvd import _core

    n, me = ctx.size, ctx.rank
    shapes = [(4,), (1,), (3, 3), (0,)]
    before = _core.cache_stats()

    def step(s, j, shape, op="Sum", dt=np.float32):
        got = hvd.allreduce(values(dt, me, shape, salt=s), op=OP[op], name=f"cache.w{j}")
        want = reduce([values(dt, r, shape, salt=s) for r in range(n)], op, dt)
        assert_same(got, want, f"step {s} tensor {j} {shape} {op}")

    for s in range(12):  # the same names every step: served by the response cache
        for j, shape in enumerate(shapes):
            step(s, j, shape)
    for s in range(3):   # same name, new shape: the cached entry must not be reused
        step(100 + s, 0, (6,))
    step(200, 0, (6,), op="Max")      # same name, new op
    step(201, 0, (6,), dt=np.int64)   # same name, new dtype
    for s in range(3):
        step(300 + s, 0, (4,))        # and back
    # the same tensors as async steps, several in flight at once
    for s in range(4):
        hs = [hvd.allreduce_async(values(np.float32, me, shape, salt=s), op=hvd.Sum,
                                  name=f"cache.w{j}") for j, shape in enumerate(shapes)]
        for j, h in enumerate(hs):
            want = reduce([values(np.float32, r, shapes[j], salt=s) for r in range(n)], "Sum",
                          np.float32)
            assert_same(hvd.synchronize(h), want, f"async step {s} tensor {j}")
    after = _core.cache_stats()
    # Sent in full: the 4 tensors' first step, each new shape, op or dtype of cache.w0 and
    # its return to (4,); every other step (11 x 4, 2, 2, 4 x 4) went as cache bits.
    assert after["misses"] - before["misses"] == 4 + 4, (before, after)
    assert after["hits"] - before["hits"] == 11 * 4 + 2 + 2 + 4 * 4, (before, after)


# -- allreduce ----------------------------------------------------------------------

def _allreduce_case(dt, op):
    """Every shape of SHAPES in flight at once (the blocking API is synchronize(async))."""
    def fn(ctx):
        if is_bool(dt) and op == "Average":
            for k, shape in enumerate(SHAPES):
                x = values(dt, ctx.rank, shape, salt=k)
                err = expect_error(hvd.InvalidArgumentError, hvd.allreduce, x,
                                   name=f"ar.{dname(dt)}.{op}.{k}", op=OP[op])
                assert "bool" in str(err), str(err)
            return
        chk = Checks()
        xs = [values(dt, ctx.rank, shape, salt=k) for k, shape in enumerate(SHAPES)]
        before = [x.copy() for x in xs]
        hs = [hvd.allreduce_async(x, name=f"ar.{dname(dt)}.{op}.{k}", op=OP[op])
              for k, x in enumerate(xs)]
        for k, shape in enumerate(SHAPES):
            want = reduce([values(dt, r, shape, salt=k) for r in range(ctx.size)], op, dt)
            chk.same(hvd.synchronize(hs[k]), want, f"shape {shape}")
            chk.same(xs[k], before[k], f"shape {shape}: the input was modified")
        chk.done()
    return fn


for _dt in DTYPES:
    for _op in OPS:
        CASES.add(f"allreduce/{dname(_dt)}/{_op}", _allreduce_case(_dt, _op))


def _allreduce_large_case(dt):
    def fn(ctx):
        shape = (65537,)  # 256 KiB of float32, odd: many chunks per rank
        for op in (["Sum", "Min"] if is_bool(dt) else ["Sum", "Max"]):
            x = values(dt, ctx.rank, shape, salt=3)
            got = hvd.allreduce(x, name=f"arl.{dname(dt)}.{op}", op=OP[op])
            want = reduce([values(dt, r, shape, salt=3) for r in range(ctx.size)], op, dt)
            assert_same(got, want, op)
    return fn


for _dt in DTYPES:
    CASES.add(f"allreduce_large/{dname(_dt)}", _allreduce_large_case(_dt))


@CASES.case("ring/large_odd_identical_bits")
def _(ctx):
    """An allreduce whose chunks (1/size of it each) are larger than the Gloo ring's
    4 MiB receive scratch, of an odd length, on values whose float sum depends on the
    order of addition: the result is right and every rank holds the same bits."""
    import hashlib

    n = (5 << 20) // 4 * max(ctx.size, 1) + 3
    rng = np.random.default_rng(7 + ctx.rank)
    x = rng.standard_normal(n).astype(np.float32) * 1e3
    got = hvd.allreduce(x, op=hvd.Sum, name="ring.large")
    want = np.zeros(n, np.float64)
    for r in range(ctx.size):
        want += np.random.default_rng(7 + r).standard_normal(n).astype(np.float32) * 1e3
    assert np.allclose(got, want, rtol=1e-5, atol=1e-2), "ring sum differs from the reference"
    digests = hvd.allgather_object(hashlib.sha256(got.tobytes()).hexdigest(), name="ring.bits")
    assert len(set(digests)) == 1, f"ranks hold different results: {digests}"


def _order_sensitive(dt, rank: int, n: int) -> np.ndarray:
    """Values whose float sum depends on the order of addition, with signed zeros (Min
    and Max pick by operand order between +0 and -0)."""
    x = np.random.default_rng(11 + rank).standard_normal(n) * 1e3
    x[::7] = 0.0 if rank % 2 else -0.0
    return x.astype(dt)


@CASES.case("order/bits_of_the_reduction_order")
def _(ctx):
    """tcp and shm reduce every element in the order csrc/backends/host_reduce.h defines,
    so their results are the same bits: each rank checks its result against that order
    computed in numpy (refdata.ordered_reduce), for direct and ring sizes (several shm
    rounds), Sum/Average with pre/postscale, Min and Max, every float dtype."""
    if os.environ.get("SPARK_HVD_CPU_OPERATIONS", "") not in ("", "tcp", "shm") or \
            os.environ.get("SPARK_HVD_CONTROLLER", "gloo") != "gloo":
        raise Skip("gloo and mpi reduce in orders of their own")
    chk = Checks()
    for dt in (np.float32, np.float64, np.float16, BF16):
        for count in (1001, 3 * 32768 + 7):  # direct, then ring
            xs = [_order_sensitive(dt, r, count) for r in range(ctx.size)]
            for op, pre, post in (("Sum", 1.25, 0.7), ("Average", 1.0, 3.0), ("Min", 1, 1),
                                  ("Max", 1, 1)):
                got = hvd.allreduce(xs[ctx.rank], op=OP[op], prescale_factor=pre,
                                    postscale_factor=post, name=f"ord.{dname(dt)}.{count}.{op}")
                want = ordered_reduce(xs, op, pre, post)
                bits = [a.view(np.uint8).reshape(count, -1) for a in (got, want)]
                bad = np.flatnonzero(np.any(bits[0] != bits[1], axis=1))
                chk.true(bad.size == 0, f"{dname(dt)} x {count} {op}: {bad.size} elements "
                         f"differ from the order's bits, first at {bad[:5].tolist()}: got "
                         f"{got[bad[:5]].tolist()}, expected {want[bad[:5]].tolist()}")
    chk.done()


@CASES.case("broadcast_large/every_root")
def _(ctx):
    """Broadcasts large enough to go down the chain (3+ ranks), from every root, of an
    odd byte length: every rank gets the root's bytes."""
    n = (3 << 20) + 5
    for root in range(ctx.size):
        x = (np.arange(n, dtype=np.int64) * (root + 3) % 251).astype(np.uint8)
        mine = x if ctx.rank == root else np.zeros(n, np.uint8)
        got = hvd.broadcast(mine, root_rank=root, name=f"bcl.{root}")
        assert np.array_equal(got, x), f"root {root}: bytes differ"


@CASES.case("allreduce/default_op_is_average")
def _(ctx):
    for dt in (np.float32, np.int32):
        x = values(dt, ctx.rank, (9,))
        got = hvd.allreduce(x, name=f"ar.default.{np.dtype(dt).name}")
        assert_same(got, reduce([values(dt, r, (9,)) for r in range(ctx.size)], "Average", dt))


def _scaled_case(dt):
    def fn(ctx):
        pre, post = (0.5, 3.0) if is_float(dt) else (2.0, 3.0)
        for op in ("Sum", "Average"):
            x = values(dt, ctx.rank, (11,))
            name = f"ars.{dname(dt)}.{op}"
            if is_bool(dt):
                expect_error(hvd.InvalidArgumentError, hvd.allreduce, x, name=name, op=OP[op],
                             prescale_factor=pre, postscale_factor=post)
                continue
            got = hvd.allreduce(x, name=name, op=OP[op], prescale_factor=pre,
                                postscale_factor=post)
            want = reduce([values(dt, r, (11,)) for r in range(ctx.size)], op, dt,
                          prescale=pre, postscale=post)
            assert_same(got, want, f"{op} prescale={pre} postscale={post}")
    return fn


for _dt in DTYPES:
    CASES.add(f"allreduce_scaled/{dname(_dt)}", _scaled_case(_dt))


@CASES.case("zero_dim/allreduce_broadcast_grouped")
def _(ctx):
    """A 0-d tensor keeps its shape () through allreduce, broadcast and grouped_allreduce."""
    chk = Checks()
    for dt in DTYPES:
        op = "Max" if is_bool(dt) else "Sum"
        got = hvd.allreduce(values(dt, ctx.rank, ()), op=OP[op], name=f"zd.ar.{dname(dt)}")
        chk.same(got, reduce([values(dt, r, ()) for r in range(ctx.size)], op, dt),
                 f"allreduce {dname(dt)}")
        got = hvd.broadcast(values(dt, ctx.rank, (), salt=1), root_rank=ctx.size - 1,
                            name=f"zd.bc.{dname(dt)}")
        chk.same(got, values(dt, ctx.size - 1, (), salt=1), f"broadcast {dname(dt)}")
    try:
        got = hvd.grouped_allreduce([values(np.float32, ctx.rank, ()), np.ones(2, np.float32)],
                                    op=hvd.Sum, name="zd.group")
    except Exception as e:  # noqa: BLE001 - reported with the other checks
        chk.true(False, f"grouped_allreduce raised {type(e).__name__}: {e}")
    else:
        chk.same(got[0], reduce([values(np.float32, r, ()) for r in range(ctx.size)], "Sum",
                                np.float32), "grouped 0-d")
    chk.done()


# -- grouped_allreduce ------------------------------------------------------------

GROUP_SHAPES = [(0,), (5,), (2, 3), (1,)]


def _grouped_case(dt):
    def fn(ctx):
        for op in (["Sum", "Max"] if is_bool(dt) else ["Sum", "Average"]):
            xs = [values(dt, ctx.rank, s, salt=i) for i, s in enumerate(GROUP_SHAPES)]
            got = hvd.grouped_allreduce(xs, name=f"gar.{dname(dt)}.{op}", op=OP[op])
            assert isinstance(got, list) and len(got) == len(xs)
            for i, s in enumerate(GROUP_SHAPES):
                want = reduce([values(dt, r, s, salt=i) for r in range(ctx.size)], op, dt)
                assert_same(got[i], want, f"{op} tensor {i} shape {s}")
    return fn


for _dt in DTYPES:
    CASES.add(f"grouped_allreduce/{dname(_dt)}", _grouped_case(_dt))


@CASES.case("grouped_allreduce/mixed_dtypes_async")
def _(ctx):
    dts = [np.float32, np.int32, np.float16, np.int64, np.float64]
    xs = [values(dt, ctx.rank, (4 + i,), salt=i) for i, dt in enumerate(dts)]
    h = hvd.grouped_allreduce_async(xs, name="gar.mixed", op=hvd.Sum)
    got = hvd.synchronize(h)
    for i, dt in enumerate(dts):
        want = reduce([values(dt, r, (4 + i,), salt=i) for r in range(ctx.size)], "Sum", dt)
        assert_same(got[i], want, f"tensor {i}")


# -- allgather --------------------------------------------------------------------

def _allgather_case(dt):
    def fn(ctx):
        n, me = ctx.size, ctx.rank
        # 2-D, rows per rank 0, 2, 1 (rank 0 contributes none)
        rows = lambda r: (2 * r) % 3  # noqa: E731
        got = hvd.allgather(values(dt, me, (rows(me), 3)), name=f"ag.{dname(dt)}.2d")
        assert_same(got, _concat([values(dt, r, (rows(r), 3)) for r in range(n)], (3,), dt),
                    "2-D with a rank of 0 rows")
        # 1-D, rows r + 1
        got = hvd.allgather(values(dt, me, (me + 1,), salt=1), name=f"ag.{dname(dt)}.1d")
        assert_same(got, _concat([values(dt, r, (r + 1,), salt=1) for r in range(n)], (), dt),
                    "1-D uneven")
        # 0-d input is gathered as shape (1,)
        got = hvd.allgather(values(dt, me, (), salt=2), name=f"ag.{dname(dt)}.0d")
        assert_same(got, _concat([values(dt, r, (1,), salt=2) for r in range(n)], (), dt),
                    "0-d")
        # every rank contributes 0 rows
        got = hvd.allgather(np.zeros((0, 2), dt), name=f"ag.{dname(dt)}.empty")
        assert_same(got, np.zeros((0, 2), dt), "all empty")
    return fn


for _dt in DTYPES:
    CASES.add(f"allgather/{dname(_dt)}", _allgather_case(_dt))


# -- broadcast ----------------------------------------------------------------------

def _broadcast_case(dt):
    def fn(ctx):
        chk = Checks()
        shapes = [(0,), (1,), (7,), (2, 3)]
        hs = {(root, k): hvd.broadcast_async(values(dt, ctx.rank, shape, salt=root + k),
                                             root_rank=root, name=f"bc.{dname(dt)}.{root}.{k}")
              for root in range(ctx.size) for k, shape in enumerate(shapes)}
        for (root, k), h in hs.items():
            chk.same(hvd.synchronize(h), values(dt, root, shapes[k], salt=root + k),
                     f"root {root} shape {shapes[k]}")
        chk.done()
    return fn


for _dt in DTYPES:
    CASES.add(f"broadcast/{dname(_dt)}", _broadcast_case(_dt))


# -- alltoall -----------------------------------------------------------------------

def _split(i: int, j: int) -> int:
    """Rows rank i sends to rank j: 0, 1 or 2 (zeros included)."""
    return (i + 2 * j + 1) % 3


def _block(dt, i: int, j: int) -> np.ndarray:
    return values(dt, 10 * i + j, (_split(i, j), 2))


def _alltoall_case(dt):
    def fn(ctx):
        n, me = ctx.size, ctx.rank
        send = _concat([_block(dt, me, j) for j in range(n)], (2,), dt)
        out, splits = hvd.alltoall(send, splits=[_split(me, j) for j in range(n)],
                                   name=f"a2a.{dname(dt)}.uneven")
        assert_same(out, _concat([_block(dt, i, me) for i in range(n)], (2,), dt), "uneven")
        assert list(np.asarray(splits)) == [_split(i, me) for i in range(n)], splits
        # without splits: an even share of 2 rows per rank
        send = _concat([values(dt, 10 * me + j, (2,)) for j in range(n)], (), dt)
        out, splits = hvd.alltoall(send, name=f"a2a.{dname(dt)}.even")
        assert_same(out, _concat([values(dt, 10 * i + me, (2,)) for i in range(n)], (), dt),
                    "even")
        assert list(np.asarray(splits)) == [2] * n, splits
        # nothing to send at all
        out, splits = hvd.alltoall(np.zeros((0, 3), dt), splits=[0] * n,
                                   name=f"a2a.{dname(dt)}.empty")
        assert_same(out, np.zeros((0, 3), dt), "empty")
        assert list(np.asarray(splits)) == [0] * n, splits
    return fn


for _dt in DTYPES:
    CASES.add(f"alltoall/{dname(_dt)}", _alltoall_case(_dt))


# -- reducescatter --------------------------------------------------------------------

def _reducescatter_case(dt, op):
    def fn(ctx):
        n, me = ctx.size, ctx.rank
        kwargs = {} if op == "Average" else {"op": OP[op]}  # Average is the default
        row_counts = (0, 1, 2 * n + 1, 4 * n)
        if is_bool(dt) and op == "Average":
            for rows in row_counts:
                expect_error(hvd.InvalidArgumentError, hvd.reducescatter,
                             values(dt, me, (rows, 3)), name=f"rs.{dname(dt)}.{op}.{rows}")
            return
        hs = [hvd.reducescatter_async(values(dt, me, (rows, 3), salt=rows),
                                      name=f"rs.{dname(dt)}.{op}.{rows}", **kwargs)
              for rows in row_counts]
        chk = Checks()
        for rows, h in zip(row_counts, hs):
            full = reduce([values(dt, r, (rows, 3), salt=rows) for r in range(n)], op, dt)
            counts = even_rows(rows, n)
            start = sum(counts[:me])
            chk.same(hvd.synchronize(h), full[start:start + counts[me]], f"{rows} rows")
        chk.done()
    return fn


for _dt in DTYPES:
    for _op in OPS:
        CASES.add(f"reducescatter/{dname(_dt)}/{_op}", _reducescatter_case(_dt, _op))


# -- barrier, join ---------------------------------------------------------------------

@CASES.case("barrier/waits_for_every_rank")
def _(ctx):
    time.sleep(0.05 * ctx.rank)
    entered = time.time()
    hvd.barrier()
    left = time.time()
    times = hvd.allgather(np.array([[entered, left]]), name="barrier.times")
    assert times[:, 1].min() >= times[:, 0].max() - 0.002, times


def _join_round(ctx, tag, steps, dt, ops, expect_last):
    """Rank r runs steps(r) steps of allreduce (each op) and allgather, then joins.

    As in Horovod, a rank that has joined adds zeros to every allreduce (whatever the
    op) and still counts in an Average; an allgather or broadcast while a rank has
    joined fails on the others, which go on."""
    n, me = ctx.size, ctx.rank
    for s in range(steps(me)):
        active = [r for r in range(n) if steps(r) > s]
        for op in ops:
            x = values(dt, me, (5,), salt=s)
            got = hvd.allreduce(x, op=OP[op], name=f"{tag}.{op}.{s}")
            want = reduce([values(dt, r, (5,), salt=s) if r in active
                           else np.zeros(5, dt) for r in range(n)], op, dt)
            assert_same(got, want, f"step {s} {op} (active ranks {active})")
        x = values(dt, me, (me % 2 + 1, 2), salt=s)
        if len(active) < n:
            for call in (lambda: hvd.allgather(x, name=f"{tag}.ag.{s}"),
                         lambda: hvd.broadcast(values(dt, me, (3,)), active[0],
                                               name=f"{tag}.bc.{s}")):
                err = expect_error(hvd.InvalidArgumentError, call)
                assert "have joined" in str(err), err
            continue
        got = hvd.allgather(x, name=f"{tag}.ag.{s}")
        want = _concat([values(dt, r, (r % 2 + 1, 2), salt=s) for r in active], (2,), dt)
        assert_same(got, want, f"step {s} allgather (active ranks {active})")
    last = hvd.join()
    assert last == expect_last, f"join() returned {last}, expected {expect_last}"


def _join_case(dt):
    def fn(ctx):
        ops = [o for o in OPS if not (is_bool(dt) and o == "Average")]
        _join_round(ctx, f"join.{dname(dt)}", lambda r: 1 + r, dt, ops, ctx.size - 1)
        # the engine is back to normal: every rank contributes again
        x = values(dt, ctx.rank, (3,))
        got = hvd.allreduce(x, op=hvd.Max, name=f"join.{dname(dt)}.after")
        assert_same(got, reduce([values(dt, r, (3,)) for r in range(ctx.size)], "Max", dt),
                    "after join")
    return fn


for _dt in DTYPES:
    CASES.add(f"join/uneven/{dname(_dt)}", _join_case(_dt))


@CASES.case("join/reversed_then_even")
def _(ctx):
    n = ctx.size
    _join_round(ctx, "joinrev", lambda r: 1 + (n - 1 - r), np.float32, ["Sum", "Average"], 0)
    hvd.barrier()
    last = hvd.join()  # every rank joins at once: any of them may count as last
    assert 0 <= last < n, last


# -- process sets -------------------------------------------------------------------------

def _check_in_set(ctx, ps, tag):
    members = ps.ranks
    me = ps.rank()
    m = len(members)
    dt = np.float32
    got = hvd.allreduce(values(dt, ctx.rank, (6,)), op=hvd.Sum, name=f"{tag}.sum",
                        process_set=ps)
    assert_same(got, reduce([values(dt, r, (6,)) for r in members], "Sum", dt), "sum")
    got = hvd.allreduce(values(np.int32, ctx.rank, (6,)), name=f"{tag}.avg", process_set=ps)
    assert_same(got, reduce([values(np.int32, r, (6,)) for r in members], "Average",
                            np.int32), "average over the set's ranks")
    got = hvd.allgather(values(dt, ctx.rank, (ctx.rank + 1,)), name=f"{tag}.ag",
                        process_set=ps)
    assert_same(got, np.concatenate([values(dt, r, (r + 1,)) for r in members]), "allgather")
    root = members[-1]  # a global rank, as in Horovod
    got = hvd.broadcast(values(dt, ctx.rank, (4,)), root_rank=root, name=f"{tag}.bc",
                        process_set=ps)
    assert_same(got, values(dt, root, (4,)), "broadcast")
    rows = 2 * m + 1
    got = hvd.reducescatter(values(dt, ctx.rank, (rows,)), op=hvd.Sum, name=f"{tag}.rs",
                            process_set=ps)
    full = reduce([values(dt, r, (rows,)) for r in members], "Sum", dt)
    counts = even_rows(rows, m)
    assert_same(got, full[sum(counts[:me]):sum(counts[:me + 1])], "reducescatter")
    out, splits = hvd.alltoall(np.full(m, ctx.rank, np.int64), name=f"{tag}.a2a",
                               process_set=ps)
    assert_same(out, np.array(members, np.int64), "alltoall")
    assert hvd.broadcast_object(("hi", ctx.rank), members[0], name=f"{tag}.obj",
                                process_set=ps) == ("hi", members[0])


@CASES.case("process_set/ops_add_remove")
def _(ctx):
    n, me = ctx.size, ctx.rank
    lo = hvd.add_process_set(hvd.ProcessSet(range(max(1, n - 1))))  # [0] or [0, 1]
    hi = hvd.add_process_set(range(1, n)) if n > 1 else None        # [1] or [1, 2]
    sets = [lo] + ([hi] if hi else [])
    assert len({ps.process_set_id for ps in sets}) == len(sets) and \
        all(ps.process_set_id not in (None, 0) for ps in sets)
    for i, ps in enumerate(sets):
        assert ps.included() == (me in ps.ranks)
        assert ps.rank() == (ps.ranks.index(me) if me in ps.ranks else -1)
        if ps.included():
            _check_in_set(ctx, ps, f"ps{i}")
    # ops on two sets and the global set in flight at once (rank 1 at 3 ranks is in both)
    handles = [(ps, hvd.allreduce_async(np.full(3, me + 1.0), op=hvd.Sum, name=f"ps.conc.{i}",
                                        process_set=ps))
               for i, ps in enumerate(sets) if ps.included()]
    g = hvd.allreduce_async(np.full(3, me + 1.0), op=hvd.Sum, name="ps.conc.global")
    for ps, h in handles:
        assert_same(hvd.synchronize(h), np.full(3, float(sum(r + 1 for r in ps.ranks))))
    assert_same(hvd.synchronize(g), np.full(3, float(n * (n + 1) // 2)))
    for ps in sets:
        assert hvd.remove_process_set(ps) is True
        assert hvd.remove_process_set(ps) is False
    expect_error(hvd.InvalidArgumentError, hvd.allreduce, np.ones(2), name="ps.removed",
                 process_set=lo)
    again = hvd.add_process_set(lo)
    if again.included():
        got = hvd.allreduce(np.ones(2), op=hvd.Sum, name="ps.again", process_set=again)
        assert_same(got, np.full(2, float(len(again.ranks))))
    hvd.remove_process_set(again)


# -- fusion, async ---------------------------------------------------------------------------

@CASES.case("fusion/200_small_tensors_in_flight")
def _(ctx):
    dts = [np.dtype(t) for t in (np.float32, np.int32, np.float64, np.float16, np.int8,
                                 BF16, np.uint8, np.int64)]
    specs = []
    for i in range(200):
        dt = dts[i % len(dts)]
        specs.append((dt, (i % 17,), ["Sum", "Average", "Max"][i % 3]))
    handles = [hvd.allreduce_async(values(dt, ctx.rank, shape, salt=i), op=OP[op],
                                   name=f"fuse.{i}")
               for i, (dt, shape, op) in enumerate(specs)]
    for i in reversed(range(len(specs))):
        dt, shape, op = specs[i]
        want = reduce([values(dt, r, shape, salt=i) for r in range(ctx.size)], op, dt)
        assert_same(hvd.synchronize(handles[i]), want, f"tensor {i} ({dname(dt)} {op})")


@CASES.case("fusion/mixed_ops_in_flight")
def _(ctx):
    n, me = ctx.size, ctx.rank
    hs = []
    for i in range(20):
        hs.append(("ar", i, hvd.allreduce_async(values(np.float32, me, (i,), salt=i),
                                                op=hvd.Sum, name=f"mix.ar.{i}")))
        hs.append(("ag", i, hvd.allgather_async(values(np.int32, me, (me + i % 2, 2), salt=i),
                                                name=f"mix.ag.{i}")))
        hs.append(("bc", i, hvd.broadcast_async(values(np.float64, me, (3,), salt=i),
                                                root_rank=i % n, name=f"mix.bc.{i}")))
    for kind, i, h in hs:
        got = hvd.synchronize(h)
        if kind == "ar":
            want = reduce([values(np.float32, r, (i,), salt=i) for r in range(n)], "Sum",
                          np.float32)
        elif kind == "ag":
            want = np.concatenate([values(np.int32, r, (r + i % 2, 2), salt=i)
                                   for r in range(n)])
        else:
            want = values(np.float64, i % n, (3,), salt=i)
        assert_same(got, want, f"{kind} {i}")


@CASES.case("fusion/independent_allreduces_of_one_cycle_are_fused")
def _(ctx):
    """Async allreduces of one dtype and op, in no group, that reach the core in one cycle
    (one submit_together block) are fused into one collective: the backend sends what one
    allreduce sends (tcp: a message per peer its algorithm talks to; shm: one round), not
    one per tensor, as _core.traffic() counts it."""
    from spark_hvd import _core, _ops

    backend = os.environ.get("SPARK_HVD_CPU_OPERATIONS", "") or "shm"
    if ctx.size < 2 or backend not in ("tcp", "shm") or \
            os.environ.get("SPARK_HVD_CONTROLLER", "gloo") != "gloo":
        raise Skip("counted on tcp and shm with 2 or more ranks")

    def sent():
        return _core.traffic()[backend]["data"]["messages"]

    k, me = 16, ctx.rank
    hvd.allreduce(np.ones(100, np.float32), op=hvd.Sum, name="fused.one")  # warm: cached
    before = sent()
    hvd.allreduce(np.ones(100, np.float32), op=hvd.Sum, name="fused.one")
    one = sent() - before
    for attempt in range(2):  # the first round's names are new; the second's are cached
        before = sent()
        with _ops.submit_together():
            hs = [hvd.allreduce_async(np.full(100, float(me + i), np.float32), op=hvd.Sum,
                                      name=f"fused.{i}") for i in range(k)]
        for i, h in enumerate(hs):
            want = np.full(100, float(sum(r + i for r in range(ctx.size))), np.float32)
            assert_same(hvd.synchronize(h), want, f"tensor {i}")
        together = sent() - before
        assert together == one, (f"round {attempt}: {k} allreduces of one cycle sent {together} "
                                 f"messages; one allreduce sends {one}")


@CASES.case("async/poll_and_synchronize")
def _(ctx):
    x = np.arange(1000, dtype=np.float64) + ctx.rank
    h = hvd.allreduce_async(x, op=hvd.Sum, name="async.poll")
    got = wait_for(h, 20, "allreduce_async", ctx)
    assert hvd.poll(h) is True
    assert_same(hvd.synchronize(h), got, "second synchronize")
    want = np.arange(1000, dtype=np.float64) * ctx.size + sum(range(ctx.size))
    assert_same(got, want)


# -- objects, topology, timeline --------------------------------------------------------------

@CASES.case("objects/broadcast_object_each_root")
def _(ctx):
    for root in range(ctx.size):
        obj = {"rank": ctx.rank, "items": list(range(ctx.rank * 3)), "blob": b"x" * ctx.rank}
        got = hvd.broadcast_object(obj, root_rank=root, name=f"bobj.{root}")
        assert got == {"rank": root, "items": list(range(root * 3)), "blob": b"x" * root}, got


@CASES.case("objects/allgather_object")
def _(ctx):
    got = hvd.allgather_object({"r": ctx.rank, "s": "y" * ctx.rank} if ctx.rank % 2 else None,
                               name="agobj")
    assert got == [({"r": r, "s": "y" * r} if r % 2 else None) for r in range(ctx.size)], got


@CASES.case("topology/single_host")
def _(ctx):
    n, me = hvd.size(), hvd.rank()
    assert n == int(os.environ["SPARK_HVD_SIZE"]) and me == int(os.environ["SPARK_HVD_RANK"])
    assert (hvd.local_rank(), hvd.local_size()) == (me, n)
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    assert hvd.is_homogeneous() and hvd.is_initialized()
    controller = os.environ.get("SPARK_HVD_CONTROLLER", "gloo")
    assert hvd.mpi_enabled() == (controller == "mpi"), controller
    assert hvd.gloo_enabled() == (controller == "gloo"), controller
    assert hvd.allgather_object(me, name="topo.ranks") == list(range(n))


@CASES.case("topology/backend_of_cpu_ops")
def _(ctx):
    """The backend the settings select runs the CPU ops (the timeline names it): the
    one SPARK_HVD_CPU_OPERATIONS names, mpi under mpirun, else shm (every rank is on
    this host); a process set of one rank too."""
    cpu = os.environ.get("SPARK_HVD_CPU_OPERATIONS", "")
    mpi = os.environ.get("SPARK_HVD_CONTROLLER", "gloo") == "mpi"
    want = (cpu or ("mpi" if mpi else "shm")).upper()
    path = os.path.join(ctx.outdir, f"timeline_backend_rank{ctx.rank}.json")
    alone = hvd.add_process_set([ctx.size - 1])
    hvd.start_timeline(path)
    hvd.allreduce(np.ones(10, np.float32), name="be.ar")
    hvd.allgather(np.ones((ctx.rank + 1, 2), np.int32), name="be.ag")
    hvd.broadcast(np.ones(3), root_rank=0, name="be.bc")
    if alone.included():
        hvd.allreduce(np.ones(2), name="be.alone", process_set=alone)
    hvd.stop_timeline()
    hvd.remove_process_set(alone)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    ran = {(e["args"]["tensor"], e["name"]) for e in events
           if e["ph"] == "X" and not e["name"].startswith(("NEGOTIATE", "MEMCPY"))}
    want_ops = {("be.ar", f"{want}_ALLREDUCE"), ("be.ag", f"{want}_ALLGATHER"),
                ("be.bc", f"{want}_BROADCAST")}
    if alone.included():
        want_ops.add(("be.alone", f"{want}_ALLREDUCE"))
    assert ran == want_ops, f"ran {sorted(ran)}, expected {sorted(want_ops)}"


def _check_where_ops_ran(path: str, sets: dict, want: set) -> None:
    """Stops the timeline at `path`, removes `sets`, and asserts that the ops it shows
    (tensor, activity) are `want`."""
    hvd.stop_timeline()
    for ps in sets.values():
        hvd.remove_process_set(ps)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    ran = {(e["args"]["tensor"], e["name"]) for e in events
           if e["ph"] == "X" and not e["name"].startswith(("NEGOTIATE", "MEMCPY", "BARRIER"))}
    assert ran == want, f"ran {sorted(ran)}, expected {sorted(want)}"


@CASES.case("hierarchy/where_ops_run")
def _(ctx):
    """At 2 hosts x 2 ranks with hierarchical allreduce and allgather (test_hosts.py):
    those run on the shm backend's hierarchical communicator, within and across hosts,
    in the global set, a set of one rank per host and a set within a host; broadcast, and
    a set with different numbers of ranks on the hosts, run on tcp."""
    if os.environ.get("HOROVOD_HIERARCHICAL_ALLREDUCE") != "1" or hvd.cross_size() != 2:
        raise Skip("needs 2 hosts and HOROVOD_HIERARCHICAL_ALLREDUCE=1 (test_hosts.py)")
    path = os.path.join(ctx.outdir, f"timeline_hierarchy_rank{ctx.rank}.json")
    sets = {"one_per_host": hvd.add_process_set([0, 2]), "host_a": hvd.add_process_set([0, 1]),
            "uneven": hvd.add_process_set([0, 1, 2])}
    hvd.start_timeline(path)
    want = {("h.ar", "SHM_ALLREDUCE"), ("h.ag", "SHM_ALLGATHER"), ("h.bc", "TCP_BROADCAST")}
    got = hvd.allreduce(values(np.float32, ctx.rank, (1031,)), op=hvd.Sum, name="h.ar")
    assert_same(got, reduce([values(np.float32, r, (1031,)) for r in range(4)], "Sum",
                            np.float32), "allreduce")
    got = hvd.allgather(values(np.int32, ctx.rank, (ctx.rank + 1, 2)), name="h.ag")
    assert_same(got, np.concatenate([values(np.int32, r, (r + 1, 2)) for r in range(4)]),
                "allgather")
    hvd.broadcast(np.ones(3), root_rank=3, name="h.bc")
    for tag, ps in sets.items():
        if ps.included():
            got = hvd.allreduce(values(np.int64, ctx.rank, (9,)), name=f"h.{tag}", process_set=ps)
            assert_same(got, reduce([values(np.int64, r, (9,)) for r in ps.ranks], "Average",
                                    np.int64), tag)
            want.add((f"h.{tag}", "TCP_ALLREDUCE" if tag == "uneven" else "SHM_ALLREDUCE"))
    _check_where_ops_ran(path, sets, want)


@CASES.case("hierarchy/allgather_by_default")
def _(ctx):
    """At 2 hosts x 2 ranks with no hierarchical setting (test_hosts.py): allgather is
    hierarchical where a set has 2 or more of its ranks on every host, flat (tcp) where one,
    or different numbers; allreduce stays flat. The host's shm group and the tcp link
    across hosts are made by the first hierarchical op, not before: sockets open then, and
    only then."""
    if "HOROVOD_HIERARCHICAL_ALLGATHER" in os.environ or hvd.cross_size() != 2:
        raise Skip("needs 2 hosts and the hierarchical settings unset (test_hosts.py)")
    path = os.path.join(ctx.outdir, f"timeline_hier_default_rank{ctx.rank}.json")
    sets = {"one_per_host": hvd.add_process_set([0, 2]),
            "uneven": hvd.add_process_set([0, 1, 2])}
    hvd.start_timeline(path)
    got = hvd.allreduce(values(np.float32, ctx.rank, (1031,)), op=hvd.Sum, name="hd.ar")
    assert_same(got, reduce([values(np.float32, r, (1031,)) for r in range(4)], "Sum",
                            np.float32), "allreduce")
    want = {("hd.ar", "TCP_ALLREDUCE"), ("hd.ag", "SHM_ALLGATHER"),
            ("hd.ag2", "SHM_ALLGATHER")}
    hvd.barrier()
    before = open_sockets()
    expect = [values(np.int32, r, (r + 1, 2)) for r in range(4)]
    assert_same(hvd.allgather(values(np.int32, ctx.rank, (ctx.rank + 1, 2)), name="hd.ag"),
                np.concatenate(expect), "allgather")
    first = open_sockets()
    assert_same(hvd.allgather(values(np.int32, ctx.rank, (ctx.rank + 1, 2)), name="hd.ag2"),
                np.concatenate(expect), "allgather again")
    again = open_sockets()
    # local rank 0: the shm peer and the tcp mesh across hosts (a listener and the other
    # host's local rank 0); local rank 1: the shm peer only.
    opened = 3 if hvd.local_rank() == 0 else 1
    assert (first - before, again - first) == (opened, 0), (before, first, again)
    for tag, ps in sets.items():
        if ps.included():
            got = hvd.allgather(values(np.int64, ctx.rank, (2,)), name=f"hd.{tag}",
                                process_set=ps)
            assert_same(got, np.concatenate([values(np.int64, r, (2,)) for r in ps.ranks]), tag)
            want.add((f"hd.{tag}", "TCP_ALLGATHER"))
    _check_where_ops_ran(path, sets, want)


@CASES.case("timeline/start_stop_names_tensors")
def _(ctx):
    path = os.path.join(ctx.outdir, f"timeline_api_rank{ctx.rank}.json")
    hvd.start_timeline(path)
    hvd.allreduce(np.ones(10, np.float32), name="tl.alpha")
    hvd.allgather(np.ones((ctx.rank + 1, 2), np.int32), name="tl.beta")
    hvd.broadcast(np.ones(3), root_rank=0, name="tl.gamma")
    hvd.stop_timeline()
    hvd.allreduce(np.ones(2), name="tl.after_stop")
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    assert isinstance(events, list) and events, trace
    named = set()
    for e in events:
        assert {"name", "ph", "pid"} <= set(e), e
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] >= 0, e
        named.add(e.get("args", {}).get("tensor"))
        named.add(e.get("args", {}).get("name"))
    for name in ("tl.alpha", "tl.beta", "tl.gamma"):
        assert name in named, f"{name} not in the timeline: {sorted(map(str, named))}"
    assert "tl.after_stop" not in named


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@CASES.case("soak/rss_flat_over_repeated_steps", timeout_s=120)
def _(ctx):
    """20,000 small allreduces (40 steps of 500 in flight, the same names each step, as
    gradients) and 1,000 of 1 MiB (50 steps of 20): every result right, and the resident
    memory after the second half within 5 % of what it was after the first."""
    if ctx.size != 2:
        raise Skip("run at 2 ranks only (the soak costs seconds)")
    n = ctx.size
    small = [np.full(4, float(i % 7), np.float32) for i in range(500)]
    big = [np.full(1 << 18, float(i % 5), np.float32) for i in range(20)]

    def step(tensors, tag):
        hs = [hvd.allreduce_async(x, op=hvd.Sum, name=f"soak.{tag}.{i}")
              for i, x in enumerate(tensors)]
        for x, h in zip(tensors, hs):
            got = hvd.synchronize(h)
            assert got[0] == x[0] * n and got[-1] == x[-1] * n, (tag, got[:2], x[:2])

    rss = []
    for half in range(2):
        for _ in range(20):
            step(small, "small")
        for _ in range(25):
            step(big, "big")
        rss.append(_rss_bytes())
    assert rss[1] <= rss[0] * 1.05, f"resident memory grew {rss[0]} -> {rss[1]} bytes"


# -- last: a case whose failure can leave the ranks' generated names out of step -------------

@CASES.case("process_set/barrier_on_overlapping_sets")
def _(ctx):
    """barrier(process_set=) on two sets that share a rank: at 3 ranks, rank 1 is in
    both [0, 1] and [1, 2] and calls barrier on each; the others call it once."""
    n, me = ctx.size, ctx.rank
    if n < 3:
        raise Skip("needs 3 ranks for two sets that share a rank")
    lo = hvd.add_process_set(range(n - 1))
    hi = hvd.add_process_set(range(1, n))
    hung = []
    for ps in (lo, hi):
        if ps is not None and ps.included():
            done = threading.Event()
            t = threading.Thread(target=lambda: (hvd.barrier(process_set=ps), done.set()),
                                 daemon=True)
            t.start()
            if not done.wait(5):
                hung.append(ps)
    hvd.allreduce(np.ones(1), name="psb.sync")  # every rank gets here, hung or not
    for ps in (lo, hi):
        if ps is not None:
            hvd.remove_process_set(ps)
    assert not hung, f"barrier(process_set=...) on rank {me} did not return within 5 s " \
        f"(hang) for {hung}"


@CASES.case("process_set/same_name_in_two_sets")
def _(ctx):
    """The same tensor name used at once in two disjoint sets: [0, 1] and [2, ...]. Rank
    1 is late, so rank 0's and rank 2's requests meet in negotiation first: rank 0
    submits before the global 'pss.first' (so its request is negotiated by the time
    that completes), ranks 2, ... after it, and rank 1 only after 'pss.second', which
    they submit after their own request."""
    n, me = ctx.size, ctx.rank
    if n < 3:
        raise Skip("needs 3 ranks (sets [0, 1] and [2, ...])")
    a = hvd.add_process_set([0, 1])
    b = hvd.add_process_set(range(2, n))
    mine = a if me < 2 else b

    def submit():
        return hvd.allreduce_async(np.full(2, me + 1.0), op=hvd.Sum, name="pss.grad",
                                   process_set=mine)

    h = submit() if me == 0 else None
    hvd.allreduce(np.ones(1), name="pss.first")
    h = submit() if me >= 2 else h
    hvd.allreduce(np.ones(1), name="pss.second")
    h = submit() if me == 1 else h
    try:
        got = wait_for(h, 5, f"allreduce 'pss.grad' in {mine} on rank {me}", ctx)
    finally:  # every rank reaches this point, whatever happened above
        hvd.allreduce(np.ones(1), name="pss.sync")
        hvd.remove_process_set(a)
        hvd.remove_process_set(b)
    assert_same(got, np.full(2, sum(r + 1.0 for r in mine.ranks)))
