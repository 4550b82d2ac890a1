"""``spark_hvd.spark.run``: a function as one distributed job of Spark barrier tasks.

The driver side of a launch:

1. Check the session and its conf (:mod:`spark_hvd.spark._checks`) before anything
   starts.
2. Start the job's rendezvous server on the driver host; its address, secret and
   run id travel to the tasks in the task closure, with the cloudpickled function.
3. Run one barrier stage of ``num_proc`` tasks (rank = partition id) in a thread of
   its own, under a job group (classic) or an operation tag (Spark Connect), so it
   can be cancelled.
4. Wait until every rank has registered its host, then publish the host list: the
   tasks start their children (see :mod:`spark_hvd.spark._protocol`).
5. One reader thread per rank prints that rank's output as it arrives, ``[rank]``
   in front of every line, and hands the rank's final report to the main thread.
6. All ranks succeeded: return their values by rank.  A rank failed: tell every
   task to stop its child, collect the other ranks' reports, cancel the Spark job,
   and raise one RankFailedError with the root failure first.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import queue
import socket
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, TextIO, Tuple

from spark_hvd import _config
from spark_hvd.exceptions import InvalidArgumentError, SparkHvdError, StoreError
from spark_hvd.runner.rendezvous import RendezvousServer
from spark_hvd.spark import _checks, _driver, _failures, _task

logger = logging.getLogger(__name__)

DEFAULT_SPARK_START_TIMEOUT_S = 600.0
DEFAULT_KILL_GRACE_S = 3.0
_PROG = _failures.PROG


def _plan(spark, conf, num_proc, use_gpu) -> "_checks.Plan":
    return _checks.plan(conf, num_proc, use_gpu,
                        registered=lambda: _checks.registered_slots(spark))


def check_launch(num_proc: Optional[int] = None, use_gpu: Optional[bool] = None,
                 spark=None) -> int:
    """The checks :func:`run` makes before launching, without launching anything.

    For callers that must fail before doing work of their own (an estimator that
    would otherwise write its data first). Returns the number of ranks ``run`` would
    start; raises what ``run`` raises for a bad ``num_proc``, fractional or missing GPU
    amounts, or too few task slots.
    """
    return plan_launch(num_proc, use_gpu, spark).num_proc


@dataclass(frozen=True)
class LaunchPlan:
    """A launch :func:`plan_launch` checked: the session, the conf it read and the plan,
    for :func:`run_planned` to launch without reading and checking them again."""

    spark: Any
    conf: Mapping[str, Optional[str]]
    plan: "_checks.Plan"

    @property
    def num_proc(self) -> int:
        return self.plan.num_proc


def plan_launch(num_proc: Optional[int] = None, use_gpu: Optional[bool] = None,
                spark=None) -> LaunchPlan:
    """:func:`check_launch`'s checks, keeping what they found for :func:`run_planned`."""
    spark = spark if spark is not None else _checks.active_session()
    conf = _checks.read_conf(spark)
    return LaunchPlan(spark, conf, _plan(spark, conf, num_proc, use_gpu))


def run_planned(planned: LaunchPlan, fn: Callable, args: Sequence = (),
                env: Optional[Mapping[str, str]] = None, verbose: int = 1) -> List[Any]:
    """:func:`run` of ``fn(*args)`` on a launch :func:`plan_launch` checked (the estimators
    check it before writing their data, and launch once that is done): the conf is not
    read and the plan not made again."""
    launch = _Launch.check(fn, args, None, env, None, None, verbose, False, None, None,
                           DEFAULT_KILL_GRACE_S)
    return _launch_planned(launch, planned, verbose)


def _launch_planned(launch: "_Launch", planned: LaunchPlan, verbose: int) -> List[Any]:
    spark = planned.spark
    return launch.run(spark, planned.conf, planned.plan.num_proc, planned.plan.use_gpu,
                      lambda server, spec: _Job(spark, server, spec, launch.output, verbose))


def run(fn: Callable, args: Sequence = (), kwargs: Optional[Mapping[str, Any]] = None,
        num_proc: Optional[int] = None, start_timeout: Optional[float] = None,
        use_mpi: Optional[bool] = None, use_gloo: Optional[bool] = None,
        extra_mpi_args: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
        stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None, verbose: int = 1,
        nics: Optional[Sequence[str]] = None, prefix_output_with_timestamp: bool = False,
        executable: Optional[str] = None, *, use_gpu: Optional[bool] = None, spark=None,
        kill_grace_s: float = DEFAULT_KILL_GRACE_S) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` as one distributed job of ``num_proc`` ranks.

    The arguments up to ``executable`` are ``horovod.spark.run``'s, in its order;
    those this runtime cannot honour raise InvalidArgumentError saying why.

    Each rank is one Spark barrier task (rank = partition id) that runs ``fn`` in a
    child process whose environment is the executor's plus the rank's
    ``SPARK_HVD_*`` variables (so ``spark_hvd.init()`` joins the job), ``env`` and,
    with GPUs, ``CUDA_VISIBLE_DEVICES`` set to exactly the rank's GPUs.

    Parameters
    ----------
    fn, args, kwargs:
        The function and its arguments; cloudpickled, so closures and functions
        defined in ``__main__`` or a notebook work.
    num_proc:
        Number of ranks; None uses every task slot of the cluster.
    start_timeout:
        Seconds for all tasks to be scheduled and register (also the ranks'
        ``SPARK_HVD_START_TIMEOUT_S``); default: that variable (or Horovod's
        ``HOROVOD_START_TIMEOUT``) on the driver, else 600.
    use_mpi, use_gloo, extra_mpi_args:
        The ranks always use the Gloo-style controller (there is no ``mpirun`` under
        Spark): ``use_gloo`` may be None or True, ``use_mpi`` None or False, and
        ``extra_mpi_args`` empty.
    env:
        Variables added to every rank's environment.
    stdout, stderr:
        Where the ranks' standard output and error lines go (anything with
        ``write``), each line prefixed ``[rank]``; default ``sys.stdout`` /
        ``sys.stderr``. A stream given here receives the lines even with
        ``verbose=0``.
    verbose:
        0: the ranks' output only goes to ``stdout`` / ``stderr`` when given;
        1: print every rank's output on the driver; 2: also say what the launch does.
    nics:
        Not supported: each rank talks on its address on the route to the driver.
    prefix_output_with_timestamp:
        Put the time the driver received each line in front of it.
    executable:
        The Python each rank's process runs (on the executors); default the
        executor's own ``sys.executable``.
    use_gpu:
        Pin each rank to the GPUs Spark assigned its task (needs a whole-number
        ``spark.task.resource.gpu.amount``); None: when that conf is set.
    spark:
        The SparkSession (classic or Connect); default the active one.
    kill_grace_s:
        When the job is torn down, how long a rank gets between SIGTERM and SIGKILL.

    Returns
    -------
    list
        Every rank's return value, in rank order.

    Raises
    ------
    InvalidArgumentError
        Before anything starts, for settings that cannot work (the message names the
        conf to change).
    RankFailedError
        When a rank fails; the root failure first, with each failed rank's last
        output lines in ``failures``.
    CollectiveTimeoutError
        When not every task started within ``start_timeout``.
    """
    _check_controller(use_mpi, use_gloo, extra_mpi_args, nics)
    launch = _Launch.check(fn, args, kwargs, env, stdout, stderr, verbose,
                           prefix_output_with_timestamp, executable, start_timeout, kill_grace_s)
    return _launch_planned(launch, plan_launch(num_proc, use_gpu, spark), verbose)


@dataclass(frozen=True)
class _Launch:
    """What ``run`` and ``run_elastic`` are asked to launch, checked."""

    fn: Callable
    args: Tuple
    kwargs: Dict[str, Any]
    env: Dict[str, str]
    output: _driver.Output
    executable: str
    start_timeout_s: float
    kill_grace_s: float

    @classmethod
    def check(cls, fn: Callable, args: Sequence, kwargs: Optional[Mapping[str, Any]],
              env: Optional[Mapping[str, str]], stdout: Optional[TextIO],
              stderr: Optional[TextIO], verbose: int, timestamp: bool,
              executable: Optional[str], start_timeout: Optional[float],
              kill_grace_s: float) -> "_Launch":
        """InvalidArgumentError for arguments that cannot work."""
        if not callable(fn):
            raise InvalidArgumentError(f"fn must be callable, got {type(fn).__name__}")
        output = _driver.Output.make(stdout, stderr, verbose, timestamp)
        if executable is not None and (not isinstance(executable, str) or not executable):
            raise InvalidArgumentError(f"executable must be a path to a Python interpreter on "
                                       f"the executors, got {executable!r}")
        user_env = _check_env(env)
        start_timeout_s = _start_timeout(start_timeout)
        if isinstance(kill_grace_s, bool) or not isinstance(kill_grace_s, (int, float)) \
                or kill_grace_s < 0:
            raise InvalidArgumentError(f"kill_grace_s must be a number >= 0, got "
                                       f"{kill_grace_s!r}")
        return cls(fn, tuple(args), dict(kwargs or {}), user_env, output, executable or "",
                   start_timeout_s, float(kill_grace_s))

    def run(self, spark, conf: Mapping[str, Optional[str]], size: int, use_gpu: bool,
            job: Callable[[RendezvousServer, _task.TaskSpec], Any],
            **spec_fields: Any) -> List[Any]:
        """Starts the rendezvous server and runs ``job(server, spec)`` of ``size`` tasks."""
        import cloudpickle

        payload = cloudpickle.dumps((self.fn, self.args, self.kwargs))
        server, addr = _start_server(conf, _checks.is_connect(spark))
        try:
            spec = _task.TaskSpec(addr=addr, port=server.port, secret=server.secret,
                                  run_id=server.run_id, size=size, payload=payload,
                                  env=tuple(sorted(self.env.items())), use_gpu=use_gpu,
                                  start_timeout_s=self.start_timeout_s,
                                  kill_grace_s=self.kill_grace_s, executable=self.executable,
                                  **spec_fields)
            return job(server, spec).run()
        finally:
            server.stop()


def _check_controller(use_mpi: Optional[bool], use_gloo: Optional[bool],
                      extra_mpi_args: Optional[str], nics: Optional[Sequence[str]]) -> None:
    """Horovod's controller and network arguments: what this runtime can honour."""
    if use_mpi:
        raise InvalidArgumentError(
            "use_mpi=True: spark_hvd.spark.run starts each rank in its Spark task, where no "
            "mpirun launches it, so the ranks always use the Gloo-style controller (leave "
            "use_mpi unset; for MPI, launch outside Spark with `spark-hvdrun --mpi`)")
    if use_gloo is not None and not use_gloo:
        raise InvalidArgumentError(
            "use_gloo=False: under Spark the Gloo-style controller is the only one (leave "
            "use_gloo unset or True)")
    if extra_mpi_args:
        raise InvalidArgumentError(
            f"extra_mpi_args={extra_mpi_args!r}: spark_hvd.spark.run runs no mpirun to pass "
            "them to (for MPI, launch outside Spark with `spark-hvdrun --mpi`)")
    if nics:
        raise InvalidArgumentError(
            f"nics={nics!r} cannot be honoured: each rank connects on its address on the "
            "route to the driver (spark.driver.host); leave nics unset")


def _check_env(env: Optional[Mapping[str, str]]) -> Dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise InvalidArgumentError(f"env must be a mapping of str to str, got {type(env).__name__}")
    for k, v in env.items():
        if not isinstance(k, str) or not isinstance(v, str) or not k or "=" in k:
            raise InvalidArgumentError(f"env must map variable names to str values; got "
                                       f"{k!r}: {v!r}")
    return dict(env)


def _start_timeout(value: Optional[float]) -> float:
    if value is None:
        setting = _config.BY_NAME[_config.START_TIMEOUT_S_ENV_VAR]
        var = setting.source()
        if var and os.environ[var]:  # set on the driver (or Horovod's name for it)
            return _config.start_timeout_s()
        return DEFAULT_SPARK_START_TIMEOUT_S
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidArgumentError(f"start_timeout must be a number of seconds > 0, got "
                                   f"{value!r}")
    return float(value)


def _route_address(host: str) -> str:
    """This machine's address on the route to ``host``."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP: no packet is sent
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _start_server(conf: Mapping[str, Optional[str]], connect: bool
                  ) -> Tuple[RendezvousServer, str]:
    """The started rendezvous server and the address the tasks reach it at.

    Classic Spark: where the driver itself listens (spark.driver.bindAddress, else
    spark.driver.host), announced as spark.driver.host, which the executors already
    resolve to reach the driver (as its IP when that is a loopback address).  Under
    Spark Connect the driver is the Connect server, maybe on another machine: listen
    on spark.driver.host when it is an address of this machine, else everywhere,
    announced as this machine's address on the route to the driver.
    """
    host = conf.get(_checks.DRIVER_HOST) or os.environ.get("SPARK_LOCAL_IP") \
        or socket.gethostname()
    bind = None if connect else conf.get(_checks.DRIVER_BIND_ADDRESS)
    if not bind:
        try:
            bind = socket.gethostbyname(host)
        except OSError:
            bind = None
    if bind:
        server = RendezvousServer(host=bind)
        try:
            server.start()
        except StoreError:
            logger.debug("cannot listen on %s (%s); listening on every interface", bind, host)
        else:
            loopback = server.host != "0.0.0.0" and ipaddress.ip_address(server.host).is_loopback
            return server, (server.host if loopback else host)
    server = RendezvousServer(host="0.0.0.0")
    server.start()
    return server, (_route_address(host) if connect else host)


class _Job:
    """One barrier launch: its parts (:mod:`spark_hvd.spark._driver`) put together, and
    the wait for the outcome."""

    def __init__(self, spark, server: RendezvousServer, spec: _task.TaskSpec,
                 output: _driver.Output, verbose: int) -> None:
        self.spec, self.verbose, self.size = spec, verbose, spec.size
        self.server = server
        self.store = server.store
        self.events: _driver.Events = queue.Queue()
        self.stage = _driver.SparkStage(spark, spec, server.run_id, self.events, barrier=True,
                                        prog=_PROG, what="ranks")
        self.logs = _driver.LogReader(self.store, output, self.events, _PROG)
        self.gate = _driver.StartGate(self.store, self.size)
        self._spark_ended = False

    def _start_ranks(self) -> None:
        """Step 4: the host list, once every rank has registered."""
        hosts, missing = self.gate.wait_hosts(self.spec.start_timeout_s)
        if hosts is None:
            if missing:
                self.events.put(("start_timeout", missing))
            return
        if self.gate.open(hosts) and self.verbose >= 2:
            self.logs.say(f"{self.size} ranks registered on {', '.join(sorted(set(hosts)))}")

    def run(self) -> List[Any]:
        if self.verbose >= 2:
            self.logs.say(f"launching {self.size} ranks as a barrier stage "
                          f"({'mapInArrow, Spark Connect' if self.stage.connect else 'RDD'}); "
                          f"rendezvous at {self.spec.addr}:{self.spec.port}, run "
                          f"{self.stage.run_id}")
        for r in range(self.size):
            self.logs.start(r, r)
        _driver.thread(self._start_ranks, name="spark_hvd-start")
        self.stage.start()
        results: Dict[int, Any] = {}
        reports: Dict[int, dict] = {}
        try:
            failure = self._wait(results, reports)
        except BaseException:  # e.g. KeyboardInterrupt: stop everything, then re-raise
            self.gate.abort()
            self.stage.cancel()
            raise
        if failure is None:
            self.stage.wait_end()
            return [results[r] for r in range(self.size)]
        self.gate.abort()
        self._collect(reports)
        self.stage.cancel()
        raise _failures.job_error(failure, reports, self.size, self.logs.tails,
                                  partial(_driver.attempts, self.store),
                                  self.spec.start_timeout_s)

    def _wait(self, results: Dict[int, Any], reports: Dict[int, dict]) -> Optional[tuple]:
        """Until every rank succeeded (None) or something failed (the failure)."""
        deadline = None
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                event = self.events.get(timeout=timeout)
            except queue.Empty:
                missing = [r for r in range(self.size) if r not in reports]
                return ("lost", missing)
            kind = event[0]
            if kind == "report":
                rank, report = event[1], event[2]
                reports[rank] = report
                # Its child has ended: if before init() registered it, the others' init
                # fails naming it rather than waiting out the start timeout.
                self.server.rank_ended(rank, why="its Spark task's child ended")
                if not _failures.ok(report):
                    return ("rank", rank)
                try:
                    results[rank] = _driver.read_result(self.store, rank, report, f"rank {rank}")
                except SparkHvdError as e:
                    report["task_error"] = str(e)
                    return ("rank", rank)
                if len(results) == self.size:
                    return None
            elif kind == "spark_done":
                # Every task reports before it ends: a missing report is on its way, unless
                # the rank never reported (its task died, or Spark retried it).
                self._spark_ended = True
                never = [r for r in range(self.size)
                         if r not in reports and r not in self._reported()]
                if never:
                    return ("lost", never)
                deadline = time.monotonic() + _driver.LATE_REPORT_S
            elif kind == "spark_failed":
                self._spark_ended = True
                return ("spark", event[1])
            elif kind == "start_timeout":
                return ("start_timeout", event[1])

    def _reported(self) -> List[int]:
        """Ranks whose task has sent its final report (read or not)."""
        return _driver.reported(self.store, range(self.size))

    def _collect(self, reports: Dict[int, dict]) -> None:
        """The other ranks' reports: all of them, or, once the Spark job has ended (no
        more will come), those already sent; at most kill_grace_s + REPORT_WAIT_S, or
        LOST_REPORT_S once every rank not heard from was named lost by a rank that was."""
        deadline = time.monotonic() + self.spec.kill_grace_s + _driver.REPORT_WAIT_S
        shortened = False
        while len(reports) < self.size:
            if self._spark_ended and set(self._reported()) <= set(reports):
                return
            if not shortened and set(range(self.size)) - set(reports) <= _failures.named_lost(
                    reports.values()):
                # Every rank still silent was named lost by the others: its report comes at
                # once if its task still runs (a killed child), never if its host is cut off.
                deadline = min(deadline, time.monotonic() + _driver.LOST_REPORT_S)
                shortened = True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                event = self.events.get(timeout=remaining)
            except queue.Empty:
                return
            if event[0] == "report":
                reports[event[1]] = event[2]
            elif event[0] in ("spark_done", "spark_failed"):
                self._spark_ended = True
