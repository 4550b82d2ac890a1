"""Collectives on numpy arrays, and the handle machinery every framework layer shares.

A framework layer (spark_hvd.torch, spark_hvd.tensorflow) describes a tensor to
the core as (data pointer, dtype code, shape, device) and passes an ``owner``
object (the tensors behind the pointers), which the core holds until it has
finished with the op, whatever happens to the handle; plus a ``finish``
callable that turns the core's result into its own tensor type.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from spark_hvd import _core
from spark_hvd._rules import alltoall_splits, op_name, reduce_op
from spark_hvd._runtime import RUNTIME, ProcessSet, explain_failure, global_process_set, rank
from spark_hvd._types import DataType, OpType, ReduceOp, numpy_code
from spark_hvd.exceptions import InvalidArgumentError, SparkHvdError

Sum = ReduceOp.SUM
Average = ReduceOp.AVERAGE
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM

_WAIT_SLICE_S = 1.0  # wait in slices so Ctrl-C reaches Python


class Handle:
    """An in-flight op: pass it to ``synchronize`` or ``poll``.

    Dropping a handle before the op completes is safe: the core keeps the op's
    buffers until it is done with them, and frees a result nobody claimed.
    A group handle stands for several ops (``members``) that finish together.
    """

    __slots__ = ("work", "members", "finish", "done", "value")

    def __init__(self, work: Any, finish: Callable, members: Optional[List["Handle"]] = None) \
            -> None:
        self.work = work  # the core's _core.Work; None for a group, or until a batch submits
        self.members = members
        self.finish = finish
        self.done = False
        self.value = None

    def __repr__(self) -> str:
        state = "done" if self.done else "in flight"
        return f"Handle({'group of %d' % len(self.members) if self.members else 'op'}, {state})"


class _Batch(threading.local):
    pending: Optional[List[Tuple[Any, Handle]]] = None  # while a submit_together block runs
    # False while ``blocking`` submits: this thread waits for the ops at once, and its wait
    # runs the engine's cycle (the core's Engine::Drive), so the engine thread is not woken.
    wake: bool = True


_batch = _Batch()  # .pending: [(_core.Op, handle)] inside a submit_together block


@contextlib.contextmanager
def submit_together() -> Iterator[None]:
    """Ops submitted inside the block reach the core together when it ends, or,
    if the block raises or any op is invalid, none of them do: a group is never
    left half submitted. Nested blocks submit with the outermost one."""
    if _batch.pending is not None:
        yield
        return
    _batch.pending = []
    try:
        yield
        pending = _batch.pending
    finally:
        _batch.pending = None
    if pending:
        _enqueue(pending)


def _enqueue(pending: List[Tuple[Any, Handle]]) -> None:
    try:
        works = _core.enqueue([op for op, _ in pending], _batch.wake)
    except SparkHvdError as exc:
        raise explain_failure(exc) from None
    for (_, handle), work in zip(pending, works):
        handle.work = work


def submit(op: int, name: str, dtype: int, shape: Sequence[int], in_ptr: int, out_ptr: int,
           owner: Any, finish: Callable, *, reduce_op: int = Sum, prescale: float = 1.0,
           postscale: float = 1.0, root: int = 0, process_set: ProcessSet = global_process_set,
           device: int = -1, splits: Sequence[int] = (), group: str = "",
           group_size: int = 0, stream: int = 0) -> Handle:
    """Queues one op on the core (or on the enclosing ``submit_together`` block);
    raises at once for invalid input. ``in_ptr``/``out_ptr`` are addresses, or numpy
    arrays standing for theirs (C-contiguous); ``owner`` keeps them valid; a device
    tensor gives the CUDA ``stream`` that produced it (0: the default stream).
    ``root`` (broadcast) is a global rank; the core gets its rank within the set."""
    return submit_op(op, name, dtype, shape, in_ptr, out_ptr, owner, finish, reduce_op,
                     prescale, postscale, root, process_set, device, splits, group, group_size,
                     stream)


def submit_op(op, name, dtype, shape, in_ptr, out_ptr, owner, finish, reduce_op, prescale,
              postscale, root, process_set, device, splits, group, group_size,
              stream) -> Handle:
    """``submit`` with every field positional, for the framework layers' per-call path
    (the small blocking collectives): no keyword dicts, and enum and number conversions
    only where a caller passed something else."""
    set_id = process_set._require()
    if op == OpType.BROADCAST:
        root = process_set._set_rank_of(int(root))
    if type(op) is not OpType:
        op = OpType(op)
    if type(dtype) is not DataType:
        dtype = DataType(dtype)
    if type(reduce_op) is not ReduceOp:
        reduce_op = ReduceOp(reduce_op)
    if not isinstance(shape, tuple) or not isinstance(splits, tuple):  # torch.Size is one
        shape = tuple(int(d) for d in shape)
        splits = tuple(int(s) for s in splits)
    if type(prescale) is not float or type(postscale) is not float:
        prescale, postscale = float(prescale), float(postscale)
    handle = Handle(None, finish)
    pending = _batch.pending
    if pending is not None:
        pending.append((_core.Op(op=op, name=name, dtype=dtype, shape=shape, input=in_ptr,
                                 output=out_ptr, reduce_op=reduce_op, prescale=prescale,
                                 postscale=postscale, root=int(root), process_set=set_id,
                                 device=int(device), splits=splits, group=group,
                                 group_size=int(group_size), owner=owner,
                                 stream=int(stream)), handle))
        return handle
    try:
        handle.work = _core.submit(op, name, dtype, shape, in_ptr, out_ptr, reduce_op,
                                   prescale, postscale, int(root), set_id, int(device), splits,
                                   group, int(group_size), owner, int(stream), _batch.wake)
    except SparkHvdError as exc:
        raise explain_failure(exc) from None
    return handle


class GroupHandle(Handle):
    """Several ops that finish together: ``synchronize`` waits for every member (so
    none is left unclaimed on an error) and returns ``finish(results)``."""

    __slots__ = ()

    def __init__(self, members: List[Handle], finish: Callable[[List[Any]], Any]) -> None:
        super().__init__(None, finish, members)


def poll(handle: Handle) -> bool:
    """True when the op is done (``synchronize`` then returns without waiting)."""
    if handle.done:
        return True
    if handle.members is not None:
        return all(poll(h) for h in handle.members)
    return handle.work.poll()


def blocking(submit_async: Callable[..., Handle], *args, **kwargs):
    """``synchronize(submit_async(*args, **kwargs))`` for a blocking call: the ops are
    queued without waking the engine thread, as this thread waits for them at once and
    runs the engine's next cycles itself where the job allows it (one thread hand-off less
    each way)."""
    _batch.wake = False
    try:
        handle = submit_async(*args, **kwargs)
    finally:
        _batch.wake = True
    return synchronize(handle)


def synchronize(handle: Handle):
    """Waits for the op and returns its output (raises the op's error)."""
    if handle.done:
        return handle.value
    if handle.members is not None:
        results, error = [], None
        for h in handle.members:
            try:
                results.append(synchronize(h))
            except Exception as exc:  # noqa: BLE001 - re-raised below
                error = error or exc
                results.append(None)
        if error is not None:
            raise error
        handle.value = handle.finish(results)
        handle.done = True
        handle.members = []
        return handle.value
    work = handle.work
    while not work.wait(_WAIT_SLICE_S):
        pass
    try:
        result = work.result()
    except SparkHvdError as exc:
        raise explain_failure(exc) from None
    handle.value = handle.finish(result)
    handle.done = True
    handle.work = None
    return handle.value


_name = op_name  # the op's name (spark_hvd._rules): given, or generated per kind and set


_reduce_op = reduce_op  # spark_hvd._rules: op= or Horovod's deprecated average=


def _array(tensor) -> np.ndarray:
    arr = np.asarray(tensor, order="C")  # keeps 0-d arrays 0-d (ascontiguousarray would not)
    numpy_code(arr.dtype)  # validates the dtype early
    return arr


def _typed(result, dtype: np.dtype) -> np.ndarray:
    raw, shape = result[0], result[1]
    return raw.view(dtype).reshape(shape)


# -- allreduce ---------------------------------------------------------------

def allreduce_async(tensor, average=None, name: Optional[str] = None, op=None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    arr = _array(tensor)
    out = np.empty_like(arr)
    rop = _reduce_op(op, average)
    return submit(OpType.ALLREDUCE, _name(name, "allreduce", process_set), numpy_code(arr.dtype),
                  arr.shape,
                  arr, out, (arr, out), lambda r: out,
                  reduce_op=rop, prescale=prescale_factor, postscale=postscale_factor,
                  process_set=process_set)


def allreduce(tensor, average=None, name: Optional[str] = None, op=None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduces `tensor` across ranks (default: Average) and returns the result."""
    return blocking(allreduce_async, tensor, average, name, op, prescale_factor,
                    postscale_factor, process_set)


def grouped_allreduce_async(tensors, average=None, name: Optional[str] = None, op=None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Allreduces a list of tensors as one group: negotiated and fused together."""
    arrays = [_array(t) for t in tensors]
    base = _name(name, "grouped_allreduce", process_set)
    rop = _reduce_op(op, average)
    handles = []
    with submit_together():
        for i, a in enumerate(arrays):
            out = np.empty_like(a)
            handles.append(submit(
                OpType.ALLREDUCE, f"{base}.{i}", numpy_code(a.dtype), a.shape, a,
                out, (a, out), (lambda r, o=out: o), reduce_op=rop,
                prescale=prescale_factor, postscale=postscale_factor, process_set=process_set,
                group=base, group_size=len(arrays)))
    return GroupHandle(handles, list)


def grouped_allreduce(tensors, average=None, name: Optional[str] = None, op=None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> List[np.ndarray]:
    return blocking(grouped_allreduce_async, tensors, average, name, op, prescale_factor,
                    postscale_factor, process_set)


# -- allgather, broadcast, alltoall, reducescatter -------------------------------

def allgather_async(tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    arr = _array(tensor)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    return submit(OpType.ALLGATHER, _name(name, "allgather", process_set), numpy_code(arr.dtype),
                  arr.shape,
                  arr, 0, (arr,), lambda r, dt=arr.dtype: _typed(r, dt),
                  process_set=process_set)


def allgather(tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Concatenates every rank's tensor along the first dimension (sizes may differ)."""
    return blocking(allgather_async, tensor, name, process_set)


def grouped_allgather_async(tensors, name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Allgathers a list of tensors as one group: negotiated together, and failing
    together (a mismatch in one member fails every member)."""
    arrays = [a.reshape(1) if a.ndim == 0 else a for a in (_array(t) for t in tensors)]
    base = _name(name, "grouped_allgather", process_set)
    with submit_together():
        handles = [submit(OpType.ALLGATHER, f"{base}.{i}", numpy_code(a.dtype), a.shape,
                          a, 0, (a,), lambda r, dt=a.dtype: _typed(r, dt),
                          process_set=process_set, group=base, group_size=len(arrays))
                   for i, a in enumerate(arrays)]
    return GroupHandle(handles, list)


def grouped_allgather(tensors, name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> List[np.ndarray]:
    return blocking(grouped_allgather_async, tensors, name, process_set)


def broadcast_async(tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    arr = _array(tensor)
    out = arr.copy()
    return submit(OpType.BROADCAST, _name(name, "broadcast", process_set), numpy_code(arr.dtype),
                  arr.shape,
                  out, out, (out,), lambda r: out, root=root_rank,
                  process_set=process_set)


def broadcast(tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Returns root_rank's tensor on every rank."""
    return blocking(broadcast_async, tensor, root_rank, name, process_set)


def alltoall_async(tensor, splits=None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Starts sending ``splits[i]`` rows to rank i (None: the first dimension split evenly;
    a numpy array of any integer dtype or a sequence of ints, as ``_rules`` says)."""
    arr = _array(tensor)
    if arr.ndim == 0:
        raise InvalidArgumentError("alltoall needs a tensor with at least one dimension")
    return submit(OpType.ALLTOALL, _name(name, "alltoall", process_set), numpy_code(arr.dtype),
                  arr.shape,
                  arr, 0, (arr,),
                  lambda r, dt=arr.dtype: (_typed(r, dt), np.asarray(r[2], dtype=np.int32)),
                  splits=alltoall_splits(splits) or (), process_set=process_set)


def alltoall(tensor, splits=None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Tuple[np.ndarray, np.ndarray]:
    """Sends splits[i] rows to rank i; returns (received rows, rows received from each rank)."""
    return blocking(alltoall_async, tensor, splits, name, process_set)


def reducescatter_async(tensor, name: Optional[str] = None, op=Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    arr = _array(tensor)
    if arr.ndim == 0:
        raise InvalidArgumentError("reducescatter needs a tensor with at least one dimension")
    return submit(OpType.REDUCESCATTER, _name(name, "reducescatter", process_set),
                  numpy_code(arr.dtype),
                  arr.shape, arr, 0, (arr,), lambda r, dt=arr.dtype: _typed(r, dt),
                  reduce_op=_reduce_op(op, None), prescale=prescale_factor,
                  postscale=postscale_factor, process_set=process_set)


def reducescatter(tensor, name: Optional[str] = None, op=Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> np.ndarray:
    """Reduces across ranks, then gives rank i the i-th block of rows (first ranks get the
    remainder rows)."""
    return blocking(reducescatter_async, tensor, name, op, process_set, prescale_factor,
                    postscale_factor)


def grouped_reducescatter_async(tensors, name: Optional[str] = None, op=Average,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """Reducescatters a list of tensors as one group: negotiated together, and
    failing together."""
    arrays = [_array(t) for t in tensors]
    if any(a.ndim == 0 for a in arrays):
        raise InvalidArgumentError("reducescatter needs tensors with at least one dimension")
    base = _name(name, "grouped_reducescatter", process_set)
    rop = _reduce_op(op, None)
    with submit_together():
        handles = [submit(OpType.REDUCESCATTER, f"{base}.{i}", numpy_code(a.dtype), a.shape,
                          a, 0, (a,), lambda r, dt=a.dtype: _typed(r, dt),
                          reduce_op=rop, prescale=prescale_factor, postscale=postscale_factor,
                          process_set=process_set, group=base, group_size=len(arrays))
                   for i, a in enumerate(arrays)]
    return GroupHandle(handles, list)


def grouped_reducescatter(tensors, name: Optional[str] = None, op=Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[np.ndarray]:
    return blocking(grouped_reducescatter_async, tensors, name, op, process_set,
                    prescale_factor, postscale_factor)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Returns once every rank of the set has called barrier."""
    synchronize(submit(OpType.BARRIER, RUNTIME.auto_name("barrier", process_set.process_set_id),
                       DataType.UINT8, (), 0, 0,
                       None, lambda r: None, process_set=process_set))


def join(device: int = -1) -> int:
    """Marks this rank as out of data: until every rank has joined, its share of
    allreduces is the neutral value (and of allgathers, zero rows). Returns the
    last rank to join."""
    return synchronize(submit(OpType.JOIN, "__join", DataType.UINT8, (), 0, 0, None,
                              lambda r: int(r[3])))


def run_control(op: int, name: str, values: Sequence[int]) -> int:
    """Runs one of the core's control ops (OpType.ADD_PROCESS_SET, ...) with its
    integer arguments; returns the op's value."""
    return synchronize(submit(op, RUNTIME.auto_name(name), DataType.UINT8, (), 0, 0, None,
                              lambda r: int(r[3]), splits=values))


# -- objects -------------------------------------------------------------------

def broadcast_object(obj: Any = None, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Pickles obj on root_rank and returns it on every rank."""
    import cloudpickle

    name = _name(name, "broadcast_object", process_set)
    is_root = rank() == root_rank  # a global rank, as in Horovod
    payload = np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8) if is_root else \
        np.zeros(0, dtype=np.uint8)
    length = broadcast(np.array([payload.size], dtype=np.int64), root_rank, name + ".len",
                       process_set)
    buf = payload if is_root else np.zeros(int(length[0]), dtype=np.uint8)
    data = broadcast(buf, root_rank, name + ".data", process_set)
    return obj if is_root else pickle.loads(data.tobytes())


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Returns the list of every rank's obj, in rank order."""
    import cloudpickle

    name = _name(name, "allgather_object", process_set)
    payload = np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8)
    sizes = allgather(np.array([payload.size], dtype=np.int64), name + ".len", process_set)
    data = allgather(payload, name + ".data", process_set)
    out, offset = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(data[offset:offset + n].tobytes()))
        offset += n
    return out
