"""Handles of in-flight ops on torch tensors, and the submit helper every op uses."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from spark_hvd import _ops
from spark_hvd._rules import op_name
from spark_hvd.torch._tensors import device_of, dtype_code, shape_of

Handle = _ops.Handle
GroupHandle = _ops.GroupHandle
poll = _ops.poll  # True when the op behind a handle has completed (synchronize won't block)
synchronize = _ops.synchronize  # waits for an async op and returns its output


_name = op_name  # spark_hvd._rules: the name given, or one generated per kind and set


def _submit(op: int, name: str, tensor: torch.Tensor, out: Optional[torch.Tensor], owner,
            finish: Callable, reduce_op=_ops.Sum, prescale: float = 1.0, postscale: float = 1.0,
            root: int = 0, process_set=_ops.global_process_set, splits=(), group: str = "",
            group_size: int = 0) -> Handle:
    """Submits one op on ``tensor`` (into ``out``); ``owner`` holds every tensor
    whose pointer goes to the core. ``tensor`` has passed ``check``."""
    out_ptr = out.data_ptr() if out is not None else 0
    if not tensor.is_cuda:
        return _ops.submit_op(op, name, dtype_code(tensor.dtype), tensor.shape, tensor.data_ptr(),
                              out_ptr, owner, finish, reduce_op, prescale, postscale, root,
                              process_set, -1, splits, group, group_size, 0)
    device, stream = device_of(tensor)
    args = (op, name, dtype_code(tensor.dtype), shape_of(tensor), tensor.data_ptr(), out_ptr,
            owner, finish, reduce_op, prescale, postscale, root, process_set, device, splits,
            group, group_size, stream)
    if torch.cuda.current_device() != device:
        # The core records the op's ready event on the tensor's stream, with its device
        # current (torch's guard switches without making a context on another GPU).
        with torch.cuda.device(device):
            return _ops.submit_op(*args)
    return _ops.submit_op(*args)
