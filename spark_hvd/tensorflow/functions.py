"""Broadcasting variables and Python objects between ranks."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from spark_hvd import _ops
from spark_hvd._basics import ProcessSet, global_process_set
from spark_hvd.tensorflow import _async
from spark_hvd.tensorflow._host import (_BITCAST, _check_dtype, collective_name, host_call,
                                        kernels)


def _np_broadcast_many(arrays: Sequence[np.ndarray], root_rank: int, name: str,
                       process_set: ProcessSet) -> List[np.ndarray]:
    """Submits one broadcast per array, then waits for all (the core fuses them)."""
    views = [np.ascontiguousarray(a) for a in arrays]
    views = [a.view(_BITCAST[a.dtype]) if a.dtype in _BITCAST else a for a in views]
    handles = [_ops.broadcast_async(a, root_rank, name=f"{name}.{i}", process_set=process_set)
               for i, a in enumerate(views)]
    return [_ops.synchronize(h).view(a.dtype).reshape(np.shape(a))
            for h, a in zip(handles, arrays)]


@tf.autograph.experimental.do_not_convert
def broadcast_variables(variables, root_rank: int, process_set: ProcessSet = global_process_set,
                        inplace: bool = False, name: Optional[str] = None):
    """Assigns root_rank's values to ``variables`` (tf.Variable or keras.Variable) on every rank.

    All variables travel in one batch of broadcasts. Eagerly it returns None; inside a
    ``tf.function`` it returns the group of assign ops. Every rank must pass the same
    variables in the same order. ``inplace`` is accepted for Horovod compatibility.
    """
    variables = list(variables)
    if not variables:
        return None
    for v in variables:
        _check_dtype(v.dtype if isinstance(v.dtype, tf.DType) else tf.as_dtype(v.dtype),
                     bitcast=True)
    name = collective_name(name, "broadcast_variables", process_set)

    values = [tf.convert_to_tensor(v) for v in variables]
    outs = broadcast_values(values, root_rank, name, process_set)
    assigns = []
    for v, out, value in zip(variables, outs, values):
        if not tf.executing_eagerly():
            out.set_shape(value.shape)
        assigns.append(v.assign(out))
    if tf.executing_eagerly():
        return None
    return tf.group(*[a for a in assigns if a is not None])


def broadcast_values(values: Sequence[tf.Tensor], root_rank: int, name: str,
                     process_set: ProcessSet) -> List[tf.Tensor]:
    """Root_rank's ``values`` on every rank: one broadcast each (``<name>.<i>``), submitted
    together (the core fuses them)."""
    if kernels("broadcast_variables"):
        # One tensor keeps its ".0" as the host functions name it.
        return _async.broadcast(values, root_rank, name if len(values) > 1 else name + ".0",
                                process_set)

    def fn(*arrays):
        return _np_broadcast_many(arrays, root_rank, name, process_set)

    return host_call(fn, values, [t.dtype for t in values], "broadcast_variables")


def broadcast_object(obj: Any = None, root_rank: int = 0, session=None,
                     name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Pickles ``obj`` on root_rank and returns it on every rank (eager/host only)."""
    return _ops.broadcast_object(obj, root_rank, name=name, process_set=process_set)


def broadcast_object_fn(root_rank: int = 0, session=None, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set):
    """Returns ``fn(obj)`` that broadcasts obj from root_rank (Horovod's helper)."""
    def fn(obj):
        return broadcast_object(obj, root_rank, name=name, process_set=process_set)
    return fn


def allgather_object(obj: Any, session=None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Returns the list of every rank's ``obj``, in rank order (eager/host only)."""
    return _ops.allgather_object(obj, name=name, process_set=process_set)
