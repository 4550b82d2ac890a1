"""Process-level state of spark_hvd: init/shutdown, rank and size, process sets.

All of it lives in one :class:`_Runtime` object (``_RUNTIME``) with explicit
init/shutdown, wrapping the native engine in ``spark_hvd._core``.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import List, Optional, Sequence

from spark_hvd import _config, _core
from spark_hvd._types import OpType
from spark_hvd.exceptions import (InvalidArgumentError, NotInitializedError, PeerLostError,
                                  SparkHvdError)

logger = logging.getLogger(__name__)


class ProcessSet:
    """A subset of ranks with its own collectives (Horovod's ``hvd.ProcessSet``).

    Create it on every rank with the same ranks, in the same order relative to
    other process-set calls, either through ``init(process_sets=[...])`` or
    ``add_process_set``. Ops take it as ``process_set=``.
    """

    def __init__(self, ranks: Sequence[int]) -> None:
        ranks = sorted(int(r) for r in ranks)
        if len(set(ranks)) != len(ranks) or not ranks:
            raise InvalidArgumentError(f"a process set needs distinct ranks, got {list(ranks)}")
        self.ranks: List[int] = ranks
        self.process_set_id: Optional[int] = None

    def _require(self) -> int:
        if self.process_set_id is None:
            raise InvalidArgumentError(
                f"process set {self.ranks} is not registered: pass it to init(process_sets=...) or "
                "add_process_set() on every rank first")
        return self.process_set_id

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set, or -1 if it is not a member."""
        me = rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> bool:
        return rank() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    def __init__(self) -> None:
        self.ranks = []
        self.process_set_id = 0

    def _require(self) -> int:
        return 0

    def size(self) -> int:
        return size()

    def rank(self) -> int:
        return rank()

    def included(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "global_process_set"


global_process_set = _GlobalProcessSet()


class _Runtime:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.client = None
        self.store_prefix = ""
        self.topology = None
        self.init_count = 0
        self.atexit_registered = False
        self.name_counters: dict = {}

    # -- names -------------------------------------------------------------
    def auto_name(self, op: str, process_set_id: Optional[int] = 0) -> str:
        """Deterministic name for an unnamed op: identical across the ranks of a
        process set that issue their unnamed ops of each kind in the same order."""
        key = (op, process_set_id)
        with self.lock:
            n = self.name_counters.get(key, 0)
            self.name_counters[key] = n + 1
        return f"{op}.noname.{n}" if not process_set_id else f"{op}.noname.ps{process_set_id}.{n}"

    # -- lost ranks --------------------------------------------------------
    def exited_key(self, rank_: int) -> str:
        return f"{self.store_prefix}/__exited__/{rank_}"

    def exited_ranks(self) -> List[int]:
        """Ranks that shut down cleanly (they leave a mark in the store first)."""
        if self.client is None:
            return []
        try:
            keys = self.client.keys(self.exited_key(0)[:-1])
        except Exception:  # the service may be gone with the driver
            return []
        return sorted(int(k.rsplit("/", 1)[1]) for k in keys)

    def lost_ranks(self, wait_s: float) -> List[int]:
        """Ranks the rendezvous service saw disappear; waits up to wait_s for news."""
        if self.client is None:
            return []
        deadline = time.monotonic() + wait_s
        while True:
            try:
                lost = self.client.lost_ranks()
            except Exception:  # the service may be gone with the driver
                return []
            if lost or time.monotonic() >= deadline:
                return lost
            time.sleep(0.05)  # polling a remote fact on an error path; bounded by wait_s


_RUNTIME = _Runtime()


def _env_int(name: str, default: Optional[int]) -> Optional[int]:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise InvalidArgumentError(f"{name}={value!r} is not an integer") from None


def init(process_sets: Optional[Sequence[ProcessSet]] = None, comm=None) -> None:
    """Starts spark_hvd in this process (a no-op when already initialized).

    Rank, size and the rendezvous address come from the environment that
    ``spark-hvdrun`` or ``spark_hvd.spark.run`` set (``SPARK_HVD_*``); without
    them this is a single-process job (rank 0 of 1). Under ``mpirun`` with an
    MPI-enabled build, MPI is used (``SPARK_HVD_CONTROLLER`` overrides).
    """
    from spark_hvd.runner import env as renv

    if comm is not None:
        raise InvalidArgumentError("init(comm=...) (an mpi4py communicator) is not supported; "
                                   "launch with spark-hvdrun --mpi instead")
    with _RUNTIME.lock:
        if _core.is_initialized():
            return
        controller = _config.controller()
        if not controller:
            under_mpirun = "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ
            controller = "mpi" if (under_mpirun and _core.mpi_built()
                                   and renv.RENDEZVOUS_ADDR_ENV_VAR not in os.environ) else "gloo"
        rank_ = _env_int(renv.RANK_ENV_VAR, 0)
        size_ = _env_int(renv.SIZE_ENV_VAR, 1)
        if size_ < 1 or not 0 <= rank_ < size_:
            raise InvalidArgumentError(f"{renv.RANK_ENV_VAR}={rank_} and {renv.SIZE_ENV_VAR}={size_} are inconsistent")
        client = renv.client_from_env() if controller == "gloo" else None
        if controller == "gloo" and size_ > 1 and client is None:
            raise InvalidArgumentError(
                f"{renv.SIZE_ENV_VAR}={size_} but no rendezvous service is configured "
                f"({renv.RENDEZVOUS_ADDR_ENV_VAR}/{renv.RENDEZVOUS_PORT_ENV_VAR} unset): launch the job with "
                "spark-hvdrun or spark_hvd.spark.run")
        bind_host = client.local_address() if client is not None else "127.0.0.1"
        run_id = os.environ.get(renv.RUN_ID_ENV_VAR, "local")
        _RUNTIME.init_count += 1
        _RUNTIME.name_counters = {}
        _RUNTIME.store_prefix = f"{run_id}/init{_RUNTIME.init_count}"
        _RUNTIME.client = client
        try:
            if client is not None:
                # Before connecting: if this process dies during init, the rendezvous
                # service reports it lost, and the peers waiting for it stop waiting.
                client.register_rank(rank_)
            _core.init(rank=rank_, size=size_, controller=controller, store=client,
                       store_prefix=_RUNTIME.store_prefix, bind_host=bind_host,
                       connect_timeout_s=_config.start_timeout_s(),
                       timeline_path=timeline_path(_config.timeline(), rank_, size_))
        except BaseException as exc:
            failure = explain_failure(exc) if isinstance(exc, PeerLostError) else exc
            _RUNTIME.client = None
            if client is not None:
                client.close()
            if failure is exc:
                raise
            raise failure from None
        if not _RUNTIME.atexit_registered:
            atexit.register(shutdown)
            _RUNTIME.atexit_registered = True
        _RUNTIME.topology = _discover_topology()
    for ps in process_sets or []:
        add_process_set(ps)


def _discover_topology():
    from spark_hvd.runner import env as renv
    from spark_hvd.runner.topology import Topology, assign

    values = [_env_int(v, None) for v in (renv.LOCAL_RANK_ENV_VAR, renv.LOCAL_SIZE_ENV_VAR, renv.CROSS_RANK_ENV_VAR,
                                          renv.CROSS_SIZE_ENV_VAR)]
    if all(v is not None for v in values) and _core.controller() == "gloo":
        return Topology(_core.rank(), _core.size(), *values)
    from spark_hvd._ops import allgather_object

    hosts = allgather_object(renv.hostname(), name="__spark_hvd.hosts")
    return assign(hosts)[_core.rank()]


def shutdown() -> None:
    """Stops spark_hvd in this process; pending ops fail, peers are told."""
    with _RUNTIME.lock:
        if _RUNTIME.client is not None and _core.is_initialized():
            try:  # lets peers that see our connections close tell "exited" from "crashed"
                _RUNTIME.client.set(_RUNTIME.exited_key(_core.rank()), b"1")
            except Exception:
                pass
        _core.shutdown()
        if _RUNTIME.client is not None:
            try:
                _RUNTIME.client.close()
            except Exception:  # best effort: the driver may already be gone
                pass
            _RUNTIME.client = None
        _RUNTIME.topology = None


def is_initialized() -> bool:
    return _core.is_initialized()


def _topology():
    # Still answers after a peer failure stopped the engine; only shutdown() clears it.
    if _RUNTIME.topology is None:
        raise NotInitializedError("spark_hvd is not initialized: call spark_hvd.init() first")
    return _RUNTIME.topology


def rank() -> int:
    return _topology().rank


def size() -> int:
    return _topology().size


def local_rank() -> int:
    return _topology().local_rank


def local_size() -> int:
    return _topology().local_size


def cross_rank() -> int:
    return _topology().cross_rank


def cross_size() -> int:
    return _topology().cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    t = _topology()
    return t.local_size * t.cross_size == t.size


def gloo_built() -> bool:
    return _core.gloo_built()


def mpi_built() -> bool:
    return _core.mpi_built()


def nccl_built() -> bool:
    return _core.nccl_built()


def gloo_enabled() -> bool:
    return _core.is_initialized() and _core.controller() == "gloo"


def mpi_enabled() -> bool:
    return _core.is_initialized() and _core.controller() == "mpi"


def timeline_path(path: str, rank_: int, size_: int) -> str:
    """Where SPARK_HVD_TIMELINE=path puts each rank's timeline: rank 0 writes `path`
    itself, rank r > 0 `<stem>.rank<r>.<suffix>` beside it, so ranks sharing a host
    never write one file."""
    if not path or size_ == 1 or rank_ == 0:
        return path
    stem, dot, suffix = path.rpartition(".")
    if not dot or "/" in suffix:
        return f"{path}.rank{rank_}"
    return f"{stem}.rank{rank_}.{suffix}"


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts writing this rank's Chrome-trace timeline of every tensor's phases to
    file_path (give each rank its own path; SPARK_HVD_TIMELINE does that for you)."""
    _topology()
    _core.start_timeline(file_path)


def stop_timeline() -> None:
    _core.stop_timeline()


def explain_failure(exc: SparkHvdError) -> SparkHvdError:
    """Adds what the rendezvous service knows to a PeerLostError: which peers had
    already shut down cleanly, or else which ones vanished."""
    if not isinstance(exc, PeerLostError) or exc.ranks:
        return exc
    from spark_hvd.exceptions import format_ranks

    me = _core.rank() if _core.is_initialized() else -1
    exited = [r for r in _RUNTIME.exited_ranks() if r != me]
    if exited and "shut down (called shutdown() or exited)" in exc.message:
        return PeerLostError(exc.message, ranks=exited)  # the core already said so
    if exited:
        return PeerLostError(f"{exc.message} -- {format_ranks(exited)} had already shut down "
                             "(called shutdown() or exited); every rank must run the same "
                             "collectives", ranks=exited)
    lost = _RUNTIME.lost_ranks(_config.lost_rank_wait_s())
    if lost and "the rendezvous service lost" in exc.message:
        return PeerLostError(exc.message, ranks=lost)  # the core already said so
    if lost:
        return PeerLostError(f"{exc.message} -- lost {format_ranks(lost)} (the process "
                             "exited or its host is unreachable)", ranks=lost)
    return exc


def add_process_set(process_set) -> ProcessSet:
    """Registers a process set; every rank must call it with the same ranks."""
    from spark_hvd._ops import _run_control

    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise InvalidArgumentError(f"{ps} is already registered")
    n = size()
    bad = [r for r in ps.ranks if not 0 <= r < n]
    if bad:
        raise InvalidArgumentError(f"process set ranks {bad} are outside 0..{n - 1}")
    ps.process_set_id = _run_control(OpType.ADD_PROCESS_SET, "process_set.add", ps.ranks)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a process set (every rank must call it); False if it was not registered."""
    from spark_hvd._ops import _run_control

    if process_set.process_set_id in (None, 0):
        return False
    _run_control(OpType.REMOVE_PROCESS_SET, "process_set.remove", [process_set.process_set_id])
    process_set.process_set_id = None
    return True
