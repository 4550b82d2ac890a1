"""Cases run under non-default engine settings (test_mp_knobs.py sets the env):
a tiny fusion buffer, a tiny or disabled response cache, SPARK_HVD_TIMELINE."""

from __future__ import annotations

import os

import numpy as np

import spark_hvd as hvd
from harness import Registry
from refdata import BF16, Checks, reduce, values

CASES = Registry()


@CASES.case("knobs/env_reaches_every_rank")
def _(ctx):
    for var in ("SPARK_HVD_FUSION_THRESHOLD", "SPARK_HVD_CACHE_CAPACITY"):
        assert var in os.environ, f"{var} not set on rank {ctx.rank}"


@CASES.case("knobs/fusion_tensors_around_the_threshold")
def _(ctx):
    """With SPARK_HVD_FUSION_THRESHOLD=4096 (or 0: no fusion): tensors below, at and
    above the threshold, of several dtypes, all in flight together."""
    n, me = ctx.size, ctx.rank
    specs = [(np.dtype(np.float32), (300,))] * 40 + [(np.dtype(np.float32), (1024,)),
                                                    (np.dtype(np.float32), (10001,))] \
        + [(np.dtype(np.int8), (i,)) for i in range(30)] + [(BF16, (2049,)),
                                                          (np.dtype(np.float64), (513,))]
    hs = [hvd.allreduce_async(values(dt, me, shape, salt=i), op=hvd.Sum, name=f"kf.{i}")
          for i, (dt, shape) in enumerate(specs)]
    chk = Checks()
    for i, (dt, shape) in enumerate(specs):
        want = reduce([values(dt, r, shape, salt=i) for r in range(n)], "Sum", dt)
        chk.same(hvd.synchronize(hs[i]), want, f"tensor {i} {dt} {shape}")
    chk.done()


@CASES.case("knobs/cache_churn")
def _(ctx):
    """More live names than SPARK_HVD_CACHE_CAPACITY, over many steps, with a shape
    change half-way: evictions and re-insertions must keep results right."""
    n, me = ctx.size, ctx.rank
    chk = Checks()
    for s in range(15):
        for j in range(6):
            shape = (j + 1,) if s < 8 else (j + 2, 2)
            op = ["Sum", "Max", "Average"][j % 3]
            got = hvd.allreduce(values(np.float32, me, shape, salt=s), name=f"kc.{j}",
                                op={"Sum": hvd.Sum, "Max": hvd.Max, "Average": hvd.Average}[op])
            chk.same(got, reduce([values(np.float32, r, shape, salt=s) for r in range(n)], op,
                                 np.float32), f"step {s} tensor {j}")
    chk.done()


@CASES.case("knobs/cache_capacity_bounds_the_hits")
def _(ctx):
    """SPARK_HVD_CACHE_CAPACITY=0 turns the response cache off (no hits); a capacity of
    at least the 3 names of a repeated step serves every step after the first from it."""
    from spark_hvd import _core

    capacity = int(os.environ["SPARK_HVD_CACHE_CAPACITY"])
    before = _core.cache_stats()
    for s in range(5):
        for j in range(3):
            hvd.allreduce(np.ones(j + 1, np.float32), name=f"kcap.{j}")
    after = _core.cache_stats()
    hits, misses = (after[k] - before[k] for k in ("hits", "misses"))
    if capacity == 0:
        assert (hits, misses) == (0, 15), (capacity, before, after)
    elif capacity >= 3 + 6:  # cache_churn's 6 names may hold slots
        assert (hits, misses) == (12, 3), (capacity, before, after)
    else:
        assert hits + misses == 15, (capacity, before, after)


@CASES.case("knobs/timeline_tensors")
def _(ctx):
    """Ops the test then looks for in the SPARK_HVD_TIMELINE file."""
    hvd.allreduce(np.ones(8, np.float32), name="knobs.tl.alpha")
    hvd.allgather(np.ones((ctx.rank + 1, 2), np.int32), name="knobs.tl.beta")
    hvd.broadcast(np.ones(3), root_rank=ctx.size - 1, name="knobs.tl.gamma")


@CASES.case("knobs/fused_odd_sizes_every_op")
def _(ctx):
    """Fused allreduces whose total is no size class of the Gloo backend (the engine
    pads with zeros) and lone ones larger than SPARK_HVD_GLOO_CHUNK_BYTES (run in
    pieces), for every op: the padding and the piece edges must not leak into results."""
    n, me = ctx.size, ctx.rank
    chk = Checks()
    ops = {"Sum": hvd.Sum, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product,
           "Average": hvd.Average}
    specs = [(np.float32, (1500,)), (np.float32, (777,)), (np.float64, (1025,)),
             (np.int32, (3001,)), (np.float32, (20011,))]
    for step in range(3):
        for op in ops:
            hs = [hvd.allreduce_async(values(dt, me, shape, salt=i + step), op=ops[op],
                                      name=f"ko.{op}.{i}")
                  for i, (dt, shape) in enumerate(specs)]
            for i, (dt, shape) in enumerate(specs):
                want = reduce([values(dt, r, shape, salt=i + step) for r in range(n)], op, dt)
                chk.same(hvd.synchronize(hs[i]), want, f"step {step} {op} tensor {i} {shape}")
    chk.done()


@CASES.case("knobs/process_set_op_after_idle")
def _(ctx):
    """After the engines idled long enough to back off their cycles, an op of a process
    set that leaves a rank out (that rank has no work of its own) still completes."""
    import time

    n, me = ctx.size, ctx.rank
    sub = hvd.add_process_set(range(n - 1)) if n > 1 else None
    time.sleep(0.3)
    chk = Checks()
    if sub is not None and me in sub.ranks:
        got = hvd.allreduce(values(np.float32, me, (5,)), op=hvd.Sum, name="kp.sub",
                            process_set=sub)
        chk.same(got, reduce([values(np.float32, r, (5,)) for r in range(n - 1)], "Sum",
                             np.float32), "process-set allreduce after idle")
    time.sleep(0.3)
    got = hvd.allreduce(values(np.float32, me, (3,)), op=hvd.Sum, name="kp.all")
    chk.same(got, reduce([values(np.float32, r, (3,)) for r in range(n)], "Sum", np.float32),
             "global allreduce after idle")
    if sub is not None:
        hvd.remove_process_set(sub)
    chk.done()
