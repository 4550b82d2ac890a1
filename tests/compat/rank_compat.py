"""Rank functions for test_compat_ranks.py: Horovod-style code runs unchanged.

Each holds at any number of ranks (the process-set broadcast needs 3 and skips below).
"""

import numpy as np
import torch

import spark_hvd
import spark_hvd.torch as hvd


class Skip(Exception):
    pass


# -- 1. a failed collective is a RuntimeError, and the job goes on ---------------------

def check_mismatch_is_caught_as_runtime_error_and_ops_continue():
    r, n = hvd.rank(), hvd.size()
    if n < 2:
        raise Skip("a mismatch needs 2 or more ranks")
    last = r == n - 1  # the last rank disagrees
    mismatches = {
        "compat.shape": lambda nm: hvd.allreduce(torch.ones(5 if last else 3), name=nm),
        "compat.dtype": lambda nm: hvd.allreduce(
            torch.ones(3, dtype=torch.float64 if last else torch.float32), name=nm),
        "compat.root": lambda nm: hvd.broadcast(torch.ones(3), 1 if last else 0, name=nm),
    }
    for name, call in mismatches.items():
        try:  # Horovod-style handler
            call(name)
        except RuntimeError as exc:
            assert isinstance(exc, hvd.HorovodInternalError), type(exc)
            assert isinstance(exc, hvd.TensorMismatchError), type(exc)
            assert name in str(exc), str(exc)
        else:
            raise AssertionError(f"{name}: the mismatch did not raise")
    # every rank goes on with collectives
    got = hvd.allreduce(torch.full((4,), float(r + 1)), op=hvd.Sum, name="compat.after")
    assert torch.equal(got, torch.full((4,), float(n * (n + 1) // 2))), got
    got = hvd.broadcast(torch.full((2,), float(r)), n - 1, name="compat.after.bcast")
    assert torch.equal(got, torch.full((2,), float(n - 1))), got


# -- 2. root_rank is a global rank with a process set ---------------------------------

def check_process_set_broadcast_root_is_a_global_rank():
    r, n = hvd.rank(), hvd.size()
    if n < 3:
        raise Skip("a process set that leaves rank 0 out needs 3 ranks")
    members = [1, n - 1]
    root = n - 1  # global rank; its rank within the set is 1
    ps = hvd.add_process_set(members)
    try:
        if r in members:
            _broadcasts_from_global_root(ps, r, root)
            try:
                hvd.broadcast(torch.ones(2), 0, name="compat.ps.outside", process_set=ps)
            except hvd.InvalidArgumentError as exc:
                assert "root_rank 0" in str(exc) and "not a member" in str(exc), str(exc)
            else:
                raise AssertionError("a root outside the process set was accepted")
    finally:
        hvd.remove_process_set(ps)


def _broadcasts_from_global_root(ps, r, root):
    mine = float(r * 10)
    want = torch.full((3,), float(root * 10))
    # numpy API
    got = spark_hvd.broadcast(np.full(3, mine), root, name="compat.ps.np", process_set=ps)
    assert np.array_equal(got, want.numpy()), got
    # torch: out of place, in place, async forms
    assert torch.equal(hvd.broadcast(torch.full((3,), mine), root, "compat.ps.t", ps), want)
    t = torch.full((3,), mine)
    hvd.broadcast_(t, root, "compat.ps.t_", ps)
    assert torch.equal(t, want), t
    got = hvd.synchronize(hvd.broadcast_async(torch.full((3,), mine), root, "compat.ps.ta", ps))
    assert torch.equal(got, want), got
    t = torch.full((3,), mine)
    hvd.synchronize(hvd.broadcast_async_(t, root, "compat.ps.ta_", ps))
    assert torch.equal(t, want), t
    # gradient: the root gets the average over the set, the other member zero
    x = torch.full((3,), mine, requires_grad=True)
    (hvd.broadcast(x, root, "compat.ps.grad", ps) * (r + 1)).sum().backward()
    want = (2.0 + root + 1) / 2 if r == root else 0.0  # members 1 and root: (r + 1) = 2, root + 1
    assert torch.equal(x.grad, torch.full((3,), want)), x.grad
    # objects, parameters, optimizer state
    assert hvd.broadcast_object({"from": r}, root, process_set=ps) == {"from": root}
    torch.manual_seed(r)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    hvd.broadcast_parameters(model.state_dict(), root, process_set=ps)
    hvd.broadcast_optimizer_state(opt, root, process_set=ps)
    weights = hvd.allgather(model.weight.detach().reshape(1, -1), process_set=ps)
    assert torch.equal(weights[0], weights[1]), weights
    lrs = hvd.allgather_object(opt.param_groups[0]["lr"], process_set=ps)
    assert lrs == [0.1 * (root + 1)] * 2, lrs


# -- 3. sparse_allreduce_async returns a callable --------------------------------------

def check_sparse_allreduce_async_returns_a_callable():
    r, n = hvd.rank(), hvd.size()
    dense = torch.zeros(4, 3)
    dense[r % 4, 0] = r + 1.0
    handle = hvd.sparse_allreduce_async(dense.to_sparse(), "compat.sparse", hvd.Sum)
    assert callable(handle)
    out = handle()
    assert out.is_sparse
    want = torch.zeros(4, 3)
    for k in range(n):
        want[k % 4, 0] += k + 1.0
    assert torch.equal(out.to_dense(), want), out.to_dense()
    assert hvd.synchronize(handle) is out  # the spark_hvd form still works
    avg = hvd.sparse_allreduce_async(dense.to_sparse(), "compat.sparse.avg", hvd.Average)
    assert torch.allclose(hvd.synchronize(avg).to_dense(), want / n)


# -- 4. gradients are Horovod's (horovod/torch/mpi_ops.py autograd Functions) ----------
# Each rank weighs its outputs by (r + 1), so an Average over ranks 0..n-1 of the
# output gradients is (n + 1) / 2 times the weights: halves, exact in float64.

F64 = torch.float64


def _weights(rows, cols=2):
    return torch.arange(rows * cols, dtype=F64).reshape(rows, cols) + 1


def check_broadcast_grad_is_the_average_on_the_root():
    r, n = hvd.rank(), hvd.size()
    for root in (0, n - 1):
        x = torch.full((3, 2), float(r), dtype=F64, requires_grad=True)
        y = hvd.broadcast(x, root, name=f"compat.grad.bcast.{root}")
        (y * _weights(3) * (r + 1)).sum().backward()
        want = _weights(3) * ((n + 1) / 2) if r == root else torch.zeros(3, 2, dtype=F64)
        assert torch.equal(x.grad, want), (root, x.grad)


def _own_rows_of_average(rows, r, mean_weight):
    start = sum(rows[:r])
    return _weights(sum(rows))[start:start + rows[r]] * mean_weight


def check_allgather_grad_is_own_rows_of_the_average():
    r, n = hvd.rank(), hvd.size()
    rows = [k % 2 + 1 for k in range(n)]  # uneven first dimensions
    x = torch.zeros(rows[r], 2, dtype=F64, requires_grad=True)
    y = hvd.allgather(x, name="compat.grad.ag")
    (y * _weights(sum(rows)) * (r + 1)).sum().backward()
    assert torch.equal(x.grad, _own_rows_of_average(rows, r, (n + 1) / 2)), x.grad
    # a process set: offsets and the average are the set's (members 1..n-1)
    if n < 2:
        return
    members = list(range(1, n))
    ps = hvd.add_process_set(members)
    try:
        if r in members:
            m = len(members)
            set_rows = [rows[k] for k in members]
            x = torch.zeros(rows[r], 2, dtype=F64, requires_grad=True)
            y = hvd.allgather(x, name="compat.grad.ag.ps", process_set=ps)
            (y * _weights(sum(set_rows)) * (r + 1)).sum().backward()
            mean_weight = sum(k + 1 for k in members) / m
            want = _own_rows_of_average(set_rows, ps.rank(), mean_weight)
            assert torch.equal(x.grad, want), x.grad
    finally:
        hvd.remove_process_set(ps)


def check_grouped_allgather_grad_is_own_rows_of_the_average():
    r, n = hvd.rank(), hvd.size()
    rows_a = [k % 2 + 1 for k in range(n)]
    rows_b = [k + 1 for k in range(n)]
    a = torch.zeros(rows_a[r], 2, dtype=F64, requires_grad=True)
    b = torch.zeros(rows_b[r], 2, dtype=F64, requires_grad=True)
    ya, yb = hvd.grouped_allgather([a, b], name="compat.grad.gag")
    loss = ((ya * _weights(sum(rows_a))).sum() + (yb * _weights(sum(rows_b))).sum() * 2) * (r + 1)
    loss.backward()
    mean = (n + 1) / 2
    assert torch.equal(a.grad, _own_rows_of_average(rows_a, r, mean)), a.grad
    assert torch.equal(b.grad, _own_rows_of_average(rows_b, r, mean * 2)), b.grad


def _reducescatter_cases(n):
    """(op, prescale, postscale, Horovod's factor on the allgathered gradient)."""
    return [(hvd.Sum, 1.0, 1.0, float(n)), (hvd.Average, 1.0, 1.0, 1.0),
            (hvd.Sum, 0.5, 1.5, n * 0.75), (hvd.Average, 0.5, 1.5, 0.75)]


def _gathered_block_grads(rows, n, scale):
    """Rank k weighs its block by (k + 1); the allgather stacks those blocks."""
    sizes = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
    return torch.cat([torch.full((sizes[k], 2), (k + 1) * scale, dtype=F64) for k in range(n)])


def check_reducescatter_grad_is_the_allgather_times_size_for_sum():
    r, n = hvd.rank(), hvd.size()
    rows = 2 * n + 1  # uneven blocks
    for i, (op, pre, post, factor) in enumerate(_reducescatter_cases(n)):
        x = torch.zeros(rows, 2, dtype=F64, requires_grad=True)
        y = hvd.reducescatter(x, name=f"compat.grad.rs.{i}", op=op, prescale_factor=pre,
                              postscale_factor=post)
        (y * (r + 1)).sum().backward()
        assert torch.equal(x.grad, _gathered_block_grads(rows, n, factor)), (op, x.grad)


def check_grouped_reducescatter_grad_is_the_allgather_times_size_for_sum():
    r, n = hvd.rank(), hvd.size()
    for i, (op, pre, post, factor) in enumerate(_reducescatter_cases(n)):
        a = torch.zeros(2 * n + 1, 2, dtype=F64, requires_grad=True)
        b = torch.zeros(n, 2, dtype=F64, requires_grad=True)
        ya, yb = hvd.grouped_reducescatter([a, b], name=f"compat.grad.grs.{i}", op=op,
                                           prescale_factor=pre, postscale_factor=post)
        ((ya.sum() + yb.sum() * 2) * (r + 1)).backward()
        assert torch.equal(a.grad, _gathered_block_grads(2 * n + 1, n, factor)), (op, a.grad)
        assert torch.equal(b.grad, _gathered_block_grads(n, n, factor * 2)), (op, b.grad)


# -- 8. prescale / postscale are Horovod's arithmetic, bit for bit ---------------------------

def _horovod_scaled(x: np.ndarray, n: int, op, pre: float, post: float) -> np.ndarray:
    """Horovod's CPU allreduce of x (the same on all n ranks): each rank multiplies by the
    prescale (float32 by the factor rounded to float32, float16 in float32, integers in
    float64 truncated), the ranks sum, then the sum is multiplied by postscale (divided by
    n first for Average) the same way. Equal inputs make the sum's order irrelevant."""
    def scale(a, f):
        if a.dtype == np.float16:
            return (np.float32(f) * a.astype(np.float32)).astype(np.float16)
        if a.dtype.kind == "f":
            return (a.dtype.type(f) * a).astype(a.dtype)
        return np.trunc(np.float64(f) * a.astype(np.float64)).astype(a.dtype)

    p = scale(x, pre)
    total = p
    for _ in range(n - 1):
        total = (total.astype(np.float32) + p.astype(np.float32)).astype(np.float16) \
            if x.dtype == np.float16 else (total + p).astype(x.dtype)
    return scale(total, post / n if op == hvd.Average else post)


def check_scaled_allreduce_is_bit_exact():
    n = hvd.size()
    rng = np.random.default_rng(7)
    for dtype in (np.float32, np.float64, np.float16, np.int32, np.int64):
        x = (rng.standard_normal(257) * 100).astype(dtype)
        for op in (hvd.Sum, hvd.Average):
            for pre, post in ((0.1, 0.3), (1.0, 1.0 / 3.0), (3.7, 1.0)):
                want = _horovod_scaled(x, n, op, pre, post)
                got = hvd.allreduce(torch.from_numpy(x.copy()), op=op, prescale_factor=pre,
                                    postscale_factor=post,
                                    name=f"compat.scale.{np.dtype(dtype).name}.{op}.{pre}.{post}")
                assert np.array_equal(got.numpy(), want), \
                    (np.dtype(dtype).name, op, pre, post, got.numpy()[:4], want[:4])


# -- 9. join: joined ranks add zeros and count in an Average; allgather/broadcast fail -----

def check_join_average_counts_the_joined_rank():
    r, n = hvd.rank(), hvd.size()
    if n < 2:
        raise Skip("join needs 2 or more ranks")
    for first in (0, 1):
        for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
            torch.manual_seed(1234)
            a = torch.randint(-100, 100, (5, 5)).to(dtype)
            b = torch.randint(-100, 100, (17,)).to(dtype)
            tag = f"compat.join.{first}.{dtype}"
            if r == first:
                assert hvd.join() in range(n)
                continue
            ha = hvd.allreduce_async(a, name=f"{tag}.a", op=hvd.Average)
            hb = hvd.allreduce_async(b, name=f"{tag}.b", op=hvd.Average)
            got_a, got_b = hvd.synchronize(ha), hvd.synchronize(hb)
            for got, t in ((got_a, a), (got_b, b)):
                if dtype.is_floating_point:
                    want = (t * (n - 1) / n).to(dtype)
                    assert torch.allclose(got, want), (dtype, got, want)
                else:  # through double, truncated toward zero
                    want = torch.trunc(t.double() * (n - 1) * (1.0 / n)).to(dtype)
                    assert torch.equal(got, want), (dtype, got, want)
            for call in (lambda: hvd.allgather(a, name=f"{tag}.ag"),
                         lambda: hvd.broadcast(a, 1 - first, name=f"{tag}.bc")):
                try:
                    call()
                except RuntimeError as exc:
                    assert "joined" in str(exc), exc
                else:
                    raise AssertionError("a collective other than allreduce ran while a "
                                         "rank had joined")
            assert hvd.join() in range(n)


# -- alltoall: Horovod's splits and return values -----------------------------------------

def check_alltoall_refuses_splits_that_are_not_int32_on_every_rank():
    """Horovod refuses a splits tensor that is not int32 with a ValueError before anything
    is sent. Splits made with torch.empty hold whatever memory held: taken as counts, one rank
    would raise on its values while another entered the alltoall, and every later collective
    would be out of step. Every rank raises here, and the job goes on in step; lists of ints,
    numpy integer arrays and int32 tensors are taken, and the received splits are int32.
    (A float in a list is refused too, as by Horovod's TensorFlow op; its torch layer would
    truncate it.)"""
    r, n = hvd.rank(), hvd.size()
    x = torch.arange(2 * n * 3, dtype=torch.float32).reshape(2 * n, 3) + 100 * r
    refused = {"torch.empty float32": lambda: torch.empty(n),
               "ones float32": lambda: torch.ones(n),
               "int64 tensor": lambda: torch.full((n,), 2, dtype=torch.int64),
               "2-D int32": lambda: torch.full((1, n), 2, dtype=torch.int32),
               "list of floats": lambda: [2.0] * n,
               "list of bools": lambda: [True] * n}
    for what, splits in refused.items():
        for call in (hvd.alltoall, lambda t, splits: hvd.synchronize(
                hvd.alltoall_async(t, splits=splits))):
            try:
                call(x, splits=splits())
            except ValueError as exc:  # Horovod's class (ours is also its RuntimeError)
                assert "alltoall" in str(exc) and "splits" in str(exc), (what, str(exc))
            else:
                raise AssertionError(f"alltoall took {what} splits")
    got = hvd.allreduce(torch.full((3,), float(r + 1)), op=hvd.Sum, name="compat.a2a.in_step")
    assert torch.equal(got, torch.full((3,), float(n * (n + 1) // 2))), got
    want = torch.cat([x_j[2 * r:2 * r + 2] for x_j in
                      (torch.arange(2 * n * 3, dtype=torch.float32).reshape(2 * n, 3) + 100 * j
                       for j in range(n))])
    for what, splits in {"list": [2] * n, "numpy int64": np.full(n, 2, np.int64),
                         "int32 tensor": torch.full((n,), 2, dtype=torch.int32)}.items():
        out, received = hvd.alltoall(x, splits=splits, name=f"compat.a2a.ok.{what}")
        assert torch.equal(out, want), (what, out)
        assert received.dtype == torch.int32 and received.tolist() == [2] * n, (what, received)


def check_alltoall_without_splits_returns_the_tensor_alone():
    """As Horovod's: hvd.alltoall(t) returns the received rows alone, with splits the pair;
    the async form's synchronize returns the pair either way."""
    r, n = hvd.rank(), hvd.size()
    x = torch.arange(n, dtype=torch.float32) + 10 * r
    out = hvd.alltoall(x, name="compat.a2a.alone")
    assert isinstance(out, torch.Tensor), type(out)
    assert out.tolist() == [float(10 * j + r) for j in range(n)], out
    out, received = hvd.alltoall(x, splits=[1] * n, name="compat.a2a.pair")
    assert out.tolist() == [float(10 * j + r) for j in range(n)] and received.tolist() == [1] * n
    out, received = hvd.synchronize(hvd.alltoall_async(x, name="compat.a2a.async"))
    assert out.tolist() == [float(10 * j + r) for j in range(n)] and received.tolist() == [1] * n
