"""DistributedOptimizer (MXNet Module API) and DistributedTrainer (Gluon), as Horovod's.

Both sum the ranks' gradients with allreduces scaled by ``1 / gradient_predivide_factor``
before the sum, and fold the rest of the average (``gradient_predivide_factor / size``)
into the optimizer's ``rescale_grad`` (the Trainer's ``_scale``), so an average costs no
extra pass over the gradients. Every gradient's allreduce is submitted before any is
awaited, so the core negotiates and fuses them together; each is named by the parameter's
index (``prefix + str(i)``), the same every step. At size 1 nothing is reduced or
rescaled (Horovod's scales by ``gradient_predivide_factor`` there without the matching
prescale, which multiplies the gradients by it).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import List, Optional

import mxnet as mx

from spark_hvd._basics import ProcessSet, global_process_set
from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.mxnet import mpi_ops
from spark_hvd.mxnet.compression import Compression
from spark_hvd.mxnet.mpi_ops import Sum


def _check_factor(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise InvalidArgumentError(f"gradient_predivide_factor must be a number > 0, got "
                                   f"{value!r}")
    return float(value)


def _split(items: list, groups: int) -> List[list]:
    """``items`` in ``groups`` consecutive parts of near-equal length (Horovod's split)."""
    base, extra = divmod(len(items), groups)
    out, start = [], 0
    for g in range(groups):
        stop = start + base + (1 if g < extra else 0)
        if stop > start:
            out.append(items[start:stop])
        start = stop
    return out


def _sum_in_place(grads: list, names: List[str], num_groups: int, factor: float,
                  process_set: ProcessSet) -> None:
    """Allreduces (Sum, prescaled by 1/factor) every NDArray of ``grads`` in place: one op
    each, or ``num_groups`` grouped ops (split further by dtype)."""
    def submit():
        if num_groups <= 0:
            return [mpi_ops._allreduce_async(g, n, Sum, 1.0 / factor, 1.0, process_set, True,
                                             "DistributedTrainer")
                    for g, n in zip(grads, names)]
        handles = []
        for part in _split(list(zip(grads, names)), num_groups):
            by_dtype = defaultdict(list)
            for g, n in part:
                by_dtype[str(g.dtype)].append((g, n))
            for entries in by_dtype.values():
                group = f"{entries[0][1]}:{entries[-1][1]}"
                handles.append(mpi_ops._grouped_allreduce_async(
                    [g for g, _ in entries], group, Sum, 1.0 / factor, 1.0, process_set,
                    True, "DistributedTrainer"))
        return handles
    mpi_ops._submit_all(submit)


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wraps an ``mx.optimizer.Optimizer`` for the Module API: each ``update`` first sums
    the gradient(s) across ranks (the average is completed by ``rescale_grad``)."""

    def __init__(self, optimizer: mx.optimizer.Optimizer,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 process_set: ProcessSet = global_process_set) -> None:
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise InvalidArgumentError(f"DistributedOptimizer wraps an mx.optimizer.Optimizer, "
                                       f"got {type(optimizer).__name__}")
        self._optimizer = optimizer
        self._gradient_predivide_factor = _check_factor(gradient_predivide_factor)
        self._num_groups = int(num_groups)
        self._process_set = process_set
        if process_set.size() > 1:  # at size 1 nothing is reduced, so nothing is rescaled
            self._optimizer.rescale_grad *= self._gradient_predivide_factor / process_set.size()

    def __getattr__(self, item):
        return getattr(self._optimizer, item)

    def create_state(self, index, weight):
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index, weight):
        return self._optimizer.create_state_multi_precision(index, weight)

    def _do_allreduce(self, index, grad) -> None:
        if self._process_set.size() == 1:
            return
        if isinstance(index, (tuple, list)):
            _sum_in_place(list(grad), [str(i) for i in index], self._num_groups,
                          self._gradient_predivide_factor, self._process_set)
        else:
            _sum_in_place([grad], [str(index)], 0, self._gradient_predivide_factor,
                          self._process_set)

    def update(self, index, weight, grad, state):
        self._do_allreduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        self._do_allreduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr):
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult):
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult):
        self._optimizer.set_wd_mult(args_wd_mult)


class DistributedTrainer(mx.gluon.Trainer):
    """A ``gluon.Trainer`` whose ``step``/``allreduce_grads`` sum gradients across the ranks
    of ``process_set`` (no kvstore); ``trainer.step(batch_size)`` with this rank's batch size
    then applies the average over all ranks' samples.

    ``compression``: ``Compression.none`` or ``.fp16``. ``gradient_predivide_factor``: the
    gradients are scaled by ``1/f`` before the sum and ``f/size`` after it. ``prefix`` names
    this trainer's ops (give two trainers different ones). ``num_groups > 0`` allreduces the
    gradients in that many grouped ops.
    """

    def __init__(self, params, optimizer, optimizer_params=None,
                 compression=Compression.none, gradient_predivide_factor: float = 1.0,
                 prefix: Optional[str] = None, num_groups: int = 0,
                 process_set: ProcessSet = global_process_set) -> None:
        if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
            raise InvalidArgumentError("compression must be spark_hvd.mxnet.Compression.none "
                                       f"or .fp16, got {compression!r}")
        if prefix is not None and not isinstance(prefix, str):
            raise InvalidArgumentError(f"prefix must be a str, got {type(prefix).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer
            warnings.warn("DistributedTrainer does not take DistributedOptimizer as its "
                          "optimizer. We have unwrapped it for you.")
        if isinstance(params, (list, tuple)):  # the same order on every rank
            params = sorted(params, key=lambda p: p.name)
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        self._compression = compression
        self._gradient_predivide_factor = _check_factor(gradient_predivide_factor)
        self._process_set = process_set
        if process_set.size() > 1:  # at size 1 nothing is reduced, so nothing is rescaled
            self._scale *= self._gradient_predivide_factor / process_set.size()
        self._prefix = prefix or ""
        self._num_groups = int(num_groups)

    def _allreduce_grads(self):
        if self._process_set.size() == 1:
            return
        live = [(i, p) for i, p in enumerate(self._params) if p.grad_req != "null"]
        packed = [self._compression.compress(p.list_grad()[0]) for _, p in live]
        _sum_in_place([t for t, _ in packed], [self._prefix + str(i) for i, _ in live],
                      self._num_groups, self._gradient_predivide_factor, self._process_set)
        for (_, p), (t, ctx) in zip(live, packed):
            if ctx is not None:  # compressed into a new NDArray: cast back into the gradient
                p.list_grad()[0][:] = self._compression.decompress(t, ctx)
