"""spark_hvd native core (negotiation engine, Gloo/MPI backends): csrc/python/bindings.cc.

Every failing call raises the matching spark_hvd.exceptions class, with the
failure's evidence as its ``ranks`` and ``tensor`` fields.
tests/unit/test_core_stub.py checks that this stub names exactly what the module exports.
"""

import enum
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

class DataType(enum.IntEnum):
    """Element types of tensors."""

    UINT8 = 0
    INT8 = 1
    INT16 = 2
    INT32 = 3
    INT64 = 4
    FLOAT16 = 5
    BFLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BOOL = 9

class ReduceOp(enum.IntEnum):
    """Reduction operations; spark_hvd.Sum etc. are these members."""

    SUM = 0
    AVERAGE = 1
    MIN = 2
    MAX = 3
    PRODUCT = 4
    ADASUM = 5

class OpType(enum.IntEnum):
    """Kinds of op an enqueue spec asks for, the internal ones included."""

    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    REDUCESCATTER = 4
    BARRIER = 5
    JOIN = 6
    ADD_PROCESS_SET = 100
    REMOVE_PROCESS_SET = 101

class StatusCode(enum.IntEnum):
    """Failure kinds; spark_hvd.exceptions has one class per code."""

    OK = 0
    UNKNOWN = 1
    INVALID_ARGUMENT = 2
    MISMATCH = 3
    NOT_INITIALIZED = 4
    TIMEOUT = 5
    PEER_LOST = 6
    STORE_ERROR = 7
    AUTHENTICATION = 8
    INTERNAL = 9

class _Store(Protocol):
    """What init(store=) needs (spark_hvd._job.client.RendezvousClient has it)."""

    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str, timeout_s: float) -> bytes: ...
    def wait(self, keys: List[str], timeout_s: float) -> None: ...

class Op:
    """One op to enqueue, with keyword fields only: input/output are addresses (or
    C-contiguous numpy arrays standing for their data pointers), owner the
    object that keeps them valid (the core holds it until the op is done with it),
    stream the CUDA stream that produced a device input (0: the default stream). A
    device op (device >= 0) records its ready event on that stream here, at submit;
    the calling thread's current CUDA device must be ``device``."""

    def __init__(self, *, op: OpType, name: str, dtype: DataType, shape: Sequence[int],
                 input: Union[int, npt.NDArray[Any]] = 0,
                 output: Union[int, npt.NDArray[Any]] = 0, reduce_op: ReduceOp = ReduceOp.SUM,
                 prescale: float = 1.0, postscale: float = 1.0, root: int = 0,
                 process_set: int = 0, device: int = -1, splits: Sequence[int] = (),
                 group: str = "", group_size: int = 0, owner: Any = None,
                 stream: int = 0) -> None: ...
    @property
    def name(self) -> str: ...

class Work:
    """An enqueued op. Dropping it never frees what the op still uses; a result
    nobody claims is freed with the op."""

    def poll(self) -> bool:
        """True when the op is done (never blocks)."""
    def wait(self, timeout_s: float = -1.0) -> bool:
        """Waits up to timeout_s (< 0: forever), without the GIL; False on timeout."""
    def result(self) -> Tuple[npt.NDArray[np.uint8], List[int], List[int], int]:
        """The completed op's (output bytes sharing the core's buffer, output shape,
        received splits, value); raises the op's error, or InvalidArgumentError while
        it is not done."""

def gloo_built() -> bool: ...
def mpi_built() -> bool: ...
def nccl_built() -> bool:
    """Whether the NCCL backend is compiled in and libnccl and the CUDA runtime load."""
def cuda_built() -> bool:
    """Whether the CUDA runtime loads and sees a GPU."""
def nccl_unavailable_reason() -> str:
    """Why nccl_built() is False: what was tried and failed ("" when it is True)."""
def set_library_dirs(dirs: List[str]) -> None:
    """Directories searched first for libcudart and libnccl (before the first load)."""
def settings() -> List[Dict[str, Union[str, int, float]]]:
    """Every SPARK_HVD_* setting as the core compiled it (spark_hvd/settings.def): dicts
    of name, type, default, unit, meaning, alias (Horovod's variable, or "")."""
def setting_value(name: str) -> Union[str, int, float]:
    """The value the core uses for setting ``name`` (SPARK_HVD_...): read from the
    environment, or its Horovod alias, at first use and cached. InvalidArgumentError
    for a name that is no setting."""
def init(rank: int, size: int, controller: str = "gloo", store: Optional[_Store] = None,
         store_prefix: str = "spark_hvd", bind_host: str = "127.0.0.1",
         connect_timeout_s: float = 60.0, timeline_path: str = "", host: str = "") -> None:
    """Starts the engine (a no-op while it runs); blocks until every rank connected.
    ``host``: this rank's host identity ("" = the host name); ranks of one host share
    memory (backend shm)."""
def shutdown() -> None:
    """Stops the engine; pending ops fail."""
def is_initialized() -> bool: ...
def rank() -> int: ...
def size() -> int: ...
def controller() -> str:
    """"gloo" or "mpi"."""
def enqueue(ops: List[Op], wake: bool = True) -> List[Work]:
    """Queues the ops together or none of them (a group is never half submitted); each
    Op is submitted once. ``wake=False``: the caller waits for them at once, and its wait
    runs the engine's cycle where the job allows it, so the engine thread is not woken."""
def submit(op: OpType, name: str, dtype: DataType, shape: Sequence[int],
           input: Union[int, npt.NDArray[Any]], output: Union[int, npt.NDArray[Any]],
           reduce_op: ReduceOp, prescale: float, postscale: float, root: int,
           process_set: int, device: int, splits: Sequence[int], group: str, group_size: int,
           owner: Any, stream: int, wake: bool = True) -> Work:
    """One op alone, its fields positional in Op's order: ``enqueue([Op(...)])[0]``
    without the keyword parsing and the lists (the per-call path of a small op); ``wake``
    as enqueue's."""
def tuned_parameters() -> Dict[str, Any]:
    """The fusion threshold (bytes) and cycle time (ms) the engine uses now, as
    ``fusion_threshold``, ``cycle_time_ms``; ``autotune``: rank 0 runs
    SPARK_HVD_AUTOTUNE; ``searching``: it is still searching; ``history``: every change
    as (cycle, fusion_threshold, cycle_time_ms), the same on every rank.
    NotInitializedError before init()."""
def cache_stats() -> Dict[str, int]:
    """This rank's requests since init that the response cache answered (``hits``: sent
    as one bit) or not (``misses``: cacheable ops sent in full)."""
def op_allocations() -> int:
    """Heap allocations of op states and queue entries since the process started: flat
    over the steps of a job in steady state (the engine reuses them)."""
def engine_allocations() -> int:
    """Heap allocations (operator new) made by the engine's thread, and by the engine
    cycles API threads run (Drive), since the process started: flat over the steps of a
    job in steady state (common/alloc_count.h)."""
def driven_cycles() -> int:
    """Engine cycles run on API threads waiting for their op (instead of the engine's
    thread) since the process started."""
def cycles() -> int:
    """Negotiation cycles this process has run since it started (any thread)."""
def traffic() -> Dict[str, Dict[str, Any]]:
    """What this process has sent since it started: per sender (tcp, shm, gloo, mpi,
    heartbeat) and kind (control, data, liveness), messages and bytes; and connections
    (opened, accepted, failed, dropped)."""
def process_set_ranks(id: int) -> List[int]: ...
def process_set_ids() -> List[int]: ...
def start_timeline(path: str) -> None: ...
def stop_timeline() -> None: ...
