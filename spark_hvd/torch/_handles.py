"""Handles of in-flight ops on torch tensors, and the submit helper every op uses."""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

from spark_hvd import _ops
from spark_hvd._basics import _RUNTIME
from spark_hvd.torch._tensors import dtype_code, shape_of

Handle = _ops.Handle


class GroupHandle:
    """Several core ops that complete together; ``finish`` turns their results
    (in order) into the value ``synchronize`` returns."""

    __slots__ = ("handles", "finish", "done", "value")

    def __init__(self, handles: List[Any], finish: Callable[[List[Any]], Any]) -> None:
        self.handles = handles
        self.finish = finish
        self.done = False
        self.value = None

    def __repr__(self) -> str:
        return f"GroupHandle({self.handles})"


def poll(handle) -> bool:
    """True when the op behind ``handle`` has completed (synchronize won't block)."""
    if isinstance(handle, GroupHandle):
        return handle.done or all(poll(h) for h in handle.handles)
    return _ops.poll(handle)


def synchronize(handle):
    """Waits for an async op and returns its output (tensor, tuple or list)."""
    if not isinstance(handle, GroupHandle):
        return _ops.synchronize(handle)
    if handle.done:
        return handle.value
    results, error = [], None
    for h in handle.handles:  # wait for all, so no op is left unreleased on an error
        try:
            results.append(synchronize(h))
        except Exception as exc:  # noqa: BLE001 - re-raised below
            error = error or exc
            results.append(None)
    if error is not None:
        raise error
    handle.value = handle.finish(results)
    handle.done = True
    handle.handles = []
    return handle.value


def _name(name: Optional[str], op: str, process_set=None) -> str:
    """The op's name, or a generated one counted per (op, process set)."""
    if name:
        return name
    return _RUNTIME.auto_name(op, 0 if process_set is None else process_set.process_set_id)


def _submit(op: int, name: str, tensor: torch.Tensor, out: Optional[torch.Tensor], keep,
            finish: Callable, **kw) -> Handle:
    return _ops.submit(op, name, dtype_code(tensor.dtype), shape_of(tensor), tensor.data_ptr(),
                       out.data_ptr() if out is not None else 0, keep, finish, **kw)
