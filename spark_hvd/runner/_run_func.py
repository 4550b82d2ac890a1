"""``spark_hvd.runner.run(func, ...)``: Horovod's ``horovod.runner.run``, a Python function
run as N ranks by ``spark-hvdrun``, its return values collected by rank.

The function and its arguments travel to the ranks through the job's rendezvous store (so
ranks on other hosts get them too), each rank runs ``python -m spark_hvd.runner._run_rank``,
and puts its return value back in the store under its rank (the rank spark_hvd gave it
last, so an elastic job's values come by final rank). A rank that raises makes the job
fail: ``run`` raises RuntimeError with the launcher's exit code, as Horovod's does.
"""

from __future__ import annotations

import io
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import cloudpickle

from spark_hvd.exceptions import InvalidArgumentError, RankFailedError

FUNC_KEY = "__run__/func"
RESULT_PREFIX = "__run__/result/"


class _Exchange:
    """Puts the pickled call in the store before the ranks start; reads results after."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.results: Dict[int, bytes] = {}

    def before(self, server) -> None:
        server.set(FUNC_KEY, self.payload)

    def after(self, server) -> None:
        for key in server.store.keys(RESULT_PREFIX):
            self.results[int(key[len(RESULT_PREFIX):])] = server.get(key, 1.0)


def run(func: Callable, args: Sequence = (), kwargs: Optional[Mapping[str, Any]] = None,
        np: int = 1, min_np: Optional[int] = None, max_np: Optional[int] = None,
        slots: Optional[int] = None, reset_limit: Optional[int] = None,
        hosts: Optional[str] = None, hostfile: Optional[str] = None,
        start_timeout: Optional[float] = None, ssh_port: Optional[int] = None,
        ssh_identity_file: Optional[str] = None, disable_cache: Optional[bool] = None,
        output_filename: Optional[str] = None, verbose: Optional[int] = None,
        use_gloo: Optional[bool] = None, use_mpi: Optional[bool] = None,
        mpi_args: Optional[str] = None, network_interface: Optional[str] = None,
        executable: Optional[str] = None, env: Optional[Mapping[str, str]] = None) -> List[Any]:
    """Runs ``func(*args, **kwargs)`` on ``np`` ranks (Horovod's ``horovod.runner.run``) and
    returns the ranks' return values in rank order.

    The function calls ``init()`` itself, as a script would. ``hosts`` is ``host:slots,...``
    as ``-H``; ``min_np``/``max_np``/``reset_limit`` make it elastic (on the hosts given,
    which are then fixed; failed workers are replaced). ``use_mpi`` launches through
    ``mpirun``. Horovod's ``hostfile``, ``mpi_args``, ``output_filename`` and ``slots`` without
    ``min_np``/``max_np`` are refused with what to use instead; ``disable_cache`` is accepted
    (the response cache is the SPARK_HVD_CACHE_CAPACITY setting).
    """
    from spark_hvd import _config
    from spark_hvd.runner import _elastic_launch, launch as launch_mod

    if not callable(func):
        raise InvalidArgumentError(f"run needs a callable, got {type(func).__name__}")
    for name, value, fix in (("hostfile", hostfile, "hosts='host1:4,host2:4'"),
                             ("mpi_args", mpi_args, "use_mpi=True with the MPI settings in env"),
                             ("output_filename", output_filename,
                              "redirect the launcher's stdout (every line carries its rank)")):
        if value is not None:
            raise InvalidArgumentError(f"run(..., {name}=...) is not supported; use {fix}")
    if use_gloo and use_mpi:
        raise InvalidArgumentError("use_gloo and use_mpi exclude each other")
    elastic = None
    if min_np is not None or max_np is not None or reset_limit is not None:
        elastic = _elastic_launch.ElasticOptions(
            min_np=min_np, max_np=max_np, reset_limit=reset_limit,
            **({"slots_per_host": slots} if slots is not None else {}))
    elif slots is not None:
        raise InvalidArgumentError("slots= goes with min_np/max_np (elastic); for a fixed job "
                                   "give hosts='host:slots,...'")
    payload = cloudpickle.dumps((func, tuple(args), dict(kwargs or {})))
    exchange = _Exchange(payload)
    out, err = io.BytesIO(), io.BytesIO()
    python = executable or sys.executable
    code = launch_mod.launch(
        [python, "-m", "spark_hvd.runner._run_rank"], np, env=env, mpi=bool(use_mpi),
        hosts=hosts, start_timeout_s=(_config.DEFAULT_START_TIMEOUT_S if start_timeout is None
                                      else float(start_timeout)),
        verbose=bool(verbose), ssh_port=ssh_port, ssh_identity_file=ssh_identity_file,
        network_interface=network_interface, elastic=elastic, exchange=exchange,
        stdout=_Tee(sys.stdout, out), stderr=_Tee(sys.stderr, err))
    if code != 0:
        tail = err.getvalue().decode("utf-8", "replace").strip().splitlines()[-20:]
        raise RankFailedError(f"spark_hvd.runner.run: the job failed with exit code {code}"
                              + ("\n" + "\n".join(tail) if tail else ""))
    ranks = sorted(exchange.results)
    if ranks != list(range(len(ranks))) or not ranks:
        raise RankFailedError(f"spark_hvd.runner.run: results came back from ranks {ranks}, "
                              f"not from every rank 0..{len(ranks) - 1}")
    return [cloudpickle.loads(exchange.results[r]) for r in ranks]


class _Tee:
    """A binary stream writing to a text stream's buffer and keeping a copy."""

    def __init__(self, stream, copy: io.BytesIO) -> None:
        self._stream = getattr(stream, "buffer", None)
        self._copy = copy

    def write(self, data: bytes) -> int:
        self._copy.write(data)
        if self._stream is not None:
            self._stream.write(data)
        return len(data)

    def flush(self) -> None:
        if self._stream is not None:
            self._stream.flush()
