"""broadcast_parameters (Gluon and Module parameters, deferred initialisation as Horovod's),
broadcast_object and allgather_object for MXNet."""

from __future__ import annotations

import types
from typing import Any, List, Optional

import mxnet as mx

from spark_hvd import _ops
from spark_hvd._basics import ProcessSet, global_process_set
from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.mxnet import mpi_ops


@mpi_ops._mxnet_errors
def broadcast_object(obj: Any = None, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Returns root_rank's ``obj`` (pickled with cloudpickle) on every rank."""
    return _ops.broadcast_object(obj, root_rank, name, process_set)


@mpi_ops._mxnet_errors
def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Returns every rank's ``obj``, in rank order."""
    return _ops.allgather_object(obj, name, process_set)


def _broadcast_after_init(param, root_rank: int, name: str, process_set: ProcessSet):
    """``param._init_impl`` that broadcasts root_rank's values once the parameter has its
    shape (Gluon's deferred initialisation runs it at the first forward pass, on every
    rank in the same order)."""
    init_impl = param._init_impl

    def wrapped(self, *args, **kwargs):
        init_impl(*args, **kwargs)
        mpi_ops.broadcast_(self.data(), root_rank, name=name, process_set=process_set)
    return wrapped


def broadcast_parameters(params, root_rank: int = 0, prefix: Optional[str] = None,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrites parameters on every rank with root_rank's, in place (Horovod's).

    ``params``: ``block.collect_params()`` (a Gluon ParameterDict or dict of Parameters) or
    a dict of NDArrays (``module.get_params()``'s arg_params and aux_params). Parameters
    whose initialisation is deferred are broadcast right after it. ``prefix`` names the
    ops (give different ones to calls that could be in flight together). Every broadcast
    is in flight at once, then awaited. A no-op at size 1.
    """
    if prefix is not None and not isinstance(prefix, str):
        raise InvalidArgumentError(f"broadcast_parameters: prefix must be a str, got "
                                   f"{type(prefix).__name__}")
    valid = (dict, mx.gluon.ParameterDict)
    if not isinstance(params, valid):
        raise InvalidArgumentError(
            f"invalid params of type: {type(params)}; broadcast_parameters takes "
            "block.collect_params() or a dict of NDArrays (module.get_params())")
    if process_set.size() == 1:
        return
    prefix = prefix or ""
    tensors = []
    for name, p in sorted(params.items()):
        op_name = prefix + str(name)
        if isinstance(p, mx.gluon.Parameter):
            try:
                tensors.append((p.data(), op_name))
            except mx.gluon.parameter.DeferredInitializationError:
                p._init_impl = types.MethodType(
                    _broadcast_after_init(p, root_rank, op_name, process_set), p)
        elif isinstance(p, mx.nd.NDArray):
            tensors.append((p, op_name))
        else:
            raise InvalidArgumentError(f"broadcast_parameters: {name!r} is a "
                                       f"{type(p).__name__}, not a Parameter or NDArray")
    mpi_ops._submit_all(lambda: [
        mpi_ops._broadcast_async(t, root_rank, n, process_set, True, "broadcast_parameters")
        for t, n in tensors])
