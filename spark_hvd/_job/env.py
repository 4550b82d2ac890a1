"""The environment a rank is started with, and how a rank reads it back.

The launch contract: the variables every launcher sets for a rank (its place in the
job, how to reach the rendezvous server), each a ``FOO_ENV_VAR`` constant here and
listed in LAUNCH_ENV_VARS; no other module spells the names out. They are not
settings: the settings a launcher also passes on (SPARK_HVD_CONTROLLER,
SPARK_HVD_START_TIMEOUT_S, SPARK_HVD_ELASTIC_TIMEOUT_S) are declared with every other one in
spark_hvd/settings.def
(spark_hvd/_config.py).
"""

from __future__ import annotations

import os
import socket
from typing import Dict, Mapping, Optional, Tuple

from spark_hvd import _config
from spark_hvd._job.client import RendezvousClient
from spark_hvd._job.topology import Topology
from spark_hvd.exceptions import InvalidArgumentError

RANK_ENV_VAR = "SPARK_HVD_RANK"
SIZE_ENV_VAR = "SPARK_HVD_SIZE"
LOCAL_RANK_ENV_VAR = "SPARK_HVD_LOCAL_RANK"
LOCAL_SIZE_ENV_VAR = "SPARK_HVD_LOCAL_SIZE"
CROSS_RANK_ENV_VAR = "SPARK_HVD_CROSS_RANK"
CROSS_SIZE_ENV_VAR = "SPARK_HVD_CROSS_SIZE"
RENDEZVOUS_ADDR_ENV_VAR = "SPARK_HVD_RENDEZVOUS_ADDR"
RENDEZVOUS_PORT_ENV_VAR = "SPARK_HVD_RENDEZVOUS_PORT"
SECRET_ENV_VAR = "SPARK_HVD_SECRET"            # hex of the job's HMAC secret
RUN_ID_ENV_VAR = "SPARK_HVD_RUN_ID"
HOSTNAME_ENV_VAR = "SPARK_HVD_HOSTNAME"        # optional override of the host identity
# An elastic job's workers get these instead of a rank and size: the coordinator assigns
# those at each init() (spark_hvd/_job/elastic.py).
ELASTIC_ENV_VAR = "SPARK_HVD_ELASTIC"          # "1" in an elastic job
ELASTIC_WORKER_ENV_VAR = "SPARK_HVD_ELASTIC_WORKER"  # the worker id; unset: one is allocated
# How long a worker waits for a place: the launcher's elastic timeout (a setting there).
ELASTIC_TIMEOUT_S_ENV_VAR = _config.ELASTIC_TIMEOUT_S_ENV_VAR
DEFAULT_ELASTIC_TIMEOUT_S = _config.DEFAULT_ELASTIC_TIMEOUT_S
LAUNCH_ENV_VARS = (RANK_ENV_VAR, SIZE_ENV_VAR, LOCAL_RANK_ENV_VAR, LOCAL_SIZE_ENV_VAR,
                   CROSS_RANK_ENV_VAR, CROSS_SIZE_ENV_VAR, RENDEZVOUS_ADDR_ENV_VAR,
                   RENDEZVOUS_PORT_ENV_VAR, SECRET_ENV_VAR, RUN_ID_ENV_VAR, HOSTNAME_ENV_VAR,
                   ELASTIC_ENV_VAR, ELASTIC_WORKER_ENV_VAR)

# Values of SPARK_HVD_CONTROLLER.
CONTROLLER_GLOO = "gloo"
CONTROLLER_MPI = "mpi"


def secret_to_env(secret: bytes) -> str:
    """The value of SPARK_HVD_SECRET for ``secret``."""
    return bytes(secret).hex()


def secret_from_env(value: str) -> bytes:
    """The secret from the value of SPARK_HVD_SECRET."""
    try:
        secret = bytes.fromhex(value.strip())
    except ValueError:
        raise InvalidArgumentError(f"{SECRET_ENV_VAR} is not a hex string") from None
    if not secret:
        raise InvalidArgumentError(f"{SECRET_ENV_VAR} is empty")
    return secret


def hostname(environ: Optional[Mapping[str, str]] = None) -> str:
    """This host's identity: SPARK_HVD_HOSTNAME if set, else the host name."""
    environ = os.environ if environ is None else environ
    return environ.get(HOSTNAME_ENV_VAR) or socket.gethostname()


def rank_env(topology: Topology, addr: str, port: int, secret: bytes, run_id: str,
             controller: str, start_timeout_s: float) -> Dict[str, str]:
    """The SPARK_HVD_* variables a rank is started with: the launch contract, and the
    controller and start timeout settings."""
    if controller not in (CONTROLLER_GLOO, CONTROLLER_MPI):
        raise InvalidArgumentError(f"controller must be 'gloo' or 'mpi', got {controller!r}")
    return {
        RANK_ENV_VAR: str(topology.rank),
        SIZE_ENV_VAR: str(topology.size),
        LOCAL_RANK_ENV_VAR: str(topology.local_rank),
        LOCAL_SIZE_ENV_VAR: str(topology.local_size),
        CROSS_RANK_ENV_VAR: str(topology.cross_rank),
        CROSS_SIZE_ENV_VAR: str(topology.cross_size),
        **rendezvous_env(addr, port, secret, run_id),
        _config.CONTROLLER_ENV_VAR: controller,
        _config.START_TIMEOUT_S_ENV_VAR: f"{start_timeout_s:g}",
    }


def rendezvous_env(addr: str, port: int, secret: bytes, run_id: str) -> Dict[str, str]:
    """The variables that let a process reach the job's rendezvous server."""
    return {
        RENDEZVOUS_ADDR_ENV_VAR: addr,
        RENDEZVOUS_PORT_ENV_VAR: str(port),
        SECRET_ENV_VAR: secret_to_env(secret),
        RUN_ID_ENV_VAR: run_id,
    }


def _read_int(name: str, environ: Mapping[str, str]) -> Optional[int]:
    value = environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise InvalidArgumentError(f"{name}={value!r} is not an integer") from None


def rank_and_size(environ: Optional[Mapping[str, str]] = None) -> Tuple[int, int]:
    """This rank's (rank, size) as the launcher set them; (0, 1), a single-process
    job, when it did not. InvalidArgumentError naming the variables when they are
    malformed or inconsistent."""
    environ = os.environ if environ is None else environ
    rank = _read_int(RANK_ENV_VAR, environ)
    size = _read_int(SIZE_ENV_VAR, environ)
    rank = 0 if rank is None else rank
    size = 1 if size is None else size
    if size < 1 or not 0 <= rank < size:
        raise InvalidArgumentError(
            f"{RANK_ENV_VAR}={rank} and {SIZE_ENV_VAR}={size} are inconsistent")
    return rank, size


def elastic_from_env(environ: Optional[Mapping[str, str]] = None
                     ) -> Optional[Tuple[Optional[int], float]]:
    """``(worker id or None, elastic timeout)`` when this process is a worker of an elastic
    job, else None."""
    environ = os.environ if environ is None else environ
    if environ.get(ELASTIC_ENV_VAR, "") in ("", "0"):
        return None
    worker = _read_int(ELASTIC_WORKER_ENV_VAR, environ)
    if worker is not None and worker < 0:
        raise InvalidArgumentError(f"{ELASTIC_WORKER_ENV_VAR}={worker} must be >= 0")
    value = environ.get(ELASTIC_TIMEOUT_S_ENV_VAR) or str(DEFAULT_ELASTIC_TIMEOUT_S)
    try:
        timeout_s = float(value)
    except ValueError:
        raise InvalidArgumentError(f"{ELASTIC_TIMEOUT_S_ENV_VAR}={value!r} is not a number") \
            from None
    return worker, timeout_s


def elastic_env(addr: str, port: int, secret: bytes, run_id: str, worker: Optional[int],
                elastic_timeout_s: float, start_timeout_s: float) -> Dict[str, str]:
    """The variables an elastic job's worker is started with (no rank or size: each
    init() gets those from the coordinator)."""
    env = {
        **rendezvous_env(addr, port, secret, run_id),
        ELASTIC_ENV_VAR: "1",
        ELASTIC_TIMEOUT_S_ENV_VAR: f"{elastic_timeout_s:g}",
        _config.CONTROLLER_ENV_VAR: CONTROLLER_GLOO,
        _config.START_TIMEOUT_S_ENV_VAR: f"{start_timeout_s:g}",
    }
    if worker is not None:
        env[ELASTIC_WORKER_ENV_VAR] = str(worker)
    return env


def topology_from_env(rank: int, size: int,
                      environ: Optional[Mapping[str, str]] = None) -> Optional[Topology]:
    """This rank's topology as the launcher set it, or None when it did not set all of
    it (the rank then works it out with its peers)."""
    environ = os.environ if environ is None else environ
    values = [_read_int(name, environ) for name in (LOCAL_RANK_ENV_VAR, LOCAL_SIZE_ENV_VAR,
                                                    CROSS_RANK_ENV_VAR, CROSS_SIZE_ENV_VAR)]
    if any(v is None for v in values):
        return None
    return Topology(rank, size, *values)


def client_from_env(environ: Optional[Mapping[str, str]] = None) -> Optional[RendezvousClient]:
    """A RendezvousClient for the server named in the environment, or None.

    None when SPARK_HVD_RENDEZVOUS_ADDR is unset; InvalidArgumentError naming the
    variable when it is set but another one is missing or malformed.
    ``environ`` defaults to ``os.environ``.
    """
    environ = os.environ if environ is None else environ
    addr = environ.get(RENDEZVOUS_ADDR_ENV_VAR)
    if not addr:
        return None
    for name in (RENDEZVOUS_PORT_ENV_VAR, SECRET_ENV_VAR, RUN_ID_ENV_VAR):
        if not environ.get(name):
            raise InvalidArgumentError(
                f"{RENDEZVOUS_ADDR_ENV_VAR} is set but {name} is not; the launcher sets both")
    try:
        port = int(environ[RENDEZVOUS_PORT_ENV_VAR])
    except ValueError:
        raise InvalidArgumentError(
            f"{RENDEZVOUS_PORT_ENV_VAR}={environ[RENDEZVOUS_PORT_ENV_VAR]!r} is not a port") \
            from None
    return RendezvousClient(addr, port, secret_from_env(environ[SECRET_ENV_VAR]),
                            environ[RUN_ID_ENV_VAR],
                            connect_timeout_s=_config.start_timeout_s(environ))
