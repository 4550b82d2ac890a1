"""Rank functions: every collective on torch tensors, every dtype, any number of ranks.

Each rank r of n builds its input from r and checks the result against a closed
form in r and n, so the same function holds at 1, 2 and 3 ranks.
"""

import math

import torch

import spark_hvd.torch as hvd
from spark_hvd.exceptions import InvalidArgumentError, TensorMismatchError

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.bool]
NUMERIC = [d for d in DTYPES if d != torch.bool]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SHAPES = [(), (0,), (7,), (3, 5), (2, 3, 4)]


class Skip(Exception):
    pass


def rn():
    return hvd.rank(), hvd.size()


def same(actual, expected, what=""):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), \
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if expected.dtype.is_floating_point:
        a, e = actual.double(), expected.double()
        assert torch.allclose(a, e, rtol=1e-6, atol=1e-6), f"{what}: {actual} != {expected}"
    else:
        assert torch.equal(actual, expected), f"{what}: {actual} != {expected}"


def base(shape, dtype):
    """1s and 2s (small enough for a product over 3 ranks in int8)."""
    n = math.prod(shape)
    return (torch.arange(n) % 2 + 1).reshape(shape).to(dtype)


def bool_pattern(shape, r):
    n = math.prod(shape)
    return ((torch.arange(n) + r) % 3 == 0).reshape(shape)


# -- allreduce ---------------------------------------------------------------

def expected_allreduce(b, op, n, dtype):
    wide = b.to(torch.int64)
    if op == hvd.Sum:
        v = wide * (n * (n + 1) // 2)
    elif op == hvd.Average:
        if dtype.is_floating_point:
            return (b.to(torch.float64) * (n + 1) / 2).to(dtype)
        v = wide * (n * (n + 1) // 2) // n
    elif op == hvd.Min:
        v = wide
    elif op == hvd.Max:
        v = wide * n
    else:
        v = wide ** n * math.factorial(n)
    return v.to(dtype)


def check_allreduce_every_dtype_op_shape():
    r, n = rn()
    for dtype in NUMERIC:  # all ops and shapes of a dtype in flight at once
        pending = []
        for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product):
            for shape in SHAPES:
                b = base(shape, dtype)
                x = (b.to(torch.int64) * (r + 1)).to(dtype)
                pending.append((hvd.allreduce_async(x, op=op), x, b, op, shape))
        for h, x, b, op, shape in pending:
            same(hvd.synchronize(h), expected_allreduce(b, op, n, dtype),
                 f"{dtype} {op.name} {shape}")
            same(x, (b.to(torch.int64) * (r + 1)).to(dtype), "input untouched")
    x = torch.full((2, 2), float(r + 1))
    same(hvd.allreduce(x, op=hvd.Sum), torch.full((2, 2), n * (n + 1) / 2), "allreduce")


def check_allreduce_bool():
    r, n = rn()
    for shape in SHAPES:
        x = bool_pattern(shape, r)
        stack = torch.stack([bool_pattern(shape, j) for j in range(n)])
        same(hvd.allreduce(x, op=hvd.Sum), stack.any(0), f"bool or {shape}")
        same(hvd.allreduce(x, op=hvd.Max), stack.any(0), f"bool max {shape}")
        same(hvd.allreduce(x, op=hvd.Min), stack.all(0), f"bool min {shape}")
        same(hvd.allreduce(x, op=hvd.Product), stack.all(0), f"bool prod {shape}")
    try:
        hvd.allreduce(bool_pattern((3,), r))  # default Average
    except InvalidArgumentError as exc:
        assert "bool" in str(exc)
    else:
        raise AssertionError("Average of a bool tensor did not raise")


def check_allreduce_scale_factors_and_average_kwarg():
    r, n = rn()
    for dtype in FLOATS:
        x = torch.full((4,), float(r + 1), dtype=dtype)
        out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
        same(out, torch.full((4,), n * (n + 1) / 2 * 0.5, dtype=dtype), f"scaled {dtype}")
    x = torch.full((3,), float(r + 1))
    same(hvd.allreduce(x, average=False), torch.full((3,), n * (n + 1) / 2), "average=False")
    same(hvd.allreduce(x, average=True), torch.full((3,), (n + 1) / 2), "average=True")


def check_allreduce_noncontiguous_and_named():
    r, n = rn()
    big = torch.arange(24, dtype=torch.float32).reshape(4, 6) * (r + 1)
    view = big[:, ::2]
    assert not view.is_contiguous()
    out = hvd.allreduce(view, op=hvd.Sum, name="nc.allreduce")
    same(out, torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2] * (n * (n + 1) / 2),
         "non-contiguous")
    for step in range(3):  # the same name every step (response cache)
        out = hvd.allreduce(torch.full((5,), float(r + step)), name="repeat", op=hvd.Sum)
        same(out, torch.full((5,), float(n * (n - 1) / 2 + n * step)), f"step {step}")


def check_allreduce_inplace_variants():
    r, n = rn()
    x = torch.full((2, 3), float(r + 1))
    y = hvd.allreduce_(x, op=hvd.Sum)
    assert y is x
    same(x, torch.full((2, 3), n * (n + 1) / 2), "allreduce_")
    x = torch.full((5,), float(r + 1), dtype=torch.float64)
    h = hvd.allreduce_async_(x)
    out = hvd.synchronize(h)
    assert out is x and hvd.poll(h)
    same(x, torch.full((5,), (n + 1) / 2, dtype=torch.float64), "allreduce_async_")
    big = torch.ones(4, 6) * (r + 1)
    hvd.allreduce_(big[:, 1::2], op=hvd.Sum)  # non-contiguous view written back
    expected = torch.ones(4, 6) * (r + 1)
    expected[:, 1::2] = n * (n + 1) / 2
    same(big, expected, "allreduce_ on a view")
    h = hvd.allreduce_async(torch.full((3,), float(r)), op=hvd.Max)
    while not hvd.poll(h):
        pass
    same(hvd.synchronize(h), torch.full((3,), float(n - 1)), "allreduce_async + poll")


def check_grouped_allreduce_inplace_overlapping_views():
    """In-place views sharing memory in one group: every element ends as the sum of
    the originals (the core must not reduce the shared part twice)."""
    r, n = rn()
    size = 40000  # large enough for the ring (small groups are packed anyway)
    t = torch.arange(size, dtype=torch.float64) + r
    hvd.grouped_allreduce_([t[0:24000], t[16000:]], op=hvd.Sum, name="overlap")
    same(t, torch.arange(size, dtype=torch.float64) * n + n * (n - 1) / 2, "overlapping views")


def check_grouped_allreduce():
    r, n = rn()
    xs = [torch.full((3,), float(r + 1)), torch.full((2, 2), r + 1, dtype=torch.int32),
          torch.full((0,), 1.0, dtype=torch.float64),
          torch.full((4,), float(r), dtype=torch.bfloat16)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum)
    tri = n * (n + 1) // 2
    same(outs[0], torch.full((3,), float(tri)), "g0")
    same(outs[1], torch.full((2, 2), tri, dtype=torch.int32), "g1")
    same(outs[2], torch.zeros(0, dtype=torch.float64), "g2")
    same(outs[3], torch.full((4,), float(tri - n), dtype=torch.bfloat16), "g3")
    ys = [x.clone() for x in xs]
    res = hvd.grouped_allreduce_(ys, op=hvd.Sum)
    assert all(a is b for a, b in zip(res, ys))
    for a, b in zip(ys, outs):
        same(a, b, "grouped_allreduce_")
    h = hvd.grouped_allreduce_async([torch.full((2,), float(r + 1))])
    same(hvd.synchronize(h)[0], torch.full((2,), (n + 1) / 2), "grouped async")
    zs = [torch.full((2,), float(r + 1)), torch.full((3,), float(r + 1))]
    h = hvd.grouped_allreduce_async_(zs, op=hvd.Max)
    hvd.synchronize(h)
    same(zs[1], torch.full((3,), float(n)), "grouped async_")


def check_grouped_mismatch_fails_every_member_and_frees_the_names():
    """A member that differs on the last rank (grouped allreduce, allgather,
    reducescatter) fails every member of its group on every rank, not a hang, and the
    group's names are free again at once."""
    import time

    r, n = rn()
    if n == 1:
        raise Skip("a mismatch needs 2 or more ranks")
    odd = r == n - 1
    groups = {
        "allreduce": hvd.grouped_allreduce_async(
            [torch.ones(3), torch.ones(2, dtype=torch.float64 if odd else torch.float32)],
            name="mm.allreduce"),
        "allgather": hvd.grouped_allgather_async(
            [torch.ones(2, 3), torch.ones(1, 4 if odd else 3)], name="mm.allgather"),
        "reducescatter": hvd.grouped_reducescatter_async(
            [torch.ones(6, 2), torch.ones(7 if odd else 6, 2)], name="mm.reducescatter"),
    }
    deadline = time.monotonic() + 30
    for kind, h in groups.items():
        while not hvd.poll(h):
            assert time.monotonic() < deadline, f"grouped {kind} with a mismatch hung"
            time.sleep(0.005)
        for m in h.members:
            try:
                hvd.synchronize(m)
            except TensorMismatchError as e:
                assert f"grouped op 'mm.{kind}'" in str(e) and e.ranks == [0, n - 1], str(e)
            else:
                raise AssertionError(f"a member of grouped {kind} did not fail")
    again = hvd.grouped_allreduce([torch.ones(3), torch.ones(2)], op=hvd.Sum, name="mm.allreduce")
    same(again[1], torch.full((2,), float(n)), "a failed group's names used again")


# -- allgather -----------------------------------------------------------------

def gather_piece(j, dtype, width=3):
    rows = j % 3  # 0, 1, 2 rows: includes a rank with none
    if dtype == torch.bool:
        return bool_pattern((rows, width), j)
    return (torch.arange(rows * width).reshape(rows, width) + 10 * j).to(dtype)


def check_allgather_every_dtype():
    r, n = rn()
    for dtype in DTYPES:
        out = hvd.allgather(gather_piece(r, dtype))
        same(out, torch.cat([gather_piece(j, dtype) for j in range(n)]), f"allgather {dtype}")
        h = hvd.allgather_async(gather_piece(r, dtype, 1).reshape(-1))
        same(hvd.synchronize(h), torch.cat([gather_piece(j, dtype, 1).reshape(-1)
                                            for j in range(n)]), f"allgather 1-D {dtype}")
    same(hvd.allgather(torch.tensor(float(r))), torch.arange(n, dtype=torch.float32), "scalar")
    x = torch.arange(12.0).reshape(3, 4)[:, ::2] + r  # non-contiguous
    same(hvd.allgather(x), torch.cat([torch.arange(12.0).reshape(3, 4)[:, ::2] + j
                                      for j in range(n)]), "non-contiguous")


def check_grouped_allgather():
    r, n = rn()
    outs = hvd.grouped_allgather([gather_piece(r, torch.float32), gather_piece(r, torch.int64)])
    same(outs[0], torch.cat([gather_piece(j, torch.float32) for j in range(n)]), "g0")
    same(outs[1], torch.cat([gather_piece(j, torch.int64) for j in range(n)]), "g1")


# -- broadcast -------------------------------------------------------------------

def bval(j, dtype, shape=(2, 3)):
    if dtype == torch.bool:
        return bool_pattern(shape, j)
    return (torch.arange(math.prod(shape)).reshape(shape) + 7 * j).to(dtype)


def check_broadcast_every_dtype_and_root():
    r, n = rn()
    for root in sorted({0, n - 1}):
        pending = []
        for dtype in DTYPES:
            for shape in [(2, 3), (), (0, 4)]:
                x = bval(r, dtype, shape)
                pending.append((hvd.broadcast_async(x, root), x, dtype, shape))
        for h, x, dtype, shape in pending:
            same(hvd.synchronize(h), bval(root, dtype, shape),
                 f"broadcast {dtype} root {root} {shape}")
            same(x, bval(r, dtype, shape), "input untouched")
    same(hvd.broadcast(bval(r, torch.float32), n - 1), bval(n - 1, torch.float32), "broadcast")


def check_broadcast_inplace_variants():
    r, n = rn()
    root = n - 1
    x = bval(r, torch.float32)
    assert hvd.broadcast_(x, root) is x
    same(x, bval(root, torch.float32), "broadcast_")
    x = bval(r, torch.int64)
    h = hvd.broadcast_async_(x, root, name="bcast.async_")
    assert hvd.synchronize(h) is x
    same(x, bval(root, torch.int64), "broadcast_async_")
    same(hvd.synchronize(hvd.broadcast_async(bval(r, torch.float64), 0)),
         bval(0, torch.float64), "broadcast_async")
    big = torch.zeros(3, 4) + r
    hvd.broadcast_(big[:, 1], root)  # non-contiguous column
    expected = torch.zeros(3, 4) + r
    expected[:, 1] = root
    same(big, expected, "broadcast_ on a view")


# -- alltoall ---------------------------------------------------------------------

def a2a_block(src, dst, dtype, width=2):
    rows = dst + 1
    if dtype == torch.bool:
        return torch.full((rows, width), (src + dst) % 2 == 0)
    return torch.full((rows, width), 10 * src + dst).to(dtype)


def check_alltoall_every_dtype():
    r, n = rn()
    for dtype in DTYPES:
        x = torch.cat([a2a_block(r, j, dtype) for j in range(n)])
        out, received = hvd.alltoall(x, splits=[j + 1 for j in range(n)])
        same(out, torch.cat([a2a_block(j, r, dtype) for j in range(n)]), f"alltoall {dtype}")
        same(received, torch.full((n,), r + 1, dtype=torch.int32), "received splits")
    x = torch.arange(2 * n, dtype=torch.float32) + 100 * r  # even split, no splits=
    out = hvd.alltoall(x)
    same(out, torch.cat([torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) + 100 * j
                         for j in range(n)]), "even alltoall")
    splits = torch.tensor([0] * n, dtype=torch.int32)  # sends nothing: zero-row output
    h = hvd.alltoall_async(torch.zeros(0, 3), splits=splits)
    out, received = hvd.synchronize(h)
    same(out, torch.zeros(0, 3), "empty alltoall")
    same(received, torch.zeros(n, dtype=torch.int32), "empty splits")


# -- reducescatter -------------------------------------------------------------------

def check_reducescatter_every_dtype():
    r, n = rn()
    rows = 2 * n + 1  # a remainder: the first rank gets one more row
    sizes = [rows // n + (1 if j < rows % n else 0) for j in range(n)]
    start = sum(sizes[:r])
    for dtype in NUMERIC:
        b = base((rows, 3), dtype)
        x = (b.to(torch.int64) * (r + 1)).to(dtype)
        for op in (hvd.Sum, hvd.Average, hvd.Max):
            out = hvd.reducescatter(x, op=op)
            full = expected_allreduce(b, op, n, dtype)
            same(out, full[start:start + sizes[r]], f"reducescatter {dtype} {op.name}")
    x = torch.full((rows, 2), float(r + 1))
    same(hvd.synchronize(hvd.reducescatter_async(x, op=hvd.Sum, prescale_factor=2.0)),
         torch.full((sizes[r], 2), float(n * (n + 1))), "reducescatter_async scaled")
    outs = hvd.grouped_reducescatter([x, x.double()], op=hvd.Sum)
    same(outs[1], torch.full((sizes[r], 2), n * (n + 1) / 2, dtype=torch.float64), "grouped")


# -- join, barrier, process sets, objects ---------------------------------------------------

def check_join_with_uneven_steps():
    r, n = rn()
    for i in range(r + 1):  # rank r runs r+1 steps; steps after a rank joined see it as 0
        out = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="join.step")
        same(out, torch.full((3,), float(n - i)), f"step {i}")
    assert hvd.join() == n - 1
    hvd.barrier()


def check_process_set():
    r, n = rn()
    if n < 2:
        raise Skip("needs 2 ranks")
    ps = hvd.add_process_set([0, 1])
    try:
        if ps.included():  # named: generated names would differ from the other ranks' after
            out = hvd.allreduce(torch.full((2,), float(r + 1)), op=hvd.Sum, process_set=ps,
                                name="ps.allreduce")
            same(out, torch.full((2,), 3.0), "process set allreduce")
            same(hvd.allgather(torch.tensor([r]), process_set=ps, name="ps.allgather"),
                 torch.tensor([0, 1]), "process set allgather")
    finally:
        hvd.remove_process_set(ps)


def check_objects():
    r, n = rn()
    got = hvd.broadcast_object({"w": torch.arange(3) if r == 0 else None, "r": r}, 0)
    assert got["r"] == 0 and torch.equal(got["w"], torch.arange(3))
    assert hvd.allgather_object((r, "x" * r)) == [(j, "x" * j) for j in range(n)]


# -- Adasum --------------------------------------------------------------------------

def adasum_reference(vectors):
    def pair(a, b):
        dot = float(a @ b)
        return (1 - dot / (2 * float(a @ a))) * a + (1 - dot / (2 * float(b @ b))) * b

    level = list(vectors)
    while len(level) > 1:
        nxt = [pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def check_adasum():
    r, n = rn()
    if n & (n - 1):  # Horovod's rule: a power-of-two number of ranks
        try:
            hvd.allreduce(torch.ones(3), op=hvd.Adasum)
        except InvalidArgumentError as exc:
            assert "power-of-two" in str(exc), str(exc)
            return
        raise AssertionError(f"Adasum on {n} ranks did not raise")
    g = torch.Generator().manual_seed(7)
    vecs = [torch.randn(2, 5, generator=g, dtype=torch.float64) for _ in range(n)]
    out = hvd.allreduce(vecs[r], op=hvd.Adasum)
    same(out, adasum_reference([v.reshape(-1) for v in vecs]).reshape(2, 5), "adasum")
    # identical vectors: adasum is the vector itself; orthogonal: their sum
    same(hvd.allreduce(torch.ones(4), op=hvd.Adasum), torch.ones(4), "identical")
    e = torch.zeros(n, dtype=torch.float32)
    e[r] = 1.0
    same(hvd.allreduce(e, op=hvd.Adasum), torch.ones(n), "orthogonal")
    x = torch.full((3,), float(r + 1), dtype=torch.float32)
    hvd.allreduce_(x, op=hvd.Adasum)
    assert x.dtype == torch.float32
    # in place on views of one buffer, fused: each tensor gets its own coefficients
    bufs = [torch.randn(11, generator=g, dtype=torch.float64) for _ in range(n)]
    mine = bufs[r].clone()
    hvd.grouped_allreduce_([mine[:4], mine[4:]], op=hvd.Adasum, name="adasum.views")
    same(mine[:4], adasum_reference([b[:4] for b in bufs]), "fused views, first")
    same(mine[4:], adasum_reference([b[4:] for b in bufs]), "fused views, second")
    try:
        hvd.allreduce(torch.ones(3, dtype=torch.int32), op=hvd.Adasum)
    except InvalidArgumentError as exc:
        assert "floating-point" in str(exc)
    else:
        raise AssertionError("Adasum on int32 did not raise")


# -- autograd ----------------------------------------------------------------------

def check_grad_allreduce():
    r, n = rn()
    for op, factor in ((hvd.Sum, 1.0), (hvd.Average, 1.0 / n)):
        x = torch.arange(6, dtype=torch.float64).reshape(2, 3).requires_grad_()
        y = hvd.allreduce(x, op=op, name=f"grad.ar.{op.name}")
        (y * (r + 1)).sum().backward()  # global loss sum_r (r+1) * sum(y)
        same(x.grad, torch.full((2, 3), n * (n + 1) / 2 * factor, dtype=torch.float64),
             f"allreduce grad {op.name}")
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)
    ys = hvd.grouped_allreduce([x, x * 2], op=hvd.Sum)
    (ys[0] * (r + 1) + ys[1]).sum().backward()
    same(x.grad, torch.full((3,), n * (n + 1) / 2 + 2 * n, dtype=torch.float64), "grouped grad")


def check_grad_allgather():
    r, n = rn()
    rows = [j % 3 + 1 for j in range(n)]
    total = sum(rows)
    x = torch.randn(rows[r], 2, dtype=torch.float64, requires_grad=True)
    y = hvd.allgather(x)
    w = torch.arange(total * 2, dtype=torch.float64).reshape(total, 2)
    (y * w * (r + 1)).sum().backward()
    start = sum(rows[:r])  # Horovod: the Average allreduce of the gradients, then own rows
    same(x.grad, w[start:start + rows[r]] * ((n + 1) / 2), "allgather grad")


def check_grad_broadcast():
    r, n = rn()
    root = n - 1
    x = torch.ones(2, 2, dtype=torch.float64, requires_grad=True)
    y = hvd.broadcast(x, root)
    (y * (r + 1)).sum().backward()
    expected = (n + 1) / 2 if r == root else 0.0  # Horovod: the average on the root
    same(x.grad, torch.full((2, 2), expected, dtype=torch.float64), "broadcast grad")


def check_forms_without_a_gradient_skip_autograd():
    """allreduce, broadcast and allgather of a tensor that records no gradient (or under
    no_grad) give the same result, with no history, without torch's Function.apply
    (~10 us a call); a tensor that records one still goes through it."""
    from spark_hvd.torch import _autograd

    r, n = rn()
    x = torch.full((3,), float(r + 1))
    fns = (_autograd.AllreduceFn, _autograd.BroadcastFn, _autograd.AllgatherFn)

    def refused(*args):
        raise AssertionError("went through autograd")

    try:
        for fn in fns:
            fn.apply = refused
        same(hvd.allreduce(x, op=hvd.Sum, name="nograd.ar"), torch.full((3,), n * (n + 1) / 2))
        same(hvd.broadcast(x, n - 1, name="nograd.bc"), torch.full((3,), float(n)))
        same(hvd.allgather(x, name="nograd.ag"),
             torch.cat([torch.full((3,), float(j + 1)) for j in range(n)]))
        with torch.no_grad():
            y = hvd.allreduce(x.clone().requires_grad_(), op=hvd.Sum, name="nograd.mode")
        assert y.grad_fn is None and not y.requires_grad
    finally:
        for fn in fns:
            del fn.apply  # torch.autograd.Function's again
    y = hvd.allreduce(x.clone().requires_grad_(), op=hvd.Sum, name="nograd.recorded")
    assert y.grad_fn is not None


def check_grad_alltoall():
    """Two rows more than the splits cover: as Horovod's, they are not sent, and their
    gradient is zero."""
    r, n = rn()
    splits = [j + 1 for j in range(n)]
    x = torch.randn(sum(splits) + 2, 3, dtype=torch.float64, requires_grad=True)
    y, received = hvd.alltoall(x, splits=splits)
    assert y.shape == (n * (r + 1), 3) and received.tolist() == [r + 1] * n, (y.shape, received)
    (y * (r + 1)).sum().backward()
    expected = torch.cat([torch.full((j + 1, 3), float(j + 1), dtype=torch.float64)
                          for j in range(n)] + [torch.zeros(2, 3, dtype=torch.float64)])
    same(x.grad, expected, "alltoall grad")


def check_grad_reducescatter():
    r, n = rn()
    rows = 2 * n + 1
    sizes = [rows // n + (1 if j < rows % n else 0) for j in range(n)]
    # Horovod: the allgathered gradient, times the size for Sum
    for op, factor in ((hvd.Sum, float(n)), (hvd.Average, 1.0)):
        x = torch.randn(rows, 2, dtype=torch.float64, requires_grad=True)
        y = hvd.reducescatter(x, op=op)
        (y * (r + 1)).sum().backward()
        expected = torch.cat([torch.full((sizes[j], 2), (j + 1) * factor, dtype=torch.float64)
                              for j in range(n)])
        same(x.grad, expected, f"reducescatter grad {op.name}")


def check_grad_through_compression():
    r, n = rn()
    x = torch.full((4,), float(r + 1), requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert y.dtype == torch.float32
    y.sum().backward()
    same(x.grad, torch.full((4,), float(n)), "grad through fp16 compression")


# -- errors --------------------------------------------------------------------------

class FakeCuda(torch.Tensor):
    """A CPU tensor that reports a CUDA device (this torch build has no CUDA), by each
    of torch's ways of asking."""

    @property
    def device(self):
        return torch.device("cuda", 0)

    @property
    def is_cuda(self):
        return True

    @property
    def is_cpu(self):
        return False

    @property
    def is_cuda(self):
        return True


def check_cuda_tensor_is_refused_clearly():
    """Where the CUDA runtime does not load (this CPU machine), every op refuses a CUDA
    tensor up front, naming the fix. Where it loads, CUDA tensors are taken (NCCL or
    staged: tests/gpu/gpu_checks.py), so there is nothing to refuse."""
    if hvd.cuda_built():
        return
    tensors = []
    if torch.cuda.is_available():
        tensors.append(torch.ones(3, device="cuda"))
    tensors.append(torch.Tensor._make_subclass(FakeCuda, torch.ones(3)))
    for t in tensors:
        for call in (lambda: hvd.allreduce(t), lambda: hvd.allgather_async(t),
                     lambda: hvd.broadcast_(t, 0), lambda: hvd.allreduce_async_(t)):
            try:
                call()
            except InvalidArgumentError as exc:
                msg = str(exc)
                assert "GPU" in msg and "NCCL" in msg and "cuda" in msg, msg
            else:
                raise AssertionError("a CUDA tensor was accepted")


def check_invalid_arguments():
    r, n = rn()
    for bad, words in ((lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64)), "complex"),
                       (lambda: hvd.allreduce([1, 2]), "torch.Tensor"),
                       (lambda: hvd.alltoall(torch.ones(n + 1)) if n > 1
                        else hvd.alltoall(torch.ones(2), splits=[3]), "split"),
                       (lambda: hvd.reducescatter(torch.tensor(1.0)), "dimension")):
        try:
            bad()
        except InvalidArgumentError as exc:
            assert words in str(exc), str(exc)
        else:
            raise AssertionError(f"no error ({words})")
    if n > 1:
        try:
            hvd.allreduce(torch.ones(r + 1), name="mismatch")
        except TensorMismatchError as exc:
            assert "mismatch" in str(exc) and "shape" in str(exc), str(exc)
        else:
            raise AssertionError("mismatched shapes did not raise")
