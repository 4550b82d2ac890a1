"""The rules every framework's ops share, checked once here before anything is submitted:
an op's name, its reduction (``op=`` or Horovod's deprecated ``average=``), and the type of
alltoall's splits.

An op's name: the ``name=`` given, else the next of a counter per (op kind, process set),
``<kind>.<n>`` (``_runtime.auto_name``): the same on every rank as long as the ranks submit
the same ops in the same order, and an op on a set some ranks are not in shifts no other
set's names.

What only the engine can judge (a split's value against the tensor's rows and the process
set's size, shapes against other ranks') is checked by the engine (``Engine::Validate``), the
only full check; what a framework layer must decide on its own side of the boundary, because
it is lost once values are lists of ints, lives here: the type of alltoall's splits.

Alltoall's splits, as Horovod takes them in every framework:

- ``None``: the first dimension is split evenly over the process set's ranks (the engine
  checks that it divides evenly).
- A tensor of the framework (torch, TensorFlow, MXNet): 32-bit integers in one dimension.
  Horovod's core refuses any other dtype with a ``ValueError`` ("alltoall expects splits to
  contain 32-bit integer elements") before anything is sent. That matters beyond the class of
  the error: a float tensor's values are read as counts, and a tensor made with
  ``torch.empty`` holds whatever memory held, so one rank would raise on its values while
  another entered the alltoall, and every later collective of the job would be out of step.
  A dtype is the same on every rank, so refusing by dtype refuses on every rank alike.
- A numpy array: any integer dtype, one dimension (host values, exact whatever their width).
- A sequence (list, tuple): integers (``int`` or numpy integer scalars, not ``bool``).
"""

from __future__ import annotations

from numbers import Integral
from typing import Any, List, Optional

import numpy as np

from spark_hvd._runtime import RUNTIME
from spark_hvd._types import ReduceOp
from spark_hvd.exceptions import InvalidArgumentError

SPLITS_DTYPE = "int32"


def reduce_op(op: Any, average: Optional[bool], default: ReduceOp = ReduceOp.AVERAGE) -> ReduceOp:
    """The reduction an op asks for: ``op`` (a ReduceOp or its value; None: ``default``), or,
    as Horovod still takes it, the deprecated ``average`` (True: Average, False: Sum), not
    both."""
    if average is None:
        if op is None:
            op = default
        return op if type(op) is ReduceOp else ReduceOp(op)
    if op is not None:
        raise InvalidArgumentError("give either op= or the deprecated average=, not both")
    return ReduceOp.AVERAGE if average else ReduceOp.SUM


def op_name(name: Optional[str], kind: str, process_set: Any = None) -> str:
    """``name`` if given, else the next generated name of ``kind`` on ``process_set``
    (None: the global set)."""
    if name:
        return name
    return RUNTIME.auto_name(kind, 0 if process_set is None else process_set.process_set_id)


def check_splits_tensor(dtype: str, ndim: int, cast: str) -> None:
    """Horovod's two checks of a framework tensor of splits: 32-bit integers, at most one
    dimension. ``dtype`` is the tensor's dtype name ("float32"), ``cast`` how to fix it in
    that framework ("splits.to(torch.int32)")."""
    if dtype != SPLITS_DTYPE:
        raise InvalidArgumentError(
            f"alltoall expects splits of 32-bit integers (int32), got a tensor of {dtype}; "
            f"pass {cast}, or a list of ints")
    if ndim > 1:
        raise InvalidArgumentError(
            f"alltoall expects a one-dimensional splits tensor, got {ndim} dimensions")


def splits_values(splits: Any) -> List[int]:
    """The rows to send to each rank, from a numpy array or a sequence (a framework tensor
    has passed ``check_splits_tensor`` and comes as its values)."""
    if isinstance(splits, np.ndarray):
        if not np.issubdtype(splits.dtype, np.integer):
            raise InvalidArgumentError(
                f"alltoall expects integer splits, got a numpy array of {splits.dtype}; "
                "pass splits.astype(np.int32)")
        if splits.ndim > 1:
            raise InvalidArgumentError(
                f"alltoall expects one-dimensional splits, got {splits.ndim} dimensions")
        return [int(v) for v in splits.reshape(-1)]
    try:
        values = list(splits)
    except TypeError:
        raise InvalidArgumentError(
            f"alltoall expects splits as a sequence of integers, got {type(splits).__name__}"
        ) from None
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, Integral):
            raise InvalidArgumentError(
                f"alltoall expects integer splits, got {v!r} ({type(v).__name__}) at "
                f"position {i} of {values!r}")
    return [int(v) for v in values]


def alltoall_splits(splits: Any) -> Optional[List[int]]:
    """``splits`` as the core takes them: None (even), or a list of ints."""
    return None if splits is None else splits_values(splits)
