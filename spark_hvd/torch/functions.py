"""Broadcasting model parameters, optimizer state and Python objects."""

from __future__ import annotations

from typing import Any, List, Optional

import torch

from spark_hvd import _ops
from spark_hvd._basics import ProcessSet, global_process_set, rank
from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.torch.mpi_ops import broadcast_async_, synchronize


def broadcast_object(obj: Any = None, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Returns root_rank's ``obj`` (pickled with cloudpickle) on every rank."""
    return _ops.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Returns every rank's ``obj``, in rank order."""
    return _ops.allgather_object(obj, name, process_set)


def _named_tensors(params, what: str):
    if isinstance(params, dict):
        items = sorted(params.items(), key=lambda kv: str(kv[0]))
    elif isinstance(params, torch.Tensor):
        raise InvalidArgumentError(f"{what} takes a state_dict, a list of (name, tensor) pairs "
                                   "or a list of tensors, not a single tensor")
    else:
        try:
            items = [p if isinstance(p, tuple) else (None, p) for p in params]
        except TypeError:
            raise InvalidArgumentError(f"{what}: params of type {type(params).__name__} is "
                                       "neither a dict nor an iterable") from None
    for name, p in items:
        if p is not None and not isinstance(p, torch.Tensor):
            raise InvalidArgumentError(f"{what}: {name or 'an entry'} is a "
                                       f"{type(p).__name__}, not a tensor")
    return [(n, p) for n, p in items if p is not None]


def broadcast_parameters(params, root_rank: int,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrites parameters on every rank with root_rank's values, in place.

    ``params``: ``model.state_dict()``, ``model.named_parameters()`` or a list of
    tensors. All broadcasts are in flight at once, then awaited.
    """
    handles = [broadcast_async_(p, root_rank, f"broadcast_parameters.{n}" if n else None,
                                process_set)
               for n, p in _named_tensors(params, "broadcast_parameters")]
    for h in handles:
        synchronize(h)


class _TensorSlot:
    """Stands for the i-th tensor of a broadcast optimizer state_dict."""

    __slots__ = ("index", "shape", "dtype")

    def __init__(self, index: int, shape, dtype) -> None:
        self.index = index
        self.shape = tuple(shape)
        self.dtype = dtype

    def __getstate__(self):
        return (self.index, self.shape, self.dtype)

    def __setstate__(self, state):
        self.index, self.shape, self.dtype = state


def _strip(x, tensors: list):
    if isinstance(x, torch.Tensor):
        tensors.append(x)
        return _TensorSlot(len(tensors) - 1, x.shape, x.dtype)
    if isinstance(x, dict):
        return type(x)((k, _strip(v, tensors)) for k, v in x.items())
    if isinstance(x, list):
        return [_strip(v, tensors) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_strip(v, tensors) for v in x)
    return x


def _fill(x, tensors: list):
    if isinstance(x, _TensorSlot):
        return tensors[x.index]
    if isinstance(x, dict):
        return type(x)((k, _fill(v, tensors)) for k, v in x.items())
    if isinstance(x, list):
        return [_fill(v, tensors) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_fill(v, tensors) for v in x)
    return x


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Optional[torch.nn.Module] = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Makes every rank's optimizer state equal to root_rank's (Horovod's signature).

    The whole ``state_dict()`` travels: per-parameter state (tensors such as
    Adam's moments and ``step``, and scalars) and every param_group option (lr,
    betas, weight_decay, ...). Its structure goes as one pickled object with
    placeholders for the tensors, the tensors themselves as in-place broadcasts;
    the other ranks then ``load_state_dict`` it. As Horovod's, a rank whose
    optimizer has no state yet (before its first step, its parameters without
    gradients) first makes it with one step of the wrapped optimizer on zero
    gradients (every parameter that requires grad gets a zero ``grad``, sparse for
    SparseAdam; a DistributedOptimizer's own step, which would reduce, is not
    used); an optimizer still stateless after that has nothing to broadcast.

    Parameters that do not require grad have no state, so only the others' state
    travels, and a parameter frozen on some ranks only is no obstacle.

    ``model`` (Horovod's argument) is accepted and checked; nothing depends on it.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError("broadcast_optimizer_state takes a torch.optim.Optimizer, "
                                   f"got {type(optimizer).__name__}")
    if model is not None and not isinstance(model, torch.nn.Module):
        hint = (" (process_set is the fourth argument, as in Horovod: pass it by keyword)"
                if isinstance(model, ProcessSet) else "")
        raise InvalidArgumentError("broadcast_optimizer_state: model must be a "
                                   f"torch.nn.Module, got {type(model).__name__}{hint}")
    if not optimizer.state_dict()["state"]:
        _initialize_state(optimizer)
    is_root = rank() == root_rank  # a global rank, as in Horovod
    tensors: list = []
    skeleton = _strip(optimizer.state_dict(), tensors) if is_root else None
    skeleton = broadcast_object(skeleton, root_rank, "broadcast_optimizer_state.structure",
                                process_set)
    if not is_root:
        slots: list = []
        _collect_slots(skeleton, slots)
        slots.sort(key=lambda s: s.index)
        tensors = [torch.empty(s.shape, dtype=s.dtype) for s in slots]
    handles = [broadcast_async_(t, root_rank, f"broadcast_optimizer_state.{i}", process_set)
               for i, t in enumerate(tensors)]
    for h in handles:
        synchronize(h)
    if not is_root:
        optimizer.load_state_dict(_fill(skeleton, tensors))


def _initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Horovod's initialization of a new optimizer's state: one step on zero gradients,
    taken by the wrapped optimizer's class when ``optimizer`` is a DistributedOptimizer
    (a subclass of it whose step would reduce the gradients)."""
    from spark_hvd.torch.optimizer import _DistributedOptimizer

    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam):
                    p.grad = p.grad.to_sparse()
    if isinstance(optimizer, _DistributedOptimizer):
        type(optimizer).__bases__[-1].step(optimizer)
    else:
        optimizer.step()


def _collect_slots(x, out: list) -> None:
    if isinstance(x, _TensorSlot):
        out.append(x)
    elif isinstance(x, dict):
        for v in x.values():
            _collect_slots(v, out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _collect_slots(v, out)
