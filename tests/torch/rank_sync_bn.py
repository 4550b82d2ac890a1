"""Rank functions: SyncBatchNorm against BatchNorm on the concatenated batch.

Rank r holds r+2 samples (uneven on purpose). Every rank also runs plain
BatchNorm on the whole batch and compares its own slice: output, input gradient,
running statistics; the weight/bias gradients summed over ranks equal BatchNorm's.
"""

import torch
import torch.nn.functional as F
from torch import nn

import spark_hvd.torch as hvd

TOL = 1e-5


def rn():
    return hvd.rank(), hvd.size()


def sizes():
    _, n = rn()
    return [j + 2 for j in range(n)]


def my_slice(t):
    r, _ = rn()
    s = sizes()
    start = sum(s[:r])
    return t[start:start + s[r]]


def close(a, b, what, tol=TOL):
    d = float((a - b).detach().abs().max()) if a.numel() else 0.0
    assert d <= tol, f"{what}: differs by {d:.3g}"


def compare(ref_bn, sync_bn, shape_tail, steps=2, what=""):
    total = sum(sizes())
    g = torch.Generator().manual_seed(11)
    for step in range(steps):
        x = torch.randn(total, *shape_tail, generator=g, dtype=torch.float64) * 3 + 1
        w = torch.randn(total, *shape_tail, generator=g, dtype=torch.float64)
        xf = x.clone().requires_grad_()
        yf = ref_bn(xf)
        (yf * w).sum().backward()
        xr = my_slice(x).clone().requires_grad_()
        yr = sync_bn(xr)
        (yr * my_slice(w)).sum().backward()
        close(yr, my_slice(yf), f"{what} output step {step}")
        close(xr.grad, my_slice(xf.grad), f"{what} input grad step {step}")
        if ref_bn.affine:
            for name in ("weight", "bias"):
                mine = getattr(sync_bn, name).grad
                summed = hvd.allreduce(mine, op=hvd.Sum, name=f"sbn.test.{name}")
                close(summed, getattr(ref_bn, name).grad, f"{what} {name} grad step {step}")
        if ref_bn.track_running_stats:
            close(sync_bn.running_mean, ref_bn.running_mean, f"{what} running_mean")
            close(sync_bn.running_var, ref_bn.running_var, f"{what} running_var")
            assert int(sync_bn.num_batches_tracked) == int(ref_bn.num_batches_tracked)
        for m in (ref_bn, sync_bn):
            m.zero_grad()
    ref_bn.eval()
    sync_bn.eval()
    x = torch.randn(total, *shape_tail, generator=g, dtype=torch.float64)
    close(sync_bn(my_slice(x)), my_slice(ref_bn(x)), f"{what} eval")


def pair(ref_cls, c, **kwargs):
    torch.manual_seed(4)
    ref = ref_cls(c, **kwargs).double()
    sbn = hvd.SyncBatchNorm(c, **kwargs).double()
    if ref.affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-0.5, 0.5)
            sbn.weight.copy_(ref.weight)
            sbn.bias.copy_(ref.bias)
    assert isinstance(sbn, torch.nn.modules.batchnorm._BatchNorm)
    return ref, sbn


def check_sync_bn_2d():
    ref, sbn = pair(nn.BatchNorm2d, 3)
    compare(ref, sbn, (3, 4, 5), what="2d")


def check_sync_bn_1d_and_3d_inputs():
    ref, sbn = pair(nn.BatchNorm1d, 4)
    compare(ref, sbn, (4,), what="1d (N, C)")
    ref, sbn = pair(nn.BatchNorm1d, 4)
    compare(ref, sbn, (4, 6), what="1d (N, C, L)")
    ref, sbn = pair(nn.BatchNorm3d, 2)
    compare(ref, sbn, (2, 2, 3, 2), what="3d")


def check_sync_bn_options():
    ref, sbn = pair(nn.BatchNorm2d, 3, affine=False)
    compare(ref, sbn, (3, 2, 2), what="affine=False")
    ref, sbn = pair(nn.BatchNorm2d, 3, momentum=None)
    compare(ref, sbn, (3, 2, 2), steps=3, what="momentum=None")
    ref, sbn = pair(nn.BatchNorm2d, 3, track_running_stats=False)
    compare(ref, sbn, (3, 2, 2), what="track_running_stats=False")


def check_sync_bn_float32():
    torch.manual_seed(4)
    ref = nn.BatchNorm2d(3)
    sbn = hvd.SyncBatchNorm(3)
    total = sum(sizes())
    x = torch.randn(total, 3, 4, 4) * 2 + 5
    xf = x.clone().requires_grad_()
    yf = ref(xf)
    yf.square().sum().backward()
    xr = my_slice(x).clone().requires_grad_()
    yr = sbn(xr)
    yr.square().sum().backward()
    close(yr, my_slice(yf), "float32 output", tol=1e-4)
    close(xr.grad, my_slice(xf.grad), "float32 input grad", tol=1e-4)


def check_convert_and_train_with_distributed_optimizer():
    """A model with SyncBatchNorm trained by DistributedOptimizer equals the same
    model with BatchNorm trained on the whole batch."""
    r, n = rn()
    total = sum(sizes())

    def model():
        torch.manual_seed(9)
        return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(),
                             nn.Linear(6, 1)).double()

    ref = model()
    dist = hvd.SyncBatchNorm.convert_sync_batchnorm(model())
    assert isinstance(dist[1], hvd.SyncBatchNorm)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(dist.parameters(), lr=0.1),
                                   named_parameters=dist.named_parameters(), op=hvd.Sum)
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        x = torch.randn(total, 5, generator=g, dtype=torch.float64)
        y = torch.randn(total, 1, generator=g, dtype=torch.float64)
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y, reduction="sum").backward()
        ref_opt.step()
        opt.zero_grad()
        # sum losses: the global loss is the sum of the ranks' losses, and op=Sum
        F.mse_loss(dist(my_slice(x)), my_slice(y), reduction="sum").backward()
        opt.step()
    for (name, a), b in zip(dist.named_parameters(), ref.parameters()):
        close(a, b, f"trained {name}", tol=1e-5)
    close(dist[1].running_mean, ref[1].running_mean, "trained running_mean")
