"""What each rank's Spark barrier task does on its executor.

The task (rank = partition id) joins the job through the rendezvous service
(see :mod:`spark_hvd.spark._protocol` for the exchange), starts the user's
function in a child process (:mod:`spark_hvd.spark._child`) with the rank's
environment, streams the child's output to the driver, and reports how the
child ended.  It never raises for a failure of the function: the driver
decides what a failure means for the job.  It raises only when it cannot reach
the driver at all, so Spark fails the task.

The child runs in a session of its own: when the driver aborts the job, or the
task ends, the whole process tree of the rank is signalled (SIGTERM, then
SIGKILL).  When the Python worker itself is killed (Spark kills it when it
cancels a task), the child dies with it (see ``_child``).

An elastic job's task (:func:`run_worker`, a plain task, not a barrier one) does the
same for one worker: no rank, no host list to wait for; its child joins the job's
membership epochs itself (``spark_hvd.init()`` in an elastic job).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from queue import Queue
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

from spark_hvd._job import elastic as _elastic, env as _env
from spark_hvd._job.store import MAX_TIMEOUT_S
from spark_hvd._job.topology import assign
from spark_hvd.exceptions import InvalidArgumentError, SparkHvdError
from spark_hvd.runner import LineRouter, ProcessGroup, Sink
from spark_hvd.runner.rendezvous import RendezvousClient
from spark_hvd.spark import _child, _protocol as P

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
_UNBUFFERED = {"PYTHONUNBUFFERED": "1"}


@dataclass(frozen=True)
class TaskSpec:
    """Everything a rank's task needs; travels to the executors in the task closure."""

    addr: str
    port: int
    secret: bytes
    run_id: str
    size: int
    payload: bytes                  # cloudpickle of (fn, args, kwargs)
    env: Tuple[Tuple[str, str], ...]
    use_gpu: bool
    start_timeout_s: float
    kill_grace_s: float
    executable: str = ""            # the rank's Python; "": the executor's own
    elastic_timeout_s: float = 0.0  # > 0: an elastic job (size = its maximum of workers)

    @property
    def elastic(self) -> bool:
        return self.elastic_timeout_s > 0


def visible_devices(addresses: Iterable[str], existing: Optional[str]) -> str:
    """CUDA_VISIBLE_DEVICES for a rank given Spark's GPU ``addresses``.

    When the executor already has a CUDA_VISIBLE_DEVICES (``existing``), Spark's
    addresses are indices into that list and are mapped through it.

    >>> visible_devices(["1"], "3,5"), visible_devices(["0", "1"], None)
    ('5', '0,1')
    """
    addresses = [str(a).strip() for a in addresses]
    if existing is None or not existing.strip():
        return ",".join(addresses)
    ids = [d.strip() for d in existing.split(",") if d.strip()]
    mapped = []
    for a in addresses:
        try:
            index = int(a)
        except ValueError:
            index = -1
        if not 0 <= index < len(ids):
            raise InvalidArgumentError(
                f"Spark assigned GPU address {a!r} to this task, but the executor's "
                f"{CUDA_VISIBLE_DEVICES}={existing} has {len(ids)} entries: the addresses from "
                f"spark.executor.resource.gpu.discoveryScript must be indices into "
                f"{CUDA_VISIBLE_DEVICES} (0..{len(ids) - 1})")
        mapped.append(ids[index])
    return ",".join(mapped)


def _child_pythonpath(environ: Mapping[str, str]) -> str:
    """PYTHONPATH that lets the child import what this Python worker can.

    Spark adds --py-files and addPyFile() archives to the worker's sys.path, not
    to its environment; the interpreter's own directories are left out, and so are
    the directories its start-up adds from ``.pth`` files (:func:`_site_added`): the
    child's own start-up adds them again, after its site-packages.  On PYTHONPATH
    they would come first, and a module both places hold (an editable install's
    finder of another environment) would be imported from the wrong one.
    """
    own = tuple(os.path.realpath(p) + os.sep for p in {sys.prefix, sys.base_prefix,
                                                       sys.exec_prefix, sys.base_exec_prefix})
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))))
    added = _site_added()
    entries: List[str] = []
    given = environ.get("PYTHONPATH", "").split(os.pathsep)
    for p in [package_root] + given + sys.path:
        if not p or p in entries or not os.path.exists(p):
            continue
        if (os.path.realpath(p) + os.sep).startswith(own) or (
                p not in given and os.path.realpath(p) in added):
            continue
        entries.append(p)
    return os.pathsep.join(entries)


def _site_added() -> frozenset:
    """The real paths of the directories that ``.pth`` files in this interpreter's
    site-packages add to sys.path at start-up (``import`` lines and comments skipped)."""
    import site
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    added = set()
    for d in dirs + ([user] if user else []):
        try:
            names = sorted(n for n in os.listdir(d) if n.endswith(".pth"))
        except OSError:
            continue
        for name in names:
            try:
                with open(os.path.join(d, name), encoding="utf-8") as f:
                    lines = f.read().splitlines()
            except (OSError, UnicodeDecodeError):
                continue
            for line in lines:
                line = line.strip()
                if line and not line.startswith(("#", "import ", "import\t")):
                    added.add(os.path.realpath(os.path.join(d, line)))
    return frozenset(added)


class _Tagged(LineRouter):
    """Tags each line of one of the child's streams (``O``/``E``) for the driver."""

    def __init__(self, stream: bytes, sink: Sink) -> None:
        self._stream, self._sink = stream, sink

    def route(self, line: bytes):
        return [(self._sink, P.line(self._stream, line))]


class _LogStream:
    """A binary stream for :class:`Sink` that sends the task's output to the driver.

    One thread sends what has queued up as one ``log/<stream>/<seq>`` message, so
    lines reach the driver as soon as they are written, batched when they come fast.
    """

    def __init__(self, client: RendezvousClient, stream: P.Stream) -> None:
        self._client, self._stream = client, stream
        self._queue: "Queue[Optional[bytes]]" = Queue()
        self._seq = 0
        self.broken: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"spark_hvd-logs-{stream}")
        self._thread.start()

    def write(self, data: bytes) -> None:
        self._queue.put(data)

    def flush(self) -> None:
        pass

    def _send(self, message: bytes) -> None:
        if self.broken is None:
            try:
                self._client.set(P.log_key(self._stream, self._seq), message)
                self._seq += 1
            except SparkHvdError as e:  # the driver is gone: nobody to show the output to
                self.broken = e

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch, size = [item], len(item)
            while size < P.LOG_BATCH_BYTES and not self._queue.empty():
                item = self._queue.get_nowait()
                if item is None:
                    self._send(P.lines_message(batch))
                    return
                batch.append(item)
                size += len(item)
            self._send(P.lines_message(batch))

    def close(self, report: dict) -> None:
        """Send what is queued, then the final report."""
        self._queue.put(None)
        self._thread.join()
        self._send(P.report_message(report))


def _rank_vars(spec: TaskSpec, rank: int, hosts: List[str]) -> Dict[str, str]:
    return _env.rank_env(assign(hosts)[rank], spec.addr, spec.port, spec.secret, spec.run_id,
                         _env.CONTROLLER_GLOO, spec.start_timeout_s)


def _worker_vars(spec: TaskSpec, worker: int) -> Dict[str, str]:
    return _env.elastic_env(spec.addr, spec.port, spec.secret, spec.run_id, worker,
                            spec.elastic_timeout_s, spec.start_timeout_s)


def _child_env(spec: TaskSpec, job_vars: Mapping[str, str],
               resources: Mapping[str, object]) -> Dict[str, str]:
    """The child's environment: the executor's, the job's ``SPARK_HVD_*`` variables
    (``job_vars``), the user's ``env``, and the task's GPUs when they are pinned."""
    env = dict(os.environ)
    env.update(job_vars)
    env.update(_UNBUFFERED)
    env["PYTHONPATH"] = _child_pythonpath(os.environ)
    env.update(dict(spec.env))
    if spec.use_gpu:
        gpu = resources.get("gpu")
        if gpu is None or not getattr(gpu, "addresses", None):
            raise InvalidArgumentError(
                "use_gpu is on but Spark assigned no GPU to this task: set "
                "spark.task.resource.gpu.amount and the executors' "
                "spark.executor.resource.gpu.amount/discoveryScript")
        env[CUDA_VISIBLE_DEVICES] = visible_devices(gpu.addresses,
                                                    os.environ.get(CUDA_VISIBLE_DEVICES))
    return env


def _run_child(spec: TaskSpec, stream: P.Stream, env: Dict[str, str],
               client: RendezvousClient, logs: _LogStream, report: dict) -> None:
    workdir = tempfile.mkdtemp(prefix=f"spark_hvd_{stream}_")
    try:
        payload_path = os.path.join(workdir, "payload.pkl")
        result_path = os.path.join(workdir, "result.pkl")
        with open(payload_path, "wb") as f:
            f.write(spec.payload)
        group = ProcessGroup()
        lock = threading.Lock()
        child_done = False
        aborted = threading.Event()

        def watch_stop() -> None:
            try:
                value = client.get(P.stop_key(stream), MAX_TIMEOUT_S)
            except SparkHvdError:  # the driver is gone
                value = P.ABORT
            with lock:
                if value == P.ABORT and not child_done:
                    aborted.set()
                    group.shutdown(spec.kill_grace_s)

        sink = Sink(logs)
        try:
            proc = group.spawn(stream, [spec.executable or sys.executable,
                                        os.path.abspath(_child.__file__),
                                        payload_path, result_path, str(os.getpid())],
                               env, _Tagged(P.STDOUT, sink), _Tagged(P.STDERR, sink))
            threading.Thread(target=watch_stop, daemon=True,
                             name=f"spark_hvd-stop-{stream}").start()
            group.wait_first_failure()
            report["time"] = time.time()
        finally:
            with lock:
                child_done = True
            group.shutdown(spec.kill_grace_s)  # stray grandchildren too; joins the output
            try:
                client.set(P.stop_key(stream), P.DONE)  # releases watch_stop
            except SparkHvdError:
                pass
        report["returncode"] = proc.returncode
        report["aborted"] = aborted.is_set()
        if os.path.exists(result_path):
            with open(result_path, "rb") as f:
                record = pickle.load(f)
            value = record.pop("value", None)
            report["record"] = record
            if value is not None:
                parts = P.chunks(value)
                for i, part in enumerate(parts):
                    client.set(P.result_key(stream, i), part)
                report["chunks"] = len(parts)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _client(spec: TaskSpec) -> RendezvousClient:
    return RendezvousClient(spec.addr, spec.port, spec.secret, spec.run_id,
                            connect_timeout_s=min(spec.start_timeout_s, 60.0))


def _report_child(spec: TaskSpec, client: RendezvousClient, stream: P.Stream, report: dict,
                  prepare: Callable[[], Optional[Dict[str, str]]]) -> None:
    """Runs the child with the environment ``prepare()`` gives (None: the job is over,
    start none), streaming its output as ``stream``; the final report is sent whatever
    happens."""
    logs = _LogStream(client, stream)
    try:
        env = prepare()
        if env is None:
            report["aborted"] = True
            return
        _run_child(spec, stream, env, client, logs, report)
    except BaseException:
        report["task_error"] = traceback.format_exc()
        report["time"] = time.time()
    finally:
        logs.close(report)
        try:
            client.set(P.reported_key(stream), b"1")
        except SparkHvdError:  # the driver is gone
            pass


def run_rank(spec: TaskSpec, rank: int, resources: Mapping[str, object]) -> None:
    """The whole life of rank ``rank``'s task; reports to the driver, raises only when
    the driver cannot be reached."""
    client = _client(spec)
    try:
        if client.add(P.attempt_key(rank), 1) > 1:
            # Spark retried the task (or the stage): a rank cannot be resumed, and the
            # driver, which reads the attempt counter, reports the job as failed.
            return
        report: dict = {"rank": rank}

        def prepare() -> Optional[Dict[str, str]]:
            report["host"] = host = _env.hostname()
            client.set(P.host_key(rank), host.encode("utf-8"))
            start = client.get(P.START_KEY, spec.start_timeout_s + 60.0)
            if start == P.ABORT:
                return None
            return _child_env(spec, _rank_vars(spec, rank, json.loads(start)), resources)

        _report_child(spec, client, rank, report, prepare)
    finally:
        client.close()


def run_worker(spec: TaskSpec, partition: int, resources: Mapping[str, object]) -> None:
    """The whole life of an elastic job's task (partition ``partition``): one worker,
    which starts at once (see :mod:`spark_hvd.spark._protocol`); a Spark retry is a new
    worker. Reports to the driver, raises only when the driver cannot be reached."""
    client = _client(spec)
    try:
        stream = P.stream_id(partition, client.add(P.attempt_key(partition), 1))
        worker = client.add(_elastic.NEXT_WORKER, 1)
        host = _env.hostname()
        client.set(P.stream_key(stream), json.dumps({"worker": worker, "host": host}).encode())

        def prepare() -> Optional[Dict[str, str]]:
            if client.check([P.FINISH_KEY]):
                return None
            return _child_env(spec, _worker_vars(spec, worker), resources)

        _report_child(spec, client, stream, {"worker": worker, "host": host}, prepare)
    finally:
        client.close()


def _run_task(spec: TaskSpec, ctx) -> None:
    (run_worker if spec.elastic else run_rank)(spec, ctx.partitionId(), ctx.resources())


def _task_context(spec: TaskSpec):
    if spec.elastic:
        from pyspark import TaskContext

        return TaskContext.get()
    from pyspark import BarrierTaskContext

    return BarrierTaskContext.get()


def rdd_partition(spec: TaskSpec, iterator: Iterator) -> Iterator:
    """The function of ``rdd.barrier().mapPartitions`` (``rdd.mapPartitions`` for an
    elastic job)."""
    _run_task(spec, _task_context(spec))
    return iter(())


ARROW_SCHEMA = "rank int"


def arrow_partition(spec: TaskSpec, batches: Iterator) -> Iterator:
    """The function of ``DataFrame.mapInArrow(..., barrier=True)`` (``barrier=False``
    for an elastic job)."""
    import pyarrow as pa

    for _ in batches:  # one row of spark.range per task; read it so its writer is done
        pass
    ctx = _task_context(spec)
    _run_task(spec, ctx)
    yield pa.RecordBatch.from_pydict({"rank": pa.array([ctx.partitionId()], pa.int32())})
