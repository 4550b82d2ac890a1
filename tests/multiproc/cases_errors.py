"""Error cases, run by case_worker.py on 1, 2 and 3 ranks: ops before init() and after
shutdown(), invalid arguments and tensor mismatches (a duplicate in-flight name:
cases_lifetime.py).

Ops that might hang are waited on with a deadline (harness.wait_for), so a hang fails
its case instead of the job.
"""

from __future__ import annotations

import re
import time

import numpy as np

import spark_hvd as hvd
from harness import (POST_SHUTDOWN, PRE_INIT, CaseTimeout, Registry, Skip, expect_error,
                     wait_for)
from refdata import assert_same

CASES = Registry()
HANG_S = 3.0  # an error is decided within a few 1 ms cycles; this is a hang


def _not_initialized(what: str, fn, *args, **kwargs) -> None:
    err = expect_error(hvd.NotInitializedError, fn, *args, **kwargs)
    assert "init()" in str(err), f"{what}: the message should say to call init(): {err}"


def _every_op_not_initialized() -> None:
    x = np.ones(4, np.float32)
    failures = []
    for what, fn, args, kwargs in [
        ("allreduce", hvd.allreduce, (x,), {"name": "pre.ar"}),
        ("allreduce_async", hvd.allreduce_async, (x,), {"name": "pre.ara"}),
        ("grouped_allreduce", hvd.grouped_allreduce, ([x],), {"name": "pre.gar"}),
        ("allgather", hvd.allgather, (x,), {"name": "pre.ag"}),
        ("broadcast", hvd.broadcast, (x, 0), {"name": "pre.bc"}),
        ("alltoall", hvd.alltoall, (x,), {"splits": [4], "name": "pre.a2a"}),
        ("reducescatter", hvd.reducescatter, (x,), {"name": "pre.rs"}),
        ("barrier", hvd.barrier, (), {}),
        ("join", hvd.join, (), {}),
        ("broadcast_object", hvd.broadcast_object, ({"a": 1},), {}),
        ("allgather_object", hvd.allgather_object, ({"a": 1},), {}),
        ("add_process_set", hvd.add_process_set, ([0],), {}),
        ("rank", hvd.rank, (), {}),
        ("size", hvd.size, (), {}),
        ("local_rank", hvd.local_rank, (), {}),
        ("start_timeline", hvd.start_timeline, ("/tmp/never-written.json",), {}),
    ]:
        try:
            _not_initialized(what, fn, *args, **kwargs)
        except AssertionError as e:
            failures.append(f"{what}: {e}")
    assert hvd.is_initialized() is False
    assert not failures, "\n".join(failures)


@CASES.case("before_init/every_op_raises_not_initialized", phase=PRE_INIT)
def _(ctx):
    _every_op_not_initialized()


# -- invalid arguments -----------------------------------------------------------------

@CASES.case("invalid/bool_average_and_scaling")
def _(ctx):
    b = np.array([True, False, True])
    for what, kwargs in [("Average", {"op": hvd.Average}), ("default op", {}),
                         ("prescale", {"op": hvd.Sum, "prescale_factor": 2.0}),
                         ("postscale", {"op": hvd.Max, "postscale_factor": 0.5})]:
        err = expect_error(hvd.InvalidArgumentError, hvd.allreduce, b,
                           name=f"inv.bool.{what}", **kwargs)
        assert "bool" in str(err), f"{what}: {err}"
    expect_error(hvd.InvalidArgumentError, hvd.reducescatter, b, name="inv.bool.rs")
    # and the engine still works
    got = hvd.allreduce(b, op=hvd.Sum, name="inv.bool.ok")
    assert_same(got, b)


@CASES.case("invalid/unsupported_dtype")
def _(ctx):
    for dt in (np.complex64, np.uint16, np.uint32, object):
        err = expect_error(hvd.InvalidArgumentError, hvd.allreduce, np.zeros(3, dt),
                           name=f"inv.dtype.{np.dtype(dt).name}")
        assert np.dtype(dt).name in str(err), str(err)


@CASES.case("invalid/broadcast_root_out_of_range")
def _(ctx):
    for root in (ctx.size, -1):
        err = expect_error(hvd.InvalidArgumentError, hvd.broadcast, np.ones(2), root,
                           name=f"inv.root.{root}")
        assert str(root) in str(err), str(err)


@CASES.case("invalid/alltoall_splits")
def _(ctx):
    n = ctx.size
    x = np.ones(2 * n, np.float32)
    expect_error(hvd.InvalidArgumentError, hvd.alltoall, x, splits=[2 * n] + [0] * n,
                 name="inv.a2a.count")        # one split too many
    expect_error(hvd.InvalidArgumentError, hvd.alltoall, x, splits=[2 * n + 1] + [0] * (n - 1),
                 name="inv.a2a.sum")          # more rows than the tensor has
    negative = [-1, 2 * n + 1] + [0] * (n - 2) if n >= 2 else [-1]
    expect_error(hvd.InvalidArgumentError, hvd.alltoall, x, splits=negative,
                 name="inv.a2a.negative")
    expect_error(hvd.InvalidArgumentError, hvd.alltoall, np.float32(1), name="inv.a2a.0d")
    if n > 1:
        expect_error(hvd.InvalidArgumentError, hvd.alltoall, np.ones(n + 1), name="inv.a2a.even")
    out, splits = hvd.alltoall(x, name="inv.a2a.ok")  # the engine still works
    assert list(splits) == [2] * n


@CASES.case("invalid/process_sets")
def _(ctx):
    n = ctx.size
    expect_error(hvd.InvalidArgumentError, hvd.ProcessSet, [])
    expect_error(hvd.InvalidArgumentError, hvd.ProcessSet, [0, 0])
    expect_error(hvd.InvalidArgumentError, hvd.add_process_set, [0, n])
    unregistered = hvd.ProcessSet([0])
    err = expect_error(hvd.InvalidArgumentError, hvd.allreduce, np.ones(2), name="inv.ps.unreg",
                       process_set=unregistered)
    assert "add_process_set" in str(err), str(err)
    if n > 1:
        ps = hvd.add_process_set([0])
        if ctx.rank != 0:
            err = expect_error(hvd.InvalidArgumentError, hvd.allreduce, np.ones(2),
                               name="inv.ps.nonmember", process_set=ps)
            assert "not a member" in str(err), str(err)
        hvd.remove_process_set(ps)
    got = hvd.allreduce(np.ones(2), op=hvd.Sum, name="inv.ps.ok")
    assert_same(got, np.full(2, float(n)))


# -- tensor mismatches (2+ ranks) --------------------------------------------------------
#
# All mismatching ops are submitted together and waited on with one deadline, so a
# mismatch that hangs costs HANG_S once per job, not once per case.

def _mismatches(n: int, me: int):
    """name -> (submit function, the two values the message must name)."""
    odd = me == n - 1  # the last rank disagrees
    f32 = np.float32
    return {
        "shape": (lambda nm: hvd.allreduce_async(np.ones(5 if odd else 3, f32), name=nm),
                  ("3", "5")),
        "dtype": (lambda nm: hvd.allreduce_async(np.ones(3, np.float64 if odd else f32),
                                                 name=nm), ("float32", "float64")),
        "reduce_op": (lambda nm: hvd.allreduce_async(np.ones(3, f32), name=nm,
                                                     op=hvd.Max if odd else hvd.Sum),
                      ("sum", "max")),
        "prescale": (lambda nm: hvd.allreduce_async(np.ones(3, f32), name=nm, op=hvd.Sum,
                                                    prescale_factor=2.0 if odd else 1.0),
                     ("1", "2")),
        "broadcast_root": (lambda nm: hvd.broadcast_async(np.ones(3, f32), 1 if odd else 0,
                                                          name=nm), ("0", "1")),
        "allgather_trailing_dims": (lambda nm: hvd.allgather_async(
            np.ones((2, 4 if odd else 3), f32), name=nm), ("3", "4")),
        "op_type": (lambda nm: hvd.allgather_async(np.ones(3, f32), name=nm) if odd else
                    hvd.allreduce_async(np.ones(3, f32), name=nm), ("allreduce", "allgather")),
        "reducescatter_shape": (lambda nm: hvd.reducescatter_async(
            np.ones((7 if odd else 6, 2), f32), name=nm), ("6", "7")),
        "after_cache": (lambda nm: hvd.allreduce_async(np.ones(5 if odd else 3, f32), name=nm),
                        ("3", "5")),
    }


def _named_group(base: str, suffixes, op=hvd.Sum):
    """A grouped allreduce of ones whose members are named base + suffix: the public
    grouped ops name them base.0, base.1, ..., so only this gives two ranks different
    members in one group."""
    from spark_hvd import _ops
    from spark_hvd._types import OpType, numpy_code

    handles = []
    with _ops.submit_together():
        for suffix in suffixes:
            x, out = np.ones(2, np.float32), np.empty(2, np.float32)
            handles.append(_ops.submit(
                OpType.ALLREDUCE, base + suffix, numpy_code(x.dtype), x.shape, x.ctypes.data,
                out.ctypes.data, (x, out), lambda r, o=out: o, reduce_op=op, group=base,
                group_size=len(suffixes)))
    return _ops.GroupHandle(handles, list)


def _group_mismatches(n: int, me: int):
    """name -> (submit function giving a group handle, the two values the message must
    name): one member disagrees on the last rank; every member must fail."""
    odd = me == n - 1

    def ones(*shape, dt=np.float32):
        return np.ones(shape, dt)
    return {
        "group_allreduce_dtype": (lambda nm: hvd.grouped_allreduce_async(
            [ones(3), ones(2, dt=np.float64 if odd else np.float32)], name=nm),
            ("float32", "float64")),
        "group_allreduce_shape": (lambda nm: hvd.grouped_allreduce_async(
            [ones(3), ones(5 if odd else 4), ones(2)], name=nm), ("4", "5")),
        "group_allgather_trailing_dims": (lambda nm: hvd.grouped_allgather_async(
            [ones(2, 3), ones(1, 4 if odd else 3)], name=nm), ("3", "4")),
        "group_reducescatter_shape": (lambda nm: hvd.grouped_reducescatter_async(
            [ones(6, 2), ones(7 if odd else 6, 2)], name=nm), ("6", "7")),
        # the last rank's third member is in no other rank's group: it must fail too
        "group_member_count": (lambda nm: hvd.grouped_allreduce_async(
            [ones(2)] * (3 if odd else 2), name=nm), ("2", "3")),
        "group_member_names": (lambda nm: _named_group(nm, [".0", ".x" if odd else ".1"]),
                               ("mm.group_member_names.1", "mm.group_member_names.x")),
    }


# every group name again, agreeing (3 members: the count case's third one too)
_REUSE = {kind: [".0", ".1", ".2"] for kind in _group_mismatches(2, 0)}
_REUSE["group_member_names"] = [".0", ".1", ".x"]

_OUTCOMES: dict = {}


def _mismatch_outcomes(ctx) -> dict:
    """Submits every mismatch at once (first), returns name -> exception or result."""
    if _OUTCOMES:
        return _OUTCOMES
    n, me = ctx.size, ctx.rank
    cases = _mismatches(n, me)
    for step in range(3):  # warm the response cache with an agreeing shape first
        hvd.allreduce(np.ones(3, np.float32), name="mm.after_cache")
    handles = {}
    for kind, (submit, _) in list(cases.items()) + list(_group_mismatches(n, me).items()):
        try:
            handles[kind] = submit(f"mm.{kind}")
        except Exception as e:  # noqa: BLE001 - raised at submit: recorded as the outcome
            _OUTCOMES[kind] = e
    deadline = time.monotonic() + HANG_S
    for kind, h in handles.items():
        try:
            _OUTCOMES[kind] = wait_for(h, max(0.1, deadline - time.monotonic()),
                                       f"mismatched tensor mm.{kind}", ctx)
        except Exception as e:  # noqa: BLE001 - the outcome under test
            _OUTCOMES[kind] = e
        if h.members and not isinstance(_OUTCOMES[kind], CaseTimeout):  # each member's own
            _OUTCOMES[kind] = [_outcome(hvd.synchronize, m) for m in h.members]
    # the engine keeps working after mismatch errors, and the failed groups' names are free
    try:
        h = hvd.allreduce_async(np.ones(2, np.float32), op=hvd.Sum, name="mm.healthy")
        _OUTCOMES["__healthy__"] = wait_for(h, HANG_S, "the allreduce after the mismatches", ctx)
        groups = [_named_group(f"mm.{kind}", names) for kind, names in _REUSE.items()]
        _OUTCOMES["__reuse__"] = [wait_for(g, HANG_S, "a failed group's names again", ctx)
                                  for g in groups]
    except Exception as e:  # noqa: BLE001
        _OUTCOMES.setdefault("__healthy__", e)
        _OUTCOMES["__reuse__"] = e
    return _OUTCOMES


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the outcome under test
        return e


def _mismatch_case(kind: str, grouped: bool = False):
    def fn(ctx):
        if ctx.size < 2:
            raise Skip("a mismatch needs 2 or more ranks")
        outcomes = _mismatch_outcomes(ctx)[kind]
        what = f"grouped op 'mm.{kind}'" if grouped else f"tensor 'mm.{kind}'"
        if isinstance(outcomes, CaseTimeout):
            raise AssertionError(f"{what} with a mismatch hung instead of raising "
                                 f"TensorMismatchError: {outcomes}")
        if not grouped:
            outcomes = [outcomes]
        assert isinstance(outcomes, list), f"submitting the group raised: {outcomes!r}"
        wrong = [o for o in outcomes if not isinstance(o, hvd.TensorMismatchError)]
        assert not wrong, "expected TensorMismatchError on every rank (and member), got " \
            + ", ".join(f"{type(o).__name__}: {o}" for o in wrong)
        msg = str(outcomes[0])
        assert all(str(o) == msg and o.ranks == outcomes[0].ranks for o in outcomes), \
            f"the members failed with different errors: {[str(o) for o in outcomes]}"
        tensors = sorted(o.tensor for o in outcomes)
        if grouped:  # each member's own name, the group named in the message
            assert len(set(tensors)) == len(outcomes) and \
                all(t.startswith(f"mm.{kind}.") for t in tensors), f"exc.tensor: {tensors}"
            assert what in msg, f"the message should name the group: {msg}"
        else:
            assert tensors == [f"mm.{kind}"], f"exc.tensor is {tensors[0]!r}: {msg}"
            assert f"mm.{kind}" in msg, f"the message should name the tensor: {msg}"
            assert f"rank {ctx.size - 1}" in msg, \
                f"the message should name rank {ctx.size - 1}: {msg}"
        assert outcomes[0].ranks == [0, ctx.size - 1], \
            f"exc.ranks should be the two ranks that disagree, got {outcomes[0].ranks}: {msg}"
        table = _group_mismatches if grouped else _mismatches
        for value in table(ctx.size, ctx.rank)[kind][1]:
            assert re.search(rf"(?<![\w.]){re.escape(value)}(?![\w])", msg, re.IGNORECASE), \
                f"the message should name the value {value!r}: {msg}"
    return fn


for _kind in _mismatches(2, 0):
    CASES.add(f"mismatch/{_kind}", _mismatch_case(_kind))
for _kind in _group_mismatches(2, 0):
    CASES.add(f"mismatch/{_kind}", _mismatch_case(_kind, grouped=True))


@CASES.case("mismatch/engine_still_works_after")
def _(ctx):
    """An allreduce after the mismatch errors works, and so do the failed groups' names."""
    if ctx.size < 2:
        raise Skip("a mismatch needs 2 or more ranks")
    got = _mismatch_outcomes(ctx)
    for key, what in (("__healthy__", "an allreduce after the mismatch errors"),
                      ("__reuse__", "a failed group's names used again")):
        if isinstance(got[key], BaseException):
            raise AssertionError(f"{what} failed: {type(got[key]).__name__}: {got[key]}")
    for out in [got["__healthy__"]] + [m for members in got["__reuse__"] for m in members]:
        assert_same(out, np.full(2, float(ctx.size), np.float32))


# -- after shutdown --------------------------------------------------------------------------

@CASES.case("after_shutdown/every_op_raises_not_initialized", phase=POST_SHUTDOWN)
def _(ctx):
    _every_op_not_initialized()


@CASES.case("after_shutdown/init_again_works", phase=POST_SHUTDOWN)
def _(ctx):
    hvd.init()
    try:
        assert hvd.size() == ctx.size and hvd.rank() == ctx.rank
        h = hvd.allreduce_async(np.ones(3), op=hvd.Sum, name="reinit.sum")
        assert_same(wait_for(h, 10, "allreduce after a second init()", ctx),
                    np.full(3, float(ctx.size)))
    finally:
        hvd.shutdown()
