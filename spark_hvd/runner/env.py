"""The environment a rank is started with, and how a rank reads it back.

Every variable is a ``FOO_ENV_VAR`` constant here; no other module spells the
names out.
"""

from __future__ import annotations

import os
import socket
from typing import Dict, Mapping, Optional

from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.runner.topology import Topology

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
CONTROLLER_ENV_VAR = "SPARK_HVD_CONTROLLER"    # "gloo" or "mpi"
START_TIMEOUT_ENV_VAR = "SPARK_HVD_START_TIMEOUT_S"

CONTROLLER_GLOO = "gloo"
CONTROLLER_MPI = "mpi"
DEFAULT_CONTROLLER = CONTROLLER_GLOO
DEFAULT_START_TIMEOUT_S = 30.0


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


def start_timeout_s(environ: Optional[Mapping[str, str]] = None) -> float:
    """SPARK_HVD_START_TIMEOUT_S, or DEFAULT_START_TIMEOUT_S."""
    environ = os.environ if environ is None else environ
    value = environ.get(START_TIMEOUT_ENV_VAR)
    if not value:
        return DEFAULT_START_TIMEOUT_S
    try:
        return float(value)
    except ValueError:
        raise InvalidArgumentError(
            f"{START_TIMEOUT_ENV_VAR}={value!r} is not a number of seconds") from None


def rank_env(topology: Topology, addr: str, port: int, secret: bytes, run_id: str,
             controller: str = DEFAULT_CONTROLLER,
             start_timeout: float = DEFAULT_START_TIMEOUT_S) -> Dict[str, str]:
    """The SPARK_HVD_* variables a rank is started with."""
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
        CONTROLLER_ENV_VAR: controller,
        START_TIMEOUT_ENV_VAR: f"{start_timeout:g}",
    }


def rendezvous_env(addr: str, port: int, secret: bytes, run_id: str) -> Dict[str, str]:
    """The variables that let a process reach the job's rendezvous server."""
    return {
        RENDEZVOUS_ADDR_ENV_VAR: addr,
        RENDEZVOUS_PORT_ENV_VAR: str(port),
        SECRET_ENV_VAR: secret_to_env(secret),
        RUN_ID_ENV_VAR: run_id,
    }


def client_from_env(environ: Optional[Mapping[str, str]] = None):
    """A RendezvousClient for the server named in the environment, or None.

    None when SPARK_HVD_RENDEZVOUS_ADDR is unset; InvalidArgumentError naming the
    variable when it is set but another one is missing or malformed.
    ``environ`` defaults to ``os.environ``.
    """
    from spark_hvd.runner.rendezvous import RendezvousClient

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
                            connect_timeout_s=start_timeout_s(environ))
