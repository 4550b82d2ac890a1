"""The driver's parts of a launch, each with one job; ``run`` and ``run_elastic`` put
them together (their jobs in :mod:`spark_hvd.spark.runner` and
:mod:`spark_hvd.spark._elastic` only wait for the outcome and decide what it means).

- :class:`Output`: where the ranks' output lines go on the driver.
- :class:`SparkStage`: the launch's Spark job, in a thread of its own; cancelling it.
- :class:`LogReader`: one thread per task's stream, printing its output as it
  arrives and keeping its last lines; the stream's final report goes to the events.
- :class:`StartGate` (barrier launches): the start key, set once, to the host list
  when every rank has registered or to ABORT when the job is torn down first; and
  the stop keys that tell every task to stop its child.
- :func:`read_result`, :func:`attempts`: what the tasks left in the store.

The parts report to one ``events`` queue that the job's main thread reads:
``("spark_done",)``, ``("spark_failed", exc)``, ``("report", label, report)``, and
what the job's own threads add.
"""

from __future__ import annotations

import inspect
import json
import logging
import pickle
import queue
import sys
import threading
import time
from collections import deque
from functools import partial
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, TextIO, Tuple

from spark_hvd._job.store import MAX_TIMEOUT_S, InMemoryStore as Store
from spark_hvd.exceptions import CollectiveTimeoutError, InvalidArgumentError, SparkHvdError, \
    StoreError
from spark_hvd.spark import _checks, _protocol as P, _task

logger = logging.getLogger(__name__)

TAIL_LINES = 40
REPORT_WAIT_S = 10.0      # after an abort: how long the other ranks get to report
LATE_REPORT_S = 60.0      # after the Spark job ended: reports still on their way
LOST_REPORT_S = 2.0       # after an abort: for ranks the others named lost (a killed
#                           rank's task reports at once; a host cut off never does)
SPARK_END_WAIT_S = 30.0   # how long to wait for the Spark job to end once ranks are done
SUPERSEDED_CHECK_S = 5.0  # elastic: how often a silent stream checks for a task retry

Events = queue.Queue  # of tuples, as the module docstring says


def thread(target: Callable, *args: Any, name: str) -> threading.Thread:
    """A started daemon thread."""
    t = threading.Thread(target=target, args=args, daemon=True, name=name)
    t.start()
    return t


class Output:
    """Where the ranks' output lines go on the driver."""

    def __init__(self, out: Optional[TextIO], err: Optional[TextIO], timestamp: bool) -> None:
        self.out, self.err, self.timestamp = out, err, timestamp

    @classmethod
    def make(cls, stdout: Optional[TextIO], stderr: Optional[TextIO], verbose: int,
             timestamp: bool) -> "Output":
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


def _inheritable_thread(target, spark, name: str) -> threading.Thread:
    """A daemon thread that keeps the caller's job properties (pyspark's InheritableThread,
    told the session where it takes one: pyspark >= 4.0 needs it under Spark Connect)."""
    try:
        from pyspark.util import InheritableThread
    except ImportError:
        return threading.Thread(target=target, daemon=True, name=name)
    if "session" in inspect.signature(InheritableThread.__init__).parameters:
        return InheritableThread(target, session=spark, daemon=True, name=name)
    return InheritableThread(target, daemon=True, name=name)


class SparkStage:
    """The launch's Spark job: ``size`` tasks (a barrier stage, or plain tasks), run in
    a thread of its own under a job group (classic) or an operation tag (Spark
    Connect) so it can be cancelled; reports ``("spark_done",)`` or
    ``("spark_failed", exc)`` to ``events``."""

    def __init__(self, spark, spec: _task.TaskSpec, run_id: str, events: Events, *,
                 barrier: bool, prog: str, what: str) -> None:
        self.spark, self.spec, self.run_id, self.events = spark, spec, run_id, events
        self.barrier, self.prog, self.what = barrier, prog, what
        self.connect = _checks.is_connect(spark)
        self.tag = f"spark_hvd-{run_id}"
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = _inheritable_thread(self._run, self.spark, "spark_hvd-spark-stage")
        self._thread.start()

    def _run(self) -> None:
        try:
            n = self.spec.size
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
                sc.setJobGroup(self.tag, f"{self.prog}: {n} {self.what}, run {self.run_id}",
                               interruptOnCancel=True)
                sc.setLocalProperty("callSite.short", f"{self.prog}({n} {self.what})")
                rdd = sc.parallelize(range(n), n)
                rdd = rdd.barrier() if self.barrier else rdd
                rdd.mapPartitions(partial(_task.rdd_partition, self.spec)).collect()
            self.events.put(("spark_done",))
        except BaseException as e:  # noqa: B036 - handed to the main thread
            self.events.put(("spark_failed", e))

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def cancel(self) -> None:
        """Cancels the Spark job if it still runs, then waits (a while) for it to end."""
        if self._thread.is_alive():
            try:
                if self.connect:
                    self.spark.interruptTag(self.tag)
                else:
                    self.spark.sparkContext.cancelJobGroup(self.tag)
            except Exception as e:  # the session may be stopping too
                logger.warning("%s: cancelling Spark job group %s failed: %s", self.prog,
                               self.tag, e)
        self._thread.join(SPARK_END_WAIT_S)

    def wait_end(self) -> None:
        """Waits (a while) for the Spark job to end by itself, once every rank returned."""
        self._thread.join(SPARK_END_WAIT_S)
        if self._thread.is_alive():
            logger.warning("%s: every rank returned but the Spark job has not ended after "
                           "%g s", self.prog, SPARK_END_WAIT_S)


class LogReader:
    """Prints each task's output on the driver as it arrives, ``[label]`` in front of
    every line (``label_format`` of the rank or worker), keeps its last TAIL_LINES
    lines in ``tails``, and hands its final report to ``events`` as
    ``("report", label, report)``. Also prints the launcher's own lines (:meth:`say`)."""

    def __init__(self, store: Store, output: Output, events: Events, prog: str,
                 label_format: str = "{}") -> None:
        self.store, self.output, self.events, self.prog = store, output, events, prog
        self.label_format = label_format
        self.tails: Dict[int, Deque[str]] = {}
        self._print_lock = threading.Lock()

    def start(self, stream: P.Stream, label: int) -> threading.Thread:
        """Reads ``stream`` as ``label``'s in a thread of its own."""
        self.tails.setdefault(label, deque(maxlen=TAIL_LINES))
        return thread(self.read, stream, label, name=f"spark_hvd-rank-{label}-output")

    def read(self, stream: P.Stream, label: int,
             superseded: Optional[Callable[[], bool]] = None) -> None:
        """Prints ``stream``'s output as ``label``'s until its report. With
        ``superseded``, a stream that stays silent is given up when that says so
        (Spark started its task again)."""
        seq = 0
        tail = self.tails.setdefault(label, deque(maxlen=TAIL_LINES))
        while True:
            key = P.log_key(stream, seq)
            try:
                message = self.store.get(key, MAX_TIMEOUT_S if superseded is None
                                         else SUPERSEDED_CHECK_S)
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
                self.output.write(self.label_format.format(label), lines)

    def say(self, text: str) -> None:
        """One line of the launcher's own on stderr, between whole lines of the tasks."""
        with self._print_lock:
            sys.stderr.write(f"{self.prog}: {text}\n")
            sys.stderr.flush()


class StartGate:
    """The start key of a barrier launch, set exactly once: to the host list when
    every rank has registered (:meth:`open`), or to ABORT when the job is torn down
    first (:meth:`abort`, which also sets every rank's stop key)."""

    def __init__(self, store: Store, size: int) -> None:
        self.store, self.size = store, size
        self._lock = threading.Lock()
        self.aborting = False

    def wait_hosts(self, timeout_s: float) -> Tuple[Optional[List[str]], List[int]]:
        """Every rank's host once all registered: ``(hosts, [])``; ``(None, missing
        ranks)`` after ``timeout_s``; ``(None, [])`` when the store closed."""
        keys = [P.host_key(r) for r in range(self.size)]
        try:
            self.store.wait(keys, timeout_s)
            return [self.store.get(k, 0).decode("utf-8") for k in keys], []
        except CollectiveTimeoutError:
            return None, [r for r, k in enumerate(keys) if not self.store.check([k])]
        except SparkHvdError:  # the store closed: the job is over
            return None, []

    def open(self, hosts: List[str]) -> bool:
        """Lets the tasks start their children; False when the job is being torn down."""
        with self._lock:
            if self.aborting:
                return False
            self.store.set(P.START_KEY, json.dumps(hosts).encode("utf-8"))
            return True

    def abort(self) -> None:
        """Tell every task to stop its child (and tasks not started yet not to start one)."""
        with self._lock:
            self.aborting = True
            try:
                if not self.store.check([P.START_KEY]):
                    self.store.set(P.START_KEY, P.ABORT)
                for r in range(self.size):
                    self.store.set(P.stop_key(r), P.ABORT)
            except StoreError:
                pass


def read_result(store: Store, stream: P.Stream, report: dict, who: str) -> Any:
    """The return value ``stream``'s task stored in chunks before its report."""
    parts = []
    for i in range(report.get("chunks", 0)):
        key = P.result_key(stream, i)
        parts.append(store.get(key, REPORT_WAIT_S))
        store.delete(key)
    try:
        return pickle.loads(b"".join(parts))
    except Exception as e:
        raise SparkHvdError(f"the return value of {who} cannot be unpickled on the "
                            f"driver: {type(e).__name__}: {e}") from None


def attempts(store: Store, stream: P.Stream) -> int:
    """How many times Spark started the task of rank (or partition) ``stream``."""
    key = P.attempt_key(stream)
    try:
        return int(store.get(key, 0)) if store.check([key]) else 0
    except (SparkHvdError, ValueError):
        return 0


def reported(store: Store, streams: Sequence[P.Stream]) -> List[P.Stream]:
    """Those of ``streams`` whose task has sent its final report (read or not)."""
    return [s for s in streams if store.check([P.reported_key(s)])]
