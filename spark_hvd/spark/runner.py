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
import json
import logging
import os
import pickle
import queue
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import (Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, TextIO,
                    Tuple)

from spark_hvd import _config
from spark_hvd._job.store import MAX_TIMEOUT_S
from spark_hvd.exceptions import (CollectiveTimeoutError, InvalidArgumentError, SparkHvdError,
                                  StoreError)
from spark_hvd.runner.rendezvous import RendezvousServer
from spark_hvd.spark import _checks, _failures, _protocol as P, _task

logger = logging.getLogger(__name__)

DEFAULT_SPARK_START_TIMEOUT_S = 600.0
DEFAULT_KILL_GRACE_S = 3.0
TAIL_LINES = 40
_PROG = _failures.PROG
_REPORT_WAIT_S = 10.0     # after an abort: how long the other ranks get to report
_LATE_REPORT_S = 60.0     # after the Spark job ended: reports still on their way
_SPARK_END_WAIT_S = 30.0  # how long to wait for the Spark job to end once ranks are done
_SUPERSEDED_CHECK_S = 5.0  # elastic: how often a silent stream checks for a task retry



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
    spark = spark if spark is not None else _checks.active_session()
    return _plan(spark, _checks.read_conf(spark), num_proc, use_gpu).num_proc

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
    spark = spark if spark is not None else _checks.active_session()
    conf = _checks.read_conf(spark)
    plan = _plan(spark, conf, num_proc, use_gpu)
    return launch.run(spark, conf, plan.num_proc, plan.use_gpu,
                      lambda server, spec: _Job(spark, server, spec, launch.output, verbose))


@dataclass(frozen=True)
class _Launch:
    """What ``run`` and ``run_elastic`` are asked to launch, checked."""

    fn: Callable
    args: Tuple
    kwargs: Dict[str, Any]
    env: Dict[str, str]
    output: "_Output"
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
        output = _Output.make(stdout, stderr, verbose, timestamp)
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
            job: Callable[[RendezvousServer, _task.TaskSpec], "_Job"],
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


class _Output:
    """Where the ranks' output lines go on the driver."""

    def __init__(self, out: Optional[TextIO], err: Optional[TextIO], timestamp: bool) -> None:
        self.out, self.err, self.timestamp = out, err, timestamp

    @classmethod
    def make(cls, stdout: Optional[TextIO], stderr: Optional[TextIO], verbose: int,
             timestamp: bool) -> "_Output":
        if isinstance(verbose, bool) or not isinstance(verbose, int) or verbose < 0:
            raise InvalidArgumentError(f"verbose must be 0, 1 or 2, got {verbose!r}")
        for arg, stream in (("stdout", stdout), ("stderr", stderr)):
            if stream is not None and not callable(getattr(stream, "write", None)):
                raise InvalidArgumentError(f"{arg} must be a stream with write(), got "
                                           f"{type(stream).__name__}")
        if verbose >= 1:
            stdout = stdout if stdout is not None else sys.stdout
            stderr = stderr if stderr is not None else sys.stderr
        return cls(stdout, stderr, bool(timestamp))

    def write(self, label: str, lines: Sequence[Tuple[bytes, str]]) -> None:
        """Lines of rank (or worker) ``label``, as (P.STDOUT or P.STDERR, text)."""
        stamp = time.strftime("%a %b %d %H:%M:%S %Y ") if self.timestamp else ""
        used = set()
        for stream, text in lines:
            out = self.out if stream == P.STDOUT else self.err
            if out is not None:
                out.write(f"{stamp}[{label}] {text}\n")
                used.add(id(out))
        for out in (self.out, self.err):
            if out is not None and id(out) in used and callable(getattr(out, "flush", None)):
                out.flush()


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
    """One launch: the Spark stage, the rank readers, the wait for the outcome."""

    prog = _PROG
    barrier = True         # one barrier stage of ``size`` tasks
    what = "ranks"         # what the tasks are, for the Spark UI
    line_label = "{}"      # the label of each output line, from the rank

    def __init__(self, spark, server: RendezvousServer, spec: _task.TaskSpec,
                 output: _Output, verbose: int) -> None:
        self.spark, self.server, self.spec, self.verbose = spark, server, spec, verbose
        self.output = output
        self.size = spec.size
        self.store = server.store
        self.connect = _checks.is_connect(spark)
        self.tag = f"spark_hvd-{server.run_id}"
        self.events: "queue.Queue[tuple]" = queue.Queue()
        self.tails: Dict[int, Deque[str]] = {r: deque(maxlen=TAIL_LINES)
                                             for r in range(self.size)}
        self._print_lock = threading.Lock()
        self._lock = threading.Lock()
        self._aborting = False
        self._spark_ended = False

    # -- threads --------------------------------------------------------------------

    def _thread(self, target, *args, name: str) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, daemon=True, name=name)
        thread.start()
        return thread

    def _run_spark_stage(self) -> None:
        try:
            n = self.size
            if self.connect:
                self.spark.addTag(self.tag)
                try:
                    (self.spark.range(0, n, 1, n)
                     .mapInArrow(partial(_task.arrow_partition, self.spec),
                                 _task.ARROW_SCHEMA, barrier=self.barrier)
                     .collect())
                finally:
                    self.spark.removeTag(self.tag)
            else:
                sc = self.spark.sparkContext
                sc.setJobGroup(self.tag, f"{self.prog}: {n} {self.what}, run "
                                         f"{self.server.run_id}", interruptOnCancel=True)
                sc.setLocalProperty("callSite.short", f"{self.prog}({n} {self.what})")
                rdd = sc.parallelize(range(n), n)
                rdd = rdd.barrier() if self.barrier else rdd
                rdd.mapPartitions(partial(_task.rdd_partition, self.spec)).collect()
            self.events.put(("spark_done",))
        except BaseException as e:  # noqa: B036 - handed to the main thread
            self.events.put(("spark_failed", e))

    def _start_ranks(self) -> None:
        keys = [P.host_key(r) for r in range(self.size)]
        try:
            self.store.wait(keys, self.spec.start_timeout_s)
            hosts = [self.store.get(k, 0).decode("utf-8") for k in keys]
        except CollectiveTimeoutError:
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            self.events.put(("start_timeout", missing))
            return
        except SparkHvdError:  # the store closed: the job is over
            return
        with self._lock:
            if self._aborting:
                return
            self.store.set(P.START_KEY, json.dumps(hosts).encode("utf-8"))
        if self.verbose >= 2:
            self._say(f"{self.size} ranks registered on {', '.join(sorted(set(hosts)))}")

    def _read_log(self, stream: P.Stream, label: int,
                  superseded: Optional[Callable[[], bool]] = None) -> None:
        """Prints ``stream``'s output as ``label``'s until its report, which goes to the
        main thread as ``("report", label, report)``. With ``superseded``, a stream that
        stays silent is given up when that says so (Spark started its task again)."""
        seq = 0
        tail = self.tails.setdefault(label, deque(maxlen=TAIL_LINES))
        while True:
            key = P.log_key(stream, seq)
            try:
                message = self.store.get(key, MAX_TIMEOUT_S if superseded is None
                                         else _SUPERSEDED_CHECK_S)
            except CollectiveTimeoutError:
                if superseded is not None and superseded():
                    self.events.put(("report", label, {
                        "task_error": "its Spark task was lost (Spark started it again)",
                        "time": time.time()}))
                    return
                continue
            except SparkHvdError:  # the store closed: the job is over
                return
            self.store.delete(key)
            seq += 1
            if message[:1] != P.KIND_LINES:
                self.events.put(("report", label, pickle.loads(message[1:])))
                return
            lines = list(P.parse_lines(message[1:]))
            tail.extend(text for _, text in lines)
            with self._print_lock:
                self.output.write(self.line_label.format(label), lines)

    def _say(self, text: str) -> None:
        with self._print_lock:
            sys.stderr.write(f"{self.prog}: {text}\n")
            sys.stderr.flush()

    # -- the outcome ----------------------------------------------------------------

    def run(self) -> List[Any]:
        if self.verbose >= 2:
            self._say(f"launching {self.size} ranks as a barrier stage "
                      f"({'mapInArrow, Spark Connect' if self.connect else 'RDD'}); rendezvous "
                      f"at {self.spec.addr}:{self.spec.port}, run {self.server.run_id}")
        for r in range(self.size):
            self._thread(self._read_log, r, r, name=f"spark_hvd-rank-{r}-output")
        self._thread(self._start_ranks, name="spark_hvd-start")
        spark_thread = self._spark_thread()
        results: Dict[int, Any] = {}
        reports: Dict[int, dict] = {}
        try:
            failure = self._wait(results, reports)
        except BaseException:  # e.g. KeyboardInterrupt: stop everything, then re-raise
            self._abort()
            self._cancel(spark_thread)
            raise
        if failure is None:
            self._wait_spark_end(spark_thread)
            return [results[r] for r in range(self.size)]
        self._abort()
        self._collect(reports)
        self._cancel(spark_thread)
        raise _failures.job_error(failure, reports, self.size, self.tails, self._attempts,
                                  self.spec.start_timeout_s)

    def _spark_thread(self) -> threading.Thread:
        try:
            from pyspark.util import InheritableThread  # keeps the caller's job properties

            thread = InheritableThread(self._run_spark_stage, session=self.spark, daemon=True,
                                       name="spark_hvd-spark-stage")
        except ImportError:
            thread = threading.Thread(target=self._run_spark_stage, daemon=True,
                                      name="spark_hvd-spark-stage")
        thread.start()
        return thread

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
                    results[rank] = self._load_result(rank, report, f"rank {rank}")
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
                deadline = time.monotonic() + _LATE_REPORT_S
            elif kind == "spark_failed":
                self._spark_ended = True
                return ("spark", event[1])
            elif kind == "start_timeout":
                return ("start_timeout", event[1])

    def _load_result(self, stream: P.Stream, report: dict, who: str) -> Any:
        parts = []
        for i in range(report.get("chunks", 0)):
            key = P.result_key(stream, i)
            parts.append(self.store.get(key, _REPORT_WAIT_S))
            self.store.delete(key)
        try:
            return pickle.loads(b"".join(parts))
        except Exception as e:
            raise SparkHvdError(f"the return value of {who} cannot be unpickled on the "
                                f"driver: {type(e).__name__}: {e}") from None

    def _abort(self) -> None:
        """Tell every task to stop its child (and tasks not started yet not to start one)."""
        with self._lock:
            self._aborting = True
            try:
                if not self.store.check([P.START_KEY]):
                    self.store.set(P.START_KEY, P.ABORT)
                for r in range(self.size):
                    self.store.set(P.stop_key(r), P.ABORT)
            except StoreError:
                pass

    def _reported(self) -> List[int]:
        """Ranks whose task has sent its final report (read or not)."""
        return [r for r in range(self.size) if self.store.check([P.reported_key(r)])]

    def _collect(self, reports: Dict[int, dict]) -> None:
        """The other ranks' reports: all of them, or, once the Spark job has ended (no
        more will come), those already sent; at most kill_grace_s + _REPORT_WAIT_S."""
        deadline = time.monotonic() + self.spec.kill_grace_s + _REPORT_WAIT_S
        while len(reports) < self.size:
            if self._spark_ended and set(self._reported()) <= set(reports):
                return
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

    def _cancel(self, spark_thread: threading.Thread) -> None:
        if spark_thread.is_alive():
            try:
                if self.connect:
                    self.spark.interruptTag(self.tag)
                else:
                    self.spark.sparkContext.cancelJobGroup(self.tag)
            except Exception as e:  # the session may be stopping too
                logger.warning("%s: cancelling Spark job group %s failed: %s", self.prog,
                               self.tag, e)
        spark_thread.join(_SPARK_END_WAIT_S)

    def _attempts(self, rank: int) -> int:
        """How many times Spark started rank ``rank``'s task."""
        key = P.attempt_key(rank)
        try:
            return int(self.store.get(key, 0)) if self.store.check([key]) else 0
        except (SparkHvdError, ValueError):
            return 0

    def _wait_spark_end(self, spark_thread: threading.Thread) -> None:
        spark_thread.join(_SPARK_END_WAIT_S)
        if spark_thread.is_alive():
            logger.warning("%s: every rank returned but the Spark job has not ended after "
                           "%g s", self.prog, _SPARK_END_WAIT_S)
