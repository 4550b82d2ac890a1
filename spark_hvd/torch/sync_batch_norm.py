"""SyncBatchNorm: batch normalization with statistics over every rank's batch.

Forward (training): each rank computes, per channel, its element count n_r, mean
m_r and sum of squared deviations M2_r; one allgather of the (2C+1)-vectors
(float64) lets every rank combine them exactly and stably (Chan et al.):

    N = sum n_r,  mean = sum n_r m_r / N,  M2 = sum (M2_r + n_r (m_r - mean)^2)

and normalize with var = M2 / N. Running statistics get the unbiased M2 / (N-1),
as BatchNorm on the concatenated batch would.

Backward: with xmu = x - mean and invstd = 1/sqrt(var + eps), the input gradient
needs sum(dy) and sum(dy * xmu) over *all* ranks' elements (one allreduce):

    dx = weight * invstd * (dy - sum_dy / N - xmu * invstd^2 * sum_dy_xmu / N)

while weight and bias get this rank's own contribution (sum(dy * xmu) * invstd
and sum(dy)), which DistributedOptimizer then averages like any gradient; their
sum over ranks is BatchNorm's full-batch gradient.

In eval mode (with running statistics) or on a single rank it is plain
``F.batch_norm``. Each module names its two collectives once (on its first
synchronized forward), so every later step hits the core's response cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from spark_hvd._runtime import RUNTIME, ProcessSet, global_process_set
from spark_hvd._types import ReduceOp
from spark_hvd.torch import mpi_ops


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set,
                name):
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        bshape = [1, c] + [1] * (x.dim() - 2)
        xf = x.to(_compute_dtype(x.dtype))
        n_local = x.numel() // c if c else 0
        if n_local > 0:
            local_mean = xf.mean(dims)
            local_m2 = (xf - local_mean.view(bshape)).square().sum(dims)
        else:
            local_mean = xf.new_zeros(c)
            local_m2 = xf.new_zeros(c)
        row = torch.cat([torch.tensor([float(n_local)], dtype=torch.float64),
                         local_mean.double(), local_m2.double()]).unsqueeze(0)
        gathered = mpi_ops.synchronize(mpi_ops.allgather_async(row, f"{name}.stats",
                                                               process_set))
        counts, means, m2s = gathered[:, :1], gathered[:, 1:c + 1], gathered[:, c + 1:]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError("SyncBatchNorm: expected more than 1 value per channel when "
                             f"training across all ranks, got input size {list(x.shape)} and "
                             f"{int(total)} value(s) in all")
        mean = (counts * means).sum(0) / total
        m2 = m2s.sum(0) + (counts * (means - mean).square()).sum(0)
        var = m2 / total
        invstd = (var + eps).rsqrt()
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            running_var.mul_(1 - momentum).add_((m2 / (total - 1)).to(running_var.dtype),
                                                alpha=momentum)
        mean_c = mean.to(xf.dtype)
        invstd_c = invstd.to(xf.dtype)
        y = (xf - mean_c.view(bshape)) * invstd_c.view(bshape)
        if weight is not None:
            y = y * weight.to(xf.dtype).view(bshape)
        if bias is not None:
            y = y + bias.to(xf.dtype).view(bshape)
        ctx.save_for_backward(x, weight, mean_c, invstd_c)
        ctx.total = total
        ctx.args = (process_set, name, bias is not None)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        process_set, name, has_bias = ctx.args
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        bshape = [1, c] + [1] * (x.dim() - 2)
        dyf = dy.to(mean.dtype)
        xmu = x.to(mean.dtype) - mean.view(bshape)
        sum_dy = dyf.sum(dims)
        sum_dy_xmu = (dyf * xmu).sum(dims)
        both = torch.cat([sum_dy, sum_dy_xmu]).double()
        both = mpi_ops.synchronize(mpi_ops.allreduce_async_(both, name=f"{name}.grad",
                                                            op=ReduceOp.SUM,
                                                            process_set=process_set))
        g_sum_dy = both[:c].to(mean.dtype)
        g_sum_dy_xmu = both[c:].to(mean.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            scale = invstd if weight is None else invstd * weight.to(mean.dtype)
            grad_x = (dyf - (g_sum_dy / ctx.total).view(bshape)
                      - xmu * (invstd.square() * g_sum_dy_xmu / ctx.total).view(bshape)) \
                * scale.view(bshape)
            grad_x = grad_x.to(x.dtype)
        grad_w = (sum_dy_xmu * invstd).to(weight.dtype) \
            if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = sum_dy.to(weight.dtype if weight is not None else dy.dtype) \
            if has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization whose training statistics cover the batches of every
    rank of ``process_set``: equal to ``BatchNorm`` on the concatenated batch.

    Takes (N, C, ...) input like BatchNorm1d/2d/3d. Parameters as
    ``torch.nn.BatchNorm2d`` plus ``process_set``.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum=0.1,
                 affine: bool = True, track_running_stats: bool = True, device=None,
                 dtype=None, process_set: ProcessSet = global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_set = process_set
        self._collective_name = None

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None \
                else self.momentum
        use_batch_stats = self.training or (self.running_mean is None and
                                            self.running_var is None)
        track = not self.training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None
        if not use_batch_stats or self.process_set.size() == 1:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                use_batch_stats, factor, self.eps)
        if self._collective_name is None:
            self._collective_name = RUNTIME.auto_name("sync_batch_norm")
        return _SyncBatchNormFn.apply(input, self.weight, self.bias, running_mean, running_var,
                                      self.eps, factor, self.process_set,
                                      self._collective_name)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               process_set: ProcessSet = global_process_set) -> torch.nn.Module:
        """Returns ``module`` with every BatchNorm*d layer replaced by a SyncBatchNorm
        carrying the same parameters and running statistics."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, process_set=process_set)
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.train(module.training)
        for child_name, child in module.named_children():
            out.add_module(child_name, cls.convert_sync_batchnorm(child, process_set))
        return out
