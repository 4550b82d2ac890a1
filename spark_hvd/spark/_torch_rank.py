"""One process of :class:`spark_hvd.spark.TorchDistributor`: the torch.distributed
environment, then the user's function or script.

The process is a rank of a spark_hvd job (``spark_hvd.spark.run`` on the executors, or
``spark_hvd.runner.run`` on the driver host for ``local_mode=True``), so its environment
already holds the rank, the size and the job's rendezvous service. This module adds what
``torchrun`` would give the same process:

1. Rank 0 picks a free port on its address on the route to the rendezvous service (where the
   other ranks reach it) and publishes ``host:port`` under MASTER_KEY; every rank waits for
   that key (the rendezvous service's start timeout bounds the wait).
2. Every rank sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
   GROUP_WORLD_SIZE, ROLE_*, NODE_RANK, MASTER_ADDR, MASTER_PORT and TORCHELASTIC_RUN_ID, with
   pyspark's layout: ``local_mode=True`` is one node of ``n`` processes (torchrun
   ``--standalone --nproc_per_node=n``), ``local_mode=False`` ``n`` nodes of one process each
   (one torchrun per Spark task), so ``LOCAL_RANK`` is 0 there and ``cuda:0`` is the task's GPU.
3. A function runs in this process; its value comes back from rank 0 only (pyspark returns
   rank 0's). A script runs as ``python script args...`` in a child process with that
   environment (its output is this rank's; a non-zero exit fails the rank).

Rank 0 binds the port, closes it, and torch's TCPStore binds it again: the same window
torchrun and pyspark's TorchDistributor leave.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from spark_hvd import _config
from spark_hvd._job import env as job_env

MASTER_KEY = "__torch_distributor__/master"


@dataclass(frozen=True)
class RankSpec:
    """What every process runs; travels cloudpickled with the launch."""

    local_mode: bool
    fn: Any = None                    # the function, or None for a script
    script: str = ""                  # the script's absolute path
    args: Tuple[Any, ...] = ()
    kwargs: Optional[Dict[str, Any]] = None


def torch_env(rank: int, size: int, master: str, local_mode: bool, run_id: str
              ) -> Dict[str, str]:
    """The torch.distributed variables of ``rank`` (step 2 of the module docstring)."""
    addr, _, port = master.rpartition(":")
    local_rank, local_size, node, nodes = (rank, size, 0, 1) if local_mode else (0, 1, rank, size)
    return {
        "RANK": str(rank), "WORLD_SIZE": str(size),
        "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_size),
        "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(nodes), "NODE_RANK": str(node),
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(size), "ROLE_NAME": "default",
        "MASTER_ADDR": addr, "MASTER_PORT": port,
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }


def _free_port(host: str) -> int:
    for bind in (host, ""):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((bind, 0))
                return s.getsockname()[1]
        except OSError:
            continue
    raise OSError(f"TorchDistributor: rank 0 found no free TCP port on {host} for MASTER_PORT")


def _master(rank: int) -> str:
    """``host:port`` of rank 0's torch.distributed store (step 1)."""
    client = job_env.client_from_env()
    if client is None:
        raise RuntimeError("spark_hvd.spark._torch_rank runs as a rank of TorchDistributor.run")
    try:
        if rank == 0:
            host = client.local_address()
            client.set(MASTER_KEY, f"{host}:{_free_port(host)}".encode("utf-8"))
        return client.get(MASTER_KEY, _config.start_timeout_s()).decode("utf-8")
    finally:
        client.close()


def main(spec: RankSpec) -> Any:
    """One process of the job (the function ``run`` launches)."""
    rank, size = job_env.rank_and_size()
    run_id = os.environ.get(job_env.RUN_ID_ENV_VAR, "spark_hvd")
    variables = torch_env(rank, size, _master(rank), spec.local_mode, run_id)
    if spec.fn is None:
        command = [sys.executable, spec.script, *spec.args]
        code = subprocess.run(command, env={**os.environ, **variables}).returncode
        if code != 0:
            raise RuntimeError(f"TorchDistributor: `{' '.join(command)}` exited with code {code} "
                               f"on rank {rank} (its output is above)")
        return None
    os.environ.update(variables)
    value = spec.fn(*spec.args, **(spec.kwargs or {}))
    return value if rank == 0 else None
