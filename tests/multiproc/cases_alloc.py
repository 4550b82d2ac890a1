"""No heap allocation per op in steady state (issue 24's rule), counted on the engine's
thread by `_core.engine_allocations()` (every operator new it makes, in the core and in
the C++ library; csrc/common/alloc_count.h), run by case_worker.py on 2 ranks over tcp
and shm (test_mp_alloc.py).

Each case warms a step up (its tensors cached, the engine's buffers grown), then runs N
and 2N more steps, fenced (_fence), under names longer than a string's inline buffer (so
that a copied name would allocate): an allreduce (fused and not), a broadcast and the
steady cycles between them allocate nothing (but for HIGH_WATER_ALLOCATIONS, once); an
allgather allocates exactly its output, which the caller keeps (the buffer, the object
sharing it, the shape), and nothing else.
"""

from __future__ import annotations

# The core before numpy: its operator new then also serves the C++ library's own code
# (std::string growth), which binds to the first definition loaded (alloc_count.h).
from spark_hvd import _core

import numpy as np  # noqa: E402

import spark_hvd as hvd  # noqa: E402
from harness import Registry  # noqa: E402
from refdata import assert_same, values  # noqa: E402

CASES = Registry()
WARM_STEPS = 30
STEPS = 100
# The engine's kept lists grow, once, when a cycle first brings more responses (or a fused
# response more tensors) than any before: how the async ops fall into cycles depends on
# timing, so that may come after the warm-up. A few allocations per new response or tensor,
# never more with more steps; an allocation per op or per cycle makes at least STEPS.
HIGH_WATER_ALLOCATIONS = 32
# An allgather's output: its buffer (a vector and the shared owner made with it) and the
# output shape; the caller keeps them (executor.cc).
ALLGATHER_OUTPUT_ALLOCATIONS = 3


def _fence() -> None:
    """A cached allreduce every rank runs: it allocates nothing in steady state. Reading
    the count between two fences sees only the steps between them: no rank is still on
    an earlier op, or already on a later, uncached one (whose request, received in full,
    allocates on every rank's engine)."""
    hvd.allreduce(np.zeros(1, np.float32), name="alloc.steady.fence")


def check_steady(ctx, step, per_step: int = 0, steps: int = STEPS) -> None:
    """Runs `step` WARM_STEPS times, then `steps` and 2 x `steps` times, and asserts the
    engine's threads allocated `per_step` per step (and at most HIGH_WATER_ALLOCATIONS
    more) in each: an allocation per step or per op grows with the steps (`steps` must
    exceed HIGH_WATER_ALLOCATIONS for one per step to show)."""
    assert steps > HIGH_WATER_ALLOCATIONS
    # The hook sees the library's allocations too, else a string that grows per op would
    # go unseen and this case could not fail.
    assert _core._probe_allocations() >= 2, (
        "the allocation hook misses std::string growth: import spark_hvd._core before "
        "numpy (or anything else that loads libstdc++)")
    for i in range(WARM_STEPS):
        step(i)
        _fence()
    counts = [_core.engine_allocations()]
    for n in (steps, 2 * steps):
        for i in range(n):
            step(i)
        _fence()
        counts.append(_core.engine_allocations())
    _fence()  # no rank goes on to the next case (or to shutdown) before all have counted
    grown_n, grown_2n = counts[1] - counts[0], counts[2] - counts[1]
    extra_n, extra_2n = grown_n - per_step * steps, grown_2n - 2 * per_step * steps
    assert 0 <= extra_n <= HIGH_WATER_ALLOCATIONS and 0 <= extra_2n <= HIGH_WATER_ALLOCATIONS, (
        f"rank {ctx.rank}: the engine thread made {grown_n} heap allocations over {steps} "
        f"steady steps and {grown_2n} over {2 * steps}; expected {per_step} per step (and "
        f"at most {HIGH_WATER_ALLOCATIONS} more in each: kept lists reaching a new high-water "
        "mark). csrc/engine: reuse member buffers, free lists or fixed arrays per op")


@CASES.case("steady_allreduce_allocates_nothing")
def steady_allreduce(ctx):
    x = values(np.float32, ctx.rank, (16,))
    want = sum(values(np.float32, r, (16,)) for r in range(ctx.size))

    def step(i):
        # Eight async ones that the cycle may fuse, then one blocking (a loss).
        hs = [hvd.allreduce_async(x, op=hvd.Sum, name=f"alloc.steady.allreduce.{j}")
              for j in range(8)]
        for h in hs:
            assert_same(hvd.synchronize(h), want)
        assert_same(hvd.allreduce(x, op=hvd.Sum, name="alloc.steady.allreduce.loss"), want)

    check_steady(ctx, step)


@CASES.case("steady_broadcast_allocates_nothing")
def steady_broadcast(ctx):
    x = values(np.float32, ctx.rank, (16,))
    root = ctx.size - 1
    want = values(np.float32, root, (16,))

    def step(i):
        assert_same(hvd.broadcast(x, root, name="alloc.steady.broadcast"), want)

    check_steady(ctx, step)


@CASES.case("steady_allgather_allocates_only_its_output")
def steady_allgather(ctx):
    x = values(np.float32, ctx.rank, (2, 3))
    want = np.concatenate([values(np.float32, r, (2, 3)) for r in range(ctx.size)])

    def step(i):
        assert_same(hvd.allgather(x, name="alloc.steady.allgather"), want)

    check_steady(ctx, step, per_step=ALLGATHER_OUTPUT_ALLOCATIONS)
