"""DistributedOptimizer: gradient averaging overlapped with backward.

The wrapped optimizer becomes an instance of a subclass of its own class (so
``isinstance(opt, torch.optim.Adam)``, LR schedulers and ``state_dict`` work as
before) that shares the original's ``param_groups`` and ``state``.

Overlap: every trainable parameter gets a ``register_post_accumulate_grad_hook``.
Autograd calls it once the parameter's gradient for this backward pass is fully
accumulated into ``p.grad``; the hook then starts an in-place allreduce of that
gradient at once (after the k-th pass with ``backward_passes_per_step=k``), so
communication of late layers runs while autograd is still computing early ones.
``step()`` (or ``synchronize()``) submits whatever no hook submitted (parameters
without a gradient this step get a zero gradient, since other ranks may have
one), waits for everything and writes the results into ``p.grad``. Each
gradient's op is named ``allreduce.<parameter name>``, the same every step, so
the core's response cache turns negotiation into a bit-vector exchange.

With ``op=Adasum`` the optimizer works on updates instead of gradients: each
rank takes the local step on its own gradients, and the parameter deltas are
combined with Adasum (an allreduce with op=Adasum, run by the core); gradients
are not averaged.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Dict, List

import torch

from spark_hvd import _ops
from spark_hvd._basics import ProcessSet, global_process_set
from spark_hvd._runtime import RUNTIME
from spark_hvd._types import ReduceOp
from spark_hvd.exceptions import InvalidArgumentError, SparkHvdError
from spark_hvd.torch import _reduce_ops, mpi_ops
from spark_hvd.torch.compression import Compression

Average = ReduceOp.AVERAGE
Adasum = ReduceOp.ADASUM


# Begins as Horovod's, so warnings filters written for it match.
STEP_AFTER_SYNCHRONIZE_WARNING = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). step() allreduces every gradient again, which slows "
    "training (and with op=Sum sums the sums); wrap step() in optimizer.skip_synchronize() "
    "when you call optimizer.synchronize() yourself.")

AMP_BEFORE_SYNCHRONIZE_ERROR = (
    "GradScaler.step(optimizer) was called while the gradients' allreduces are in flight: "
    "its unscaling and inf check would race with them, and ranks could disagree on skipping "
    "the step. With a DistributedOptimizer, call optimizer.synchronize() after "
    "scaler.scale(loss).backward(), then scaler.unscale_(optimizer) (and any clipping), then "
    "scaler.step(optimizer) inside `with optimizer.skip_synchronize():`, then scaler.update().")


class GradientsPendingError(SparkHvdError, RuntimeError):
    """An optimizer call that would race with in-flight gradient allreduces."""


def _horovod_attribute(attr: str, doc: str) -> property:
    """A read-only view of ``attr`` under the name Horovod's optimizer gives it."""
    return property(lambda self: getattr(self, attr), doc=doc)


class _DistributedOptimizer:
    """Mixed in before the wrapped optimizer's class; see DistributedOptimizer."""

    # Tell torch.optim not to wrap this step with its profiling/hook wrapper:
    # the wrapped class's step (called through super()) already is.
    def step(self, closure=None):
        if self._hvd_should_sync:
            if self._hvd_synchronized:
                warnings.warn(STEP_AFTER_SYNCHRONIZE_WARNING)
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    step.hooked = True  # type: ignore[attr-defined]

    # -- the attributes of Horovod's DistributedOptimizer, for code that reads them -------
    _parameter_names = _horovod_attribute(
        "_hvd_names", "parameter -> name (model.named_parameters()' names, or Horovod's "
        "'allreduce.noname.<group>.<index>')")
    op = _horovod_attribute("_hvd_op", "the ReduceOp gradients are combined with")
    gradient_predivide_factor = _horovod_attribute("_hvd_predivide", "see DistributedOptimizer")
    sparse_as_dense = _horovod_attribute("_hvd_sparse_as_dense", "see DistributedOptimizer")
    process_set = _horovod_attribute("_hvd_process_set", "the ranks that average")
    _compression = _horovod_attribute("_hvd_compression", "the gradient compression")
    _synchronized = _horovod_attribute("_hvd_synchronized", "synchronize() ran since step()")
    _should_synchronize = _horovod_attribute("_hvd_should_sync",
                                             "False within skip_synchronize()")

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """The wrapped optimizer's flag (fused Adam sets it). ``GradScaler.step`` reads it
        before it reads the gradients: with allreduces still writing into them (no
        ``synchronize()`` since ``backward()``), its inf check and unscaling would race
        with them, and each rank could skip or take the step on its own, so that is
        refused here with the order that works (Horovod's)."""
        if self._hvd_handles or self._hvd_group_handles:
            raise GradientsPendingError(AMP_BEFORE_SYNCHRONIZE_ERROR)
        return self.__dict__.get("_step_supports_amp_scaling", False)

    @_step_supports_amp_scaling.setter
    def _step_supports_amp_scaling(self, value: bool) -> None:
        self.__dict__["_step_supports_amp_scaling"] = value

    @property
    def backward_passes_per_step(self) -> int:
        return self._hvd_passes

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, passes: int) -> None:  # Horovod code assigns it
        self.set_backward_passes_per_step(passes)

    # -- setup -------------------------------------------------------------------
    def _hvd_init(self, named_parameters, compression, backward_passes_per_step: int, op,
                  gradient_predivide_factor: float, groups, sparse_as_dense: bool,
                  process_set: ProcessSet) -> None:
        if backward_passes_per_step < 1:
            raise InvalidArgumentError("backward_passes_per_step must be >= 1, got "
                                       f"{backward_passes_per_step}")
        self._hvd_compression = compression
        self._hvd_passes = int(backward_passes_per_step)
        self._hvd_op = ReduceOp(op)
        self._hvd_predivide = float(gradient_predivide_factor)
        self._hvd_sparse_as_dense = bool(sparse_as_dense)
        self._hvd_process_set = process_set
        self._hvd_names = _parameter_names(self.param_groups, named_parameters)
        # op names: Horovod's, "allreduce.noname.<group>.<index>" for unnamed parameters
        prefix = "" if named_parameters is None else "allreduce."
        self._hvd_op_names = {p: prefix + n for p, n in self._hvd_names.items()}
        self._hvd_params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._hvd_group_of, self._hvd_groups = _make_groups(self._hvd_params, groups)
        self._hvd_delay: Dict[torch.Tensor, int] = {}
        self._hvd_handles: Dict[torch.Tensor, tuple] = {}  # p -> (handle, ctx, grad sent)
        self._hvd_group_handles: Dict[int, list] = {}  # group -> [(p, handle, ctx, sent)]
        self._hvd_group_ready: Dict[int, set] = {}
        self._hvd_should_sync = True
        self._hvd_synchronized = False
        # An elastic job may grow: as Horovod, its optimizer reduces even while alone.
        self._hvd_active = process_set.size() > 1 or RUNTIME.epoch is not None
        if self._hvd_active:
            ref = weakref.ref(self)
            for p in self._hvd_params:
                p.register_post_accumulate_grad_hook(_make_hook(ref))

    def set_backward_passes_per_step(self, passes: int) -> None:
        if passes < 1:
            raise InvalidArgumentError(f"backward_passes_per_step must be >= 1, got {passes}")
        self._hvd_passes = int(passes)
        self._hvd_delay.clear()

    # -- the hook path -----------------------------------------------------------------
    def _hvd_on_grad(self, p: torch.Tensor) -> None:
        if p in self._hvd_handles or self._hvd_group_submitted(p):
            raise GradientsPendingError(
                f"the gradient of '{self._hvd_names[p]}' was computed again while its allreduce "
                f"was in flight: more than backward_passes_per_step={self._hvd_passes} backward "
                "passes ran before step()/synchronize(). Raise backward_passes_per_step to "
                "accumulate gradients locally, or call step() after each pass.")
        left = self._hvd_delay.get(p, self._hvd_passes) - 1
        if left < 0:
            raise GradientsPendingError(
                f"the gradient of '{self._hvd_names[p]}' was computed more than "
                f"backward_passes_per_step={self._hvd_passes} times before step()/synchronize()")
        self._hvd_delay[p] = left
        if left > 0:
            return
        g = self._hvd_group_of.get(p)
        if g is None:
            self._hvd_handles[p] = self._hvd_submit(p)
            return
        ready = self._hvd_group_ready.setdefault(g, set())
        ready.add(p)
        if len(ready) == len(self._hvd_groups[g]):
            self._hvd_submit_group(g)

    def _hvd_group_submitted(self, p) -> bool:
        g = self._hvd_group_of.get(p)
        return g is not None and g in self._hvd_group_handles

    def _hvd_scales(self):
        if self._hvd_op == Average:
            return 1.0 / self._hvd_predivide, self._hvd_predivide
        return 1.0, 1.0

    def _hvd_grad(self, p: torch.Tensor) -> torch.Tensor:
        if p.grad is None:  # no gradient here this step, but other ranks may have one
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse and self._hvd_sparse_as_dense:
            # Only the allreduce is dense: synchronize() turns the result back into a
            # sparse p.grad (Horovod), so optimizers that need one (SparseAdam) still step.
            return p.grad.to_dense()
        return p.grad

    def _hvd_submit(self, p: torch.Tensor, group: str = "", group_size: int = 0) -> tuple:
        grad = self._hvd_grad(p)
        name = self._hvd_op_names[p]
        if grad.is_sparse:
            if group:
                raise InvalidArgumentError(
                    f"'{name}' has a sparse gradient, which cannot join an allreduce group; use "
                    "sparse_as_dense=True or leave the parameter out of groups")
            return mpi_ops.sparse_allreduce_async(grad, name, self._hvd_op,
                                                  self._hvd_process_set), None, None
        sent, ctx = self._hvd_compression.compress(grad)
        pre, post = self._hvd_scales()
        handle = _reduce_ops._allreduce_async(sent, name, self._hvd_op, pre, post,
                                              self._hvd_process_set, True, sent,
                                              "DistributedOptimizer", group, group_size)
        return handle, ctx, sent

    def _hvd_submit_group(self, g: int) -> None:
        params = self._hvd_groups[g]
        tag = f"allreduce.group.{g}"
        with _ops.submit_together():  # all of the group or none of it
            entries = [(p, *self._hvd_submit(p, tag, len(params))) for p in params]
        self._hvd_group_handles[g] = entries

    def _hvd_clear_pending(self) -> None:
        """Forgets the allreduces in flight and the backward passes counted: synchronize()
        once it holds them, an elastic state's restore() after a failed step (so the
        step after the reset starts clean)."""
        self._hvd_handles = {}
        self._hvd_group_handles = {}
        self._hvd_group_ready = {}
        self._hvd_delay = {}

    # -- synchronize / step / zero_grad -----------------------------------------------
    def synchronize(self) -> None:
        """Waits for every gradient allreduce (submitting any not yet started) and
        leaves the averaged gradients in ``p.grad``; then gradients may be
        modified (clipped) before ``step()`` under ``skip_synchronize()``."""
        if not self._hvd_active:
            self._hvd_synchronized = True
            return
        for p in self._hvd_params:
            if p in self._hvd_handles or p in self._hvd_group_of:
                continue
            self._hvd_handles[p] = self._hvd_submit(p)
        for g in range(len(self._hvd_groups)):
            if g not in self._hvd_group_handles:
                self._hvd_submit_group(g)
        pending = [(p, *v) for p, v in self._hvd_handles.items()]
        for entries in self._hvd_group_handles.values():
            pending.extend(entries)
        self._hvd_clear_pending()
        error = None
        for p, handle, ctx, sent in pending:
            try:
                out = mpi_ops.synchronize(handle)
            except Exception as exc:  # noqa: BLE001 - wait for the rest, then re-raise
                error = error or exc
                continue
            if sent is None:  # sparse: the result is a new, coalesced sparse tensor
                p.grad = out
                continue
            result = self._hvd_compression.decompress(out, ctx)
            if p.grad.is_sparse:  # sparse_as_dense: sparse again, coalesced
                p.grad = result.to_sparse(p.grad.sparse_dim())
            elif result is not p.grad:
                p.grad.copy_(result)
        if error is not None:
            raise error
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Within it, ``step()`` does not synchronize (call ``synchronize()`` first)."""
        self._hvd_should_sync = False
        try:
            yield
        finally:
            self._hvd_should_sync = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hvd_handles or self._hvd_group_handles:
            names = [self._hvd_names[p] for p in self._hvd_handles]
            names += [self._hvd_names[e[0]] for es in self._hvd_group_handles.values()
                      for e in es]
            raise GradientsPendingError(
                f"optimizer.zero_grad() was called while the allreduces of {len(names)} "
                f"gradients (e.g. '{names[0]}') are in flight, between loss.backward() and "
                "optimizer.step(): the allreduce writes into p.grad in the background, so "
                "zeroing it now would race with it. Call zero_grad() before backward() or "
                "after step() (or call optimizer.synchronize() first).")
        self._hvd_delay = {}
        self._hvd_group_ready = {}
        return super().zero_grad(set_to_none)


def _make_hook(ref):
    def hook(p):
        opt = ref()
        if opt is not None:
            opt._hvd_on_grad(p)
    return hook


class _DistributedAdasumOptimizer(_DistributedOptimizer):
    """op=Adasum: local step on local gradients, then Adasum of the parameter deltas."""

    def step(self, closure=None):
        if not self._hvd_active:
            return super(_DistributedOptimizer, self).step(closure)
        n = self._hvd_process_set.size()
        if n & (n - 1):  # refused before the local step changes the parameters
            raise InvalidArgumentError(f"op=Adasum needs a power-of-two number of ranks, as "
                                       f"in Horovod; this optimizer's process set has {n}")
        params = self._hvd_params
        start = [p.detach().clone() for p in params]
        loss = super(_DistributedOptimizer, self).step(closure)
        handles = []
        with torch.no_grad():
            for p, s in zip(params, start):
                delta = p.detach() - s
                handles.append(mpi_ops.allreduce_async_(
                    delta, name=f"adasum.{self._hvd_names[p]}", op=Adasum,
                    process_set=self._hvd_process_set))
            for p, s, h in zip(params, start, handles):
                p.copy_(s + mpi_ops.synchronize(h))
        return loss

    step.hooked = True  # type: ignore[attr-defined]

    def _hvd_on_grad(self, p):  # no gradient allreduce with Adasum
        pass

    def synchronize(self) -> None:
        self._hvd_synchronized = True


def _parameter_names(param_groups, named_parameters) -> Dict[torch.Tensor, str]:
    in_optimizer = [p for g in param_groups for p in g["params"]]
    if named_parameters is None:
        return {p: f"allreduce.noname.{gi}.{i}" for gi, g in enumerate(param_groups)
                for i, p in enumerate(g["params"])}  # Horovod's names
    named = list(named_parameters)
    if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
        raise InvalidArgumentError("named_parameters must be (name, parameter) pairs, as "
                                   "model.named_parameters() gives")
    seen, dups = set(), set()
    for n, _ in named:
        (dups if n in seen else seen).add(n)
    if dups:
        raise InvalidArgumentError("parameter names in named_parameters must be unique; "
                                   f"duplicates: {sorted(dups)}")
    by_id = {id(p): n for n, p in named}
    missing = [i for i, p in enumerate(in_optimizer) if id(p) not in by_id]
    if missing:
        raise InvalidArgumentError(
            f"named_parameters does not name {len(missing)} of the optimizer's parameters "
            f"(positions {missing[:10]}); pass the named_parameters() of the whole model the "
            "optimizer was built on")
    return {p: by_id[id(p)] for p in in_optimizer}


def _make_groups(params: List[torch.Tensor], groups):
    """(param -> group index, list of groups) from groups=int or list of lists."""
    if groups is None or groups == 0:
        return {}, []
    if isinstance(groups, int):
        if groups < 0:
            raise InvalidArgumentError(f"groups must be >= 0, got {groups}")
        n = min(groups, len(params))
        base, rem = divmod(len(params), n) if n else (0, 0)
        out, start = [], 0
        for i in range(n):
            size = base + (1 if i < rem else 0)
            out.append(params[start:start + size])
            start += size
    else:
        trainable = {id(p) for p in params}
        out = []
        for grp in groups:
            grp = [p for p in grp]
            bad = [p for p in grp if id(p) not in trainable]
            if bad:
                raise InvalidArgumentError("groups names a tensor that is not a trainable "
                                           "parameter of this optimizer")
            if grp:
                out.append(grp)
    group_of = {}
    for gi, grp in enumerate(out):
        for p in grp:
            if p in group_of:
                raise InvalidArgumentError("a parameter appears in more than one group")
            group_of[p] = gi
    return group_of, out


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression=Compression.none, backward_passes_per_step: int = 1,
                         op=Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups=None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Wraps a torch optimizer so that ``step()`` applies gradients averaged across ranks.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        Any optimizer (SGD, Adam, AdamW, ...); the result is an instance of a
        subclass of its class sharing its param_groups and state.
    named_parameters : iterable of (str, Parameter), optional
        Typically ``model.named_parameters()``: names the allreduce of each
        gradient ``allreduce.<name>``. Without it, as in Horovod, the j-th parameter
        of param_group i is named ``allreduce.noname.<i>.<j>`` (``_parameter_names``).
    compression : Compression.none, Compression.fp16 or Compression.bf16
    backward_passes_per_step : int
        Backward passes accumulated locally between allreduces (call ``step()``
        after the k-th).
    op : Average (default), Sum or Adasum
        Adasum combines each rank's *update* (local step) with Adasum instead of
        averaging gradients.
    gradient_predivide_factor : float
        With Average: gradients are scaled by 1/f before the sum and by f/size
        after it.
    num_groups, groups : int or list of lists of parameters
        Explicit grouping: each group's gradients go as one grouped allreduce
        once all of them are ready (int: that many groups of consecutive
        parameters). ``num_groups`` is the deprecated Horovod spelling.
    sparse_as_dense : bool
        Allreduce sparse gradients as dense tensors (else they are gathered as
        indices and values). Either way ``p.grad`` ends sparse and coalesced, as in
        Horovod, so optimizers that need sparse gradients (SparseAdam) step.
    process_set : ProcessSet
        Ranks that average among themselves.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError("DistributedOptimizer wraps a torch.optim.Optimizer, got "
                                   f"{type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise InvalidArgumentError("this optimizer is already a DistributedOptimizer")
    op = ReduceOp(op)
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM):
        raise InvalidArgumentError(f"DistributedOptimizer supports op=Average, Sum or Adasum, "
                                   f"not {op.name}")
    if gradient_predivide_factor != 1.0 and op != ReduceOp.AVERAGE:
        raise InvalidArgumentError("gradient_predivide_factor needs op=Average")
    if gradient_predivide_factor <= 0:
        raise InvalidArgumentError("gradient_predivide_factor must be > 0")
    if num_groups and groups is None:
        groups = num_groups
    mixin = _DistributedAdasumOptimizer if op == ReduceOp.ADASUM else _DistributedOptimizer
    cls = type(optimizer.__class__.__name__, (mixin, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    # Share the optimizer's state, but not methods patched onto the instance (a torch
    # LR scheduler created before wrapping installs its own `step`): they would
    # shadow the distributed step and skip the allreduce.
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items()
                             if k not in ("step", "zero_grad")})
    wrapped._hvd_init(named_parameters, compression, backward_passes_per_step, op,
                      gradient_predivide_factor, groups, sparse_as_dense, process_set)
    return wrapped
