"""Starting and stopping spark_hvd, and the process-level queries of Horovod's API.

init/shutdown and process-set registration wrap the native engine
(``spark_hvd._core``) and run collectives of their own (the hosts exchange behind
local_rank, the control ops behind add_process_set), so this module sits above the
collectives (``spark_hvd._ops``); the state they share lives below both, in
``spark_hvd._runtime``, and is re-exported here.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
from typing import Optional, Sequence

from spark_hvd import _config, _core
from spark_hvd._job import elastic
from spark_hvd._job import env as job_env
from spark_hvd._job.topology import Topology, assign
from spark_hvd._ops import allgather_object, run_control
from spark_hvd._runtime import (RUNTIME, ProcessSet, cross_rank, cross_size,  # noqa: F401
                                explain_failure, global_process_set, is_homogeneous,
                                local_rank, local_size, rank, require_initialized, size)
from spark_hvd._types import OpType
from spark_hvd.exceptions import InvalidArgumentError, PeerLostError

logger = logging.getLogger(__name__)

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "gloo_built", "mpi_built", "nccl_built",
    "cuda_built",
    "mpi_threads_supported", "rocm_built", "ddl_built", "ccl_built",
    "gloo_enabled", "mpi_enabled", "start_timeline", "stop_timeline", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set",
]


def init(process_sets: Optional[Sequence[ProcessSet]] = None, comm=None) -> None:
    """Starts spark_hvd in this process (a no-op when already initialized).

    Rank, size and the rendezvous address come from the environment that
    ``spark-hvdrun`` or ``spark_hvd.spark.run`` set (``SPARK_HVD_*``); without
    them this is a single-process job (rank 0 of 1). Under ``mpirun`` with an
    MPI-enabled build, MPI is used (``SPARK_HVD_CONTROLLER`` overrides).
    """
    if comm is not None:
        raise InvalidArgumentError("init(comm=...) (an mpi4py communicator) is not supported; "
                                   "launch with spark-hvdrun --mpi instead")
    with RUNTIME.lock:
        if _core.is_initialized():
            return
        controller = _config.controller()
        if not controller:
            under_mpirun = "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ
            controller = "mpi" if (under_mpirun and _core.mpi_built()
                                   and job_env.RENDEZVOUS_ADDR_ENV_VAR not in os.environ) \
                else "gloo"
        elastic_job = job_env.elastic_from_env()
        if elastic_job is not None and controller != "gloo":
            raise InvalidArgumentError(f"an elastic job needs the gloo controller, not "
                                       f"SPARK_HVD_CONTROLLER={controller}")
        rank_, size_ = job_env.rank_and_size() if elastic_job is None else (0, 1)
        client = job_env.client_from_env() if controller == "gloo" else None
        if controller == "gloo" and (size_ > 1 or elastic_job) and client is None:
            raise InvalidArgumentError(
                f"{job_env.SIZE_ENV_VAR}={size_} but no rendezvous service is configured "
                f"({job_env.RENDEZVOUS_ADDR_ENV_VAR}/{job_env.RENDEZVOUS_PORT_ENV_VAR} unset): "
                "launch the job with spark-hvdrun or spark_hvd.spark.run")
        run_id = os.environ.get(job_env.RUN_ID_ENV_VAR, "local")
        RUNTIME.init_count += 1
        RUNTIME.name_counters = {}
        RUNTIME.store_prefix = f"{run_id}/init{RUNTIME.init_count}"
        RUNTIME.client = client
        group, topology = "", None
        try:
            if elastic_job is not None:
                epoch = _join_elastic(client, *elastic_job)
                topology = epoch.topology_of(RUNTIME.elastic_worker)
                rank_, size_ = topology.rank, topology.size
                group = elastic.epoch_group(epoch.number)
                RUNTIME.store_prefix = f"{run_id}/{group}"
            bind_host = client.local_address() if client is not None else "127.0.0.1"
            if client is not None:
                # Before connecting: if this process dies during init, the rendezvous
                # service reports it lost, and the peers waiting for it stop waiting.
                client.register_rank(rank_, group=group)
            _library_dirs()
            _core.init(rank=rank_, size=size_, controller=controller, store=client,
                       store_prefix=RUNTIME.store_prefix, bind_host=bind_host,
                       connect_timeout_s=_config.start_timeout_s(),
                       timeline_path=timeline_path(_config.timeline(), rank_, size_),
                       host=job_env.hostname())
        except BaseException as exc:
            failure = explain_failure(exc) if isinstance(exc, PeerLostError) else exc
            RUNTIME.client = None
            if client is not None:
                client.close()
            if failure is exc:
                raise
            raise failure from None
        if not RUNTIME.atexit_registered:
            atexit.register(shutdown)
            RUNTIME.atexit_registered = True
        RUNTIME.topology = topology or _discover_topology()
    for ps in process_sets or []:
        add_process_set(ps)


def _join_elastic(client, worker: Optional[int], timeout_s: float) -> "elastic.Epoch":
    """This elastic worker's next epoch. The first call registers the worker for the
    life of the process (the coordinator reads from that registration whether it is
    alive) on a client of its own, which shutdown() leaves open."""
    if RUNTIME.worker_client is None:
        worker_client = job_env.client_from_env()
        if worker is None:
            worker = worker_client.add(elastic.NEXT_WORKER, 1)
        worker_client.register_rank(worker, host=job_env.hostname(),
                                    group=elastic.WORKER_GROUP)
        RUNTIME.worker_client, RUNTIME.elastic_worker = worker_client, worker
        atexit.register(worker_client.close)  # a goodbye: this worker left, it did not crash
    RUNTIME.elastic_requests += 1
    lost, RUNTIME.lost_workers = RUNTIME.lost_workers, []
    epoch = elastic.join(client, RUNTIME.elastic_worker, RUNTIME.elastic_requests,
                         job_env.hostname(), timeout_s + _config.start_timeout_s(), lost=lost)
    RUNTIME.epoch = epoch
    return epoch


def _discover_topology() -> Topology:
    """The launcher's topology when it set one (Gloo); else the ranks exchange host names."""
    if _core.controller() == "gloo":
        topology = job_env.topology_from_env(_core.rank(), _core.size())
        if topology is not None:
            return topology
    hosts = allgather_object(job_env.hostname(), name="__spark_hvd.hosts")
    return assign(hosts)[_core.rank()]


def shutdown() -> None:
    """Stops spark_hvd in this process; pending ops fail, peers are told."""
    with RUNTIME.lock:
        if RUNTIME.client is not None and _core.is_initialized():
            try:  # lets peers that see our connections close tell "exited" from "crashed"
                RUNTIME.client.set(RUNTIME.exited_key(_core.rank()), b"1")
            except Exception:
                pass
        _core.shutdown()
        if RUNTIME.client is not None:
            try:
                RUNTIME.client.close()
            except Exception:  # best effort: the driver may already be gone
                pass
            RUNTIME.client = None
        RUNTIME.topology = None


def is_initialized() -> bool:
    return _core.is_initialized()


def gloo_built() -> bool:
    return _core.gloo_built()


def mpi_built() -> bool:
    return _core.mpi_built()


@functools.lru_cache(maxsize=None)
def _library_dirs() -> None:
    """Points the core at the CUDA runtime and NCCL of the nvidia-* wheels that GPU
    builds of PyTorch install, when they are there (once: the core loads the libraries
    once)."""
    import importlib.util
    import os

    dirs = []
    for package in ("nvidia.nccl", "nvidia.cuda_runtime", "nvidia.cu13", "nvidia.cu12"):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        for base in (spec.submodule_search_locations or []) if spec else []:
            lib = os.path.join(base, "lib")
            if os.path.isdir(lib):
                dirs.append(lib)
    _core.set_library_dirs(dirs)


def nccl_built() -> bool:
    """True when GPU tensors can use NCCL here: the NCCL backend is compiled in and
    libnccl and the CUDA runtime load (SPARK_HVD_NCCL_LIBRARY / SPARK_HVD_CUDA_LIBRARY
    name them; else those of the nvidia-* wheels, then the system's)."""
    _library_dirs()
    return _core.nccl_built()


def cuda_built() -> bool:
    """True when the CUDA runtime loads here and sees a GPU."""
    _library_dirs()
    return _core.cuda_built()


def mpi_threads_supported() -> bool:
    """Horovod's query; here ops may be called from any thread."""
    return True


def rocm_built() -> bool:
    """Horovod's query: no ROCm backend here."""
    return False


def ddl_built() -> bool:
    """Horovod's query: no IBM DDL backend here."""
    return False


def ccl_built() -> bool:
    """Horovod's query: no oneCCL backend here."""
    return False


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
    require_initialized()
    _core.start_timeline(file_path)


def stop_timeline() -> None:
    _core.stop_timeline()


def add_process_set(process_set) -> ProcessSet:
    """Registers a process set; every rank must call it with the same ranks."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise InvalidArgumentError(f"{ps} is already registered")
    n = size()
    bad = [r for r in ps.ranks if not 0 <= r < n]
    if bad:
        raise InvalidArgumentError(f"process set ranks {bad} are outside 0..{n - 1}")
    ps.process_set_id = run_control(OpType.ADD_PROCESS_SET, "process_set.add", ps.ranks)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a process set (every rank must call it); False if it was not registered."""
    if process_set.process_set_id in (None, 0):
        return False
    run_control(OpType.REMOVE_PROCESS_SET, "process_set.remove", [process_set.process_set_id])
    process_set.process_set_id = None
    return True
