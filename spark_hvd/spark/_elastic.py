"""``spark_hvd.spark.run_elastic``: a function as an elastic job of plain Spark tasks.

The driver side of an elastic launch:

1. Check the arguments, the sizes (``min_num_proc <= num_proc <= max_num_proc``) and
   that the cluster can run ``min_num_proc`` tasks at once, before anything starts.
2. Start the job's rendezvous server and, beside it, the elastic
   :class:`~spark_hvd.runner._elastic.Coordinator`, which forms the membership epochs
   from the workers that ask for a place.
3. Run one Spark job of ``max_num_proc`` plain (not barrier) tasks, one per possible
   worker: they start as task slots allow, so executors Spark adds later run the
   tasks still pending, whose workers then join the job. Each task starts its worker
   at once (see :mod:`spark_hvd.spark._protocol`).
4. One reader thread per partition prints the output of that partition's task (of
   each attempt, in turn), ``[w<worker id>]`` in front of every line; the
   coordinator's lines (epochs formed, workers lost) say which rank each worker holds.
   A worker that fails is left behind: the others go on through the elastic protocol.
5. The first worker to return a value ends the job: the last epoch it was a member of
   is the final one; the coordinator stops (no epoch forms after it), and once every
   rank of that epoch has returned, their values are the result, in rank order.
6. Then, or when the job fails (the coordinator gives up, a rank of the final epoch
   fails, every worker ended), the driver sets ``finish`` and stops every worker still
   running or waiting for a place, and cancels the Spark job if tasks are left.
"""

from __future__ import annotations

import json
import queue
import time
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, TextIO, Tuple

from spark_hvd._job import elastic as proto
from spark_hvd import _config
from spark_hvd._job.store import MAX_TIMEOUT_S
from spark_hvd.exceptions import CollectiveTimeoutError, InvalidArgumentError, SparkHvdError
from spark_hvd.runner import Coordinator, check_sizes
from spark_hvd.runner.rendezvous import RendezvousServer
from spark_hvd.spark import _checks, _driver, _failures, _protocol as P, _task, runner

_PROG = _failures.ELASTIC_PROG
_START_GRACE_S = 5.0   # after start_timeout: the coordinator forms the first epoch by then


def run_elastic(fn: Callable, args: Sequence = (), kwargs: Optional[Mapping[str, Any]] = None,
                num_proc: Optional[int] = None, min_num_proc: Optional[int] = None,
                max_num_proc: Optional[int] = None, start_timeout: Optional[float] = None,
                elastic_timeout: Optional[float] = None, reset_limit: Optional[int] = None,
                env: Optional[Mapping[str, str]] = None, stdout: Optional[TextIO] = None,
                stderr: Optional[TextIO] = None, verbose: int = 1,
                nics: Optional[Sequence[str]] = None,
                prefix_output_with_timestamp: bool = False, min_np: Optional[int] = None,
                max_np: Optional[int] = None, *, executable: Optional[str] = None,
                use_gpu: Optional[bool] = None, spark=None,
                kill_grace_s: float = runner.DEFAULT_KILL_GRACE_S) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` as an elastic job: workers may fail or join while it
    trains, between ``min_num_proc`` and ``max_num_proc`` of them.

    The arguments up to ``max_np`` are ``horovod.spark.run_elastic``'s, in its order.
    ``fn`` runs in one child process per worker; it calls ``spark_hvd.init()`` (which
    gives it a rank in the job's current membership epoch) and keeps its training loop
    in a function decorated with ``spark_hvd.elastic.run``, so that after a lost worker
    the survivors roll back to their last ``state.commit()`` and go on at the new size,
    and workers that start later join at the next commit.

    Each worker is one plain Spark task (no barrier): ``max_num_proc`` tasks are
    submitted, and those Spark cannot run yet start when task slots free up or
    executors are added; a task whose worker dies ends without failing the Spark job
    (and a task Spark starts again is a new worker). The job is done when the ranks of
    its final epoch have returned.

    Parameters
    ----------
    fn, args, kwargs:
        The function and its arguments, as for :func:`spark_hvd.spark.run`.
    num_proc:
        Workers to start with: the first epoch forms once that many ask for a place
        (or, after ``start_timeout``, once ``min_num_proc`` have). Default: every task
        slot (at most ``max_num_proc``), or ``min_num_proc`` when that is given.
    min_num_proc, max_num_proc:
        The fewest workers the job goes on with (default ``num_proc``), and the most
        it runs (default ``num_proc``; also how many tasks are submitted).
    start_timeout:
        Seconds for the first epoch to form (also the workers' connect timeout);
        default as :func:`spark_hvd.spark.run`.
    elastic_timeout:
        Seconds the job waits, after losing workers, for ``min_num_proc`` of them to
        ask for a place before it fails; default ``SPARK_HVD_ELASTIC_TIMEOUT_S`` (or Horovod's
        ``HOROVOD_ELASTIC_TIMEOUT``) from the driver's environment, else 600.
    reset_limit:
        Fail the job when it would re-form more than this many times; default: no limit.
    env, stdout, stderr, verbose, prefix_output_with_timestamp, executable, use_gpu,
    spark, kill_grace_s:
        As for :func:`spark_hvd.spark.run`; each output line is prefixed ``[w<worker>]``
        (a worker's rank can change from epoch to epoch). ``verbose=1`` also prints
        the coordinator's events (an epoch formed, a worker lost) on stderr.
    nics:
        Not supported, as for :func:`spark_hvd.spark.run`.
    min_np, max_np:
        Horovod's deprecated names of ``min_num_proc`` and ``max_num_proc``.

    Returns
    -------
    list
        The return values of the final epoch's ranks, in rank order.

    Raises
    ------
    InvalidArgumentError
        Before anything starts, for arguments or settings that cannot work.
    RankFailedError
        When the job cannot go on: the coordinator gave up (fewer than
        ``min_num_proc`` workers for ``elastic_timeout``, ``reset_limit`` exceeded), a
        rank of the final epoch failed, or every worker ended before one returned; with
        each failed worker's last output lines in ``failures`` (by worker id).
    CollectiveTimeoutError
        When no epoch formed within ``start_timeout``.
    """
    min_num_proc = _deprecated("min_np", min_np, "min_num_proc", min_num_proc)
    max_num_proc = _deprecated("max_np", max_np, "max_num_proc", max_num_proc)
    sizes = None  # with neither num_proc nor min_num_proc: once the task slots are known
    if num_proc is not None or min_num_proc is not None:
        sizes = check_sizes(num_proc, min_num_proc, max_num_proc, reset_limit)
    runner._check_controller(None, None, None, nics)
    launch = runner._Launch.check(fn, args, kwargs, env, stdout, stderr, verbose,
                                  prefix_output_with_timestamp, executable, start_timeout,
                                  kill_grace_s)
    elastic_timeout_s = _elastic_timeout(elastic_timeout)
    spark = spark if spark is not None else _checks.active_session()
    conf = _checks.read_conf(spark)

    def plan(n: Optional[int], name: str) -> _checks.Plan:
        return _checks.plan(conf, n, use_gpu, lambda: _checks.registered_slots(spark),
                            barrier=False, name=name)

    if sizes is None:
        slots = plan(None, "num_proc").num_proc
        if isinstance(max_num_proc, int) and not isinstance(max_num_proc, bool):
            slots = max(1, min(slots, max_num_proc))
        sizes = check_sizes(slots, None, max_num_proc, reset_limit)
    return launch.run(spark, conf, sizes[2], plan(sizes[1], "min_num_proc").use_gpu,
                      lambda server, spec: _ElasticJob(spark, server, spec, launch.output,
                                                       verbose, sizes, reset_limit),
                      elastic_timeout_s=elastic_timeout_s)


def _deprecated(old: str, old_value: Optional[int], new: str,
                new_value: Optional[int]) -> Optional[int]:
    if old_value is None:
        return new_value
    if new_value is not None:
        raise InvalidArgumentError(f"{old} is the deprecated name of {new}: pass only {new}")
    warnings.warn(f"{old} is deprecated, use {new}", DeprecationWarning, stacklevel=3)
    return old_value


def _elastic_timeout(value: Optional[float]) -> float:
    what = "elastic_timeout"
    if value is None:  # the setting (or Horovod's variable), else its default
        what = _config.BY_NAME[_config.ELASTIC_TIMEOUT_S_ENV_VAR].source() or what
        value = _config.elastic_timeout_s()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidArgumentError(f"{what} must be a number of seconds > 0, got {value!r}")
    return float(value)


class _Done:
    """The end of the wait: the results, or why the job failed."""

    def __init__(self, results: Optional[List[Any]] = None, head: str = "",
                 error: Optional[SparkHvdError] = None,
                 cause: Optional[BaseException] = None) -> None:
        self.results, self.head, self.error, self.cause = results, head, error, cause


class _ElasticJob:
    """One elastic launch: the parts of a launch (:mod:`spark_hvd.spark._driver`: the
    Spark job of plain tasks, the workers' readers) and the coordinator put together,
    and the wait for the outcome."""

    def __init__(self, spark, server: RendezvousServer, spec: _task.TaskSpec,
                 output: _driver.Output, verbose: int, sizes: Tuple[int, int, int],
                 reset_limit: Optional[int]) -> None:
        self.spec, self.verbose, self.size = spec, verbose, spec.size
        self.store = server.store
        self.events: _driver.Events = queue.Queue()
        self.stage = _driver.SparkStage(spark, spec, server.run_id, self.events, barrier=False,
                                        prog=_PROG, what="elastic workers")
        self.logs = _driver.LogReader(self.store, output, self.events, _PROG, "w{}")
        self._aborting = False
        self._spark_ended = False
        self.num_proc, self.min_num_proc, _ = sizes
        self.coordinator = Coordinator(server, *sizes, spec.start_timeout_s,
                                       spec.elastic_timeout_s, reset_limit,
                                       log=self._coordinator_says)
        self.streams: Dict[int, str] = {}     # worker -> its task's stream
        self.reports: Dict[int, dict] = {}    # worker -> its task's final report
        self.results: Dict[int, Any] = {}     # worker -> its return value
        self.returned: List[int] = []         # workers that returned, in that order
        self.final: Optional[proto.Epoch] = None
        self.spark_error: Optional[BaseException] = None

    # -- threads --------------------------------------------------------------------

    def _coordinator_says(self, message: str) -> None:
        if self.verbose >= 1:
            self.logs.say(message)
        self.events.put(("coordinator",))  # its error, if any, is read by the main thread

    def _read_partition(self, partition: int) -> None:
        """The output of each attempt of ``partition``'s task, in turn."""
        attempt = 1
        while True:
            stream = P.stream_id(partition, attempt)
            try:
                hello = json.loads(self.store.get(P.stream_key(stream), MAX_TIMEOUT_S))
            except SparkHvdError:  # the store closed: the job is over
                return
            worker = int(hello["worker"])
            self.events.put(("worker", worker, stream, hello["host"]))
            self.logs.read(stream, worker,
                           lambda a=attempt: _driver.attempts(self.store, partition) > a)
            attempt += 1

    # -- the outcome ----------------------------------------------------------------

    def run(self) -> List[Any]:
        if self.verbose >= 2:
            self.logs.say(f"launching up to {self.size} workers as plain tasks "
                          f"({'mapInArrow, Spark Connect' if self.stage.connect else 'RDD'}); "
                          f"the job starts with {self.num_proc}; rendezvous at "
                          f"{self.spec.addr}:{self.spec.port}, run {self.stage.run_id}")
        self.coordinator.start()
        for p in range(self.size):
            _driver.thread(self._read_partition, p, name=f"spark_hvd-task-{p}-output")
        self.stage.start()
        try:
            done = self._wait()
        except BaseException:  # e.g. KeyboardInterrupt: stop everything, then re-raise
            self._finish()
            self.stage.cancel()
            raise
        finally:
            self.coordinator.stop()
        self._finish()
        if done.results is not None:
            # The workers' tasks end as they report; a worker the job lost (a host cut
            # off) may never report, and its task ends only when Spark gives it up.
            self._collect_reports()
            self.stage.join(_driver.LOST_REPORT_S if self._unreported() else
                            self.spec.kill_grace_s + _driver.REPORT_WAIT_S)
            self.stage.cancel()  # tasks still pending (no slot, no executor yet)
            return done.results
        if done.error is None:
            self._collect_reports()
        self.stage.cancel()
        raise done.error or _failures.elastic_error(done.head, self.reports, self.logs.tails,
                                                    done.cause)

    def _wait(self) -> _Done:
        start_deadline = time.monotonic() + self.spec.start_timeout_s + _START_GRACE_S
        late_deadline: Optional[float] = None
        while True:
            done = self._outcome()
            if done is not None:
                return done
            deadlines = [d for d in (start_deadline if not self.coordinator.epoch else None,
                                     late_deadline) if d is not None]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            try:
                event = self.events.get(timeout=timeout)
            except queue.Empty:
                if late_deadline is not None and time.monotonic() >= late_deadline:
                    return self._ended()
                if not self.coordinator.epoch:
                    return _Done(error=self._start_timeout_error())
                continue
            self._handle(event)
            if self._spark_ended and late_deadline is None:
                late_deadline = time.monotonic() + _driver.LATE_REPORT_S

    def _handle(self, event: tuple) -> None:
        kind = event[0]
        if kind == "worker":
            self.streams[event[1]] = event[2]
        elif kind == "report":
            worker, report = event[1], event[2]
            self.reports[worker] = report
            if _failures.ok(report):
                try:
                    self.results[worker] = _driver.read_result(self.store, self.streams[worker],
                                                               report, f"worker {worker}")
                    self.returned.append(worker)
                except SparkHvdError as e:
                    report["task_error"] = str(e)
            if not _failures.ok(report) and self.final is None and not self._aborting \
                    and self.verbose >= 1:
                self.logs.say(f"worker {worker} ended: {_failures.describe(report)}")
        elif kind == "spark_done":
            self._spark_ended = True
        elif kind == "spark_failed":
            self._spark_ended = True
            self.spark_error = event[1]

    def _outcome(self) -> Optional[_Done]:
        """The end of the job, or None while it goes on. Once the final epoch is known
        only its ranks matter (the coordinator may still have failed meanwhile, e.g. at
        its reset limit by re-forming with workers left waiting)."""
        if self.final is None:
            self.final = self._final_epoch()
        if self.final is None and self.coordinator.error is not None:
            return _Done(head=f"the elastic job failed: {self.coordinator.error}")
        if self.final is not None:
            members = self.final.workers
            for rank, worker in enumerate(members):
                report = self.reports.get(worker)
                if report is not None and not _failures.ok(report):
                    return _Done(head=f"worker {worker}, rank {rank} of the final epoch "
                                      f"{self.final.number}, failed after worker "
                                      f"{self.returned[0]} had returned: "
                                      f"{_failures.describe(report)}")
            if all(w in self.results for w in members):
                return _Done(results=[self.results[w] for w in members])
        if self.spark_error is not None:
            return _Done(head=f"the Spark job failed: "
                              f"{_failures.spark_failure(self.spark_error)}",
                         cause=self.spark_error)
        if self._spark_ended and self.final is None and self._all_reported():
            return self._ended()
        return None

    def _final_epoch(self) -> Optional[proto.Epoch]:
        """The last epoch the first worker to return was a rank of (a worker that
        returned without ever being one, e.g. one the job had no place for, does not
        count); stops the coordinator once it is known."""
        for worker in self.returned:
            for number in range(self.coordinator.epoch, 0, -1):
                epoch = proto.Epoch.from_bytes(
                    number, self.store.get(f"{proto.EPOCH}{number}", 0))
                if worker in epoch.workers:
                    self.coordinator.stop()
                    if self.verbose >= 2:
                        self.logs.say(f"worker {worker} returned: epoch {number} is the last")
                    return epoch
        return None

    def _all_reported(self) -> bool:
        """Whether every task that started a worker has reported."""
        return not self._unreported()

    def _unreported(self) -> List[int]:
        """The workers whose task started and has not reported."""
        started = (json.loads(self.store.get(key, 0))["worker"]
                   for key in self.store.keys(P.STREAM_PREFIX))
        return [w for w in started if w not in self.reports]

    def _ended(self) -> _Done:
        if self.final is not None:
            missing = [w for w in self.final.workers if w not in self.reports]
            return _Done(head=f"the Spark job ended without a report from "
                              f"{_failures.format_workers(missing)} of the final epoch "
                              f"{self.final.number} (the task was lost with its executor?)")
        if not self.coordinator.epoch:
            return _Done(head="every worker ended before the job formed its first epoch "
                              "(does fn call spark_hvd.init()?)")
        return _Done(head=f"every worker ended before the ranks of an epoch returned (last "
                          f"epoch: {self.coordinator.epoch})")

    def _start_timeout_error(self) -> CollectiveTimeoutError:
        asked = len(self.coordinator.alive())
        return CollectiveTimeoutError(
            f"{_PROG}: no epoch formed within start_timeout={self.spec.start_timeout_s:g} s: "
            f"{asked} workers asked for a place, the job needs num_proc={self.num_proc} (or "
            f"min_num_proc={self.min_num_proc} after start_timeout); the cluster may be busy "
            f"or short of task slots, or fn may not call spark_hvd.init(): raise "
            f"start_timeout or lower min_num_proc")

    def _finish(self) -> None:
        """Tell every task to stop its worker, and tasks not started yet not to start one."""
        self._aborting = True
        try:
            self.store.set(P.FINISH_KEY, b"1")
            for key in self.store.keys(P.STREAM_PREFIX):
                self.store.set(P.stop_key(key[len(P.STREAM_PREFIX):]), P.ABORT)
        except SparkHvdError:
            pass

    def _collect_reports(self) -> None:
        """The stopped workers' reports (for the error's details): until every worker
        that started has reported, or the Spark job has ended and every report has been
        read, at most kill_grace_s + REPORT_WAIT_S; once only workers the job lost are
        missing (cut off, they may never report), at most LOST_REPORT_S more."""
        deadline = time.monotonic() + self.spec.kill_grace_s + _driver.REPORT_WAIT_S
        shortened = False
        while True:
            missing = self._unreported()
            if not missing:
                return
            if not shortened and set(missing) <= self.coordinator.gone():
                deadline = min(deadline, time.monotonic() + _driver.LOST_REPORT_S)
                shortened = True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                self._handle(self.events.get(timeout=remaining))
            except queue.Empty:
                return
