"""Rank functions for test_compat_ranks.py: Horovod-style code runs unchanged.

Each holds at any number of ranks (the process-set one needs 3 and skips below).
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
    # gradient: the root gets the sum over the set, the other member zero
    x = torch.full((3,), mine, requires_grad=True)
    hvd.broadcast(x, root, "compat.ps.grad", ps).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0 if r == root else 0.0)), x.grad
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
