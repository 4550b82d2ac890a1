"""Handles of in-flight ops on torch tensors, and the submit helper every op uses."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from spark_hvd import _ops
from spark_hvd._runtime import RUNTIME
from spark_hvd.torch._tensors import device_of, dtype_code, shape_of

Handle = _ops.Handle
GroupHandle = _ops.GroupHandle
poll = _ops.poll  # True when the op behind a handle has completed (synchronize won't block)
synchronize = _ops.synchronize  # waits for an async op and returns its output


def _name(name: Optional[str], op: str, process_set=None) -> str:
    """The op's name, or a generated one counted per (op, process set)."""
    if name:
        return name
    return RUNTIME.auto_name(op, 0 if process_set is None else process_set.process_set_id)


def _submit(op: int, name: str, tensor: torch.Tensor, out: Optional[torch.Tensor], owner,
            finish: Callable, **kw) -> Handle:
    """Submits one op on ``tensor`` (into ``out``); ``owner`` holds every tensor
    whose pointer goes to the core."""
    device, stream = device_of(tensor)
    args = (op, name, dtype_code(tensor.dtype), shape_of(tensor), tensor.data_ptr(),
            out.data_ptr() if out is not None else 0, owner, finish)
    if device >= 0 and torch.cuda.current_device() != device:
        # The core records the op's ready event on the tensor's stream, with its device
        # current (torch's guard switches without making a context on another GPU).
        with torch.cuda.device(device):
            return _ops.submit(*args, device=device, stream=stream, **kw)
    return _ops.submit(*args, device=device, stream=stream, **kw)
