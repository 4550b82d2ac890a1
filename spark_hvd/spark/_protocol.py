"""What the driver and the ranks' Spark tasks say to each other through the rendezvous store.

One job has one :class:`~spark_hvd.runner.rendezvous.RendezvousServer`, so the keys
need no job prefix; they live under ``spark/`` apart from the keys the ranks'
``spark_hvd.init()`` uses (``<run id>/init<n>/...``).

The exchange, in order:

1. Each task counts its attempt (``attempt/<rank>``, so a Spark retry of a rank is
   refused), then registers its host (``host/<rank>``).
2. The driver waits until every rank has registered and sets ``start`` to the
   JSON list of hosts by rank (or to :data:`ABORT` when the job is being torn
   down); every task blocks on ``start``, so no Spark barrier() is needed.
3. A task streams its child's output as numbered messages ``log/<rank>/<seq>``
   (``L`` + lines, each line ``O`` or ``E`` for stdout or stderr + text + ``\\n``).
   The driver reads them in order with blocking gets and deletes each one.
4. When the child has exited, the task stores the pickled return value in
   ``result/<rank>/<i>`` chunks and ends its log with an ``X`` message: a pickled
   report (exit code, error record, chunk count), then sets ``reported/<rank>``.
   So once the Spark job has ended, a rank without ``reported/<rank>`` will never
   report (its task died, or was retried: ``attempt/<rank>`` > 1).
5. ``stop/<rank>`` tells a task to stop its child: the driver sets it to
   :data:`ABORT` when another rank failed, the task itself to :data:`DONE` when
   its child has ended (which releases the task's watcher thread).

An elastic job (``run_elastic``: plain tasks, one per possible worker) has no ranks
to key on: each task's output is a *stream* named ``<partition>.<attempt>``
(``attempt/<partition>`` counts the attempts; a retried task is a new worker).
Steps 3 to 5 hold with the stream in place of the rank; instead of 1 and 2:

1. The task takes a worker id (``__elastic__/next_worker``, the counter the elastic
   protocol allocates ids from), sets ``stream/<stream>`` to ``{"worker", "host"}``,
   then, unless ``finish`` is set, starts its child at once: the job's coordinator,
   not the driver's start key, decides when the workers train.
2. The driver sets ``finish`` when the job is over (done or failed), then
   ``stop/<stream>`` for every stream it finds: a task sees either its stop key or,
   having set its stream key after that scan, ``finish``.
"""

from __future__ import annotations

import pickle
from typing import Iterator, List, Tuple, Union

ABORT = b"abort"
DONE = b"done"

KIND_LINES = b"L"
KIND_REPORT = b"X"
STDOUT = b"O"
STDERR = b"E"

# A value of the store holds at most ~64 MiB; stay well below it.
RESULT_CHUNK_BYTES = 16 * 1024 * 1024
LOG_BATCH_BYTES = 256 * 1024
MAX_LINE_BYTES = 64 * 1024

START_KEY = "spark/start"
FINISH_KEY = "spark/finish"
STREAM_PREFIX = "spark/stream/"

Stream = Union[int, str]  # a rank, or an elastic task's stream id


def attempt_key(rank: int) -> str:
    return f"spark/attempt/{rank}"


def stream_id(partition: int, attempt: int) -> str:
    """An elastic task's stream: its partition and attempt."""
    return f"{partition}.{attempt}"


def stream_key(stream: str) -> str:
    return f"{STREAM_PREFIX}{stream}"


def host_key(rank: int) -> str:
    return f"spark/host/{rank}"


def log_key(rank: Stream, seq: int) -> str:
    return f"spark/log/{rank}/{seq}"


def result_key(rank: Stream, index: int) -> str:
    return f"spark/result/{rank}/{index}"


def reported_key(rank: Stream) -> str:
    return f"spark/reported/{rank}"


def stop_key(rank: Stream) -> str:
    return f"spark/stop/{rank}"


def line(stream: bytes, text: bytes) -> bytes:
    """One tagged output line (``text`` ends with a newline), cut to MAX_LINE_BYTES."""
    if len(text) > MAX_LINE_BYTES:
        text = text[:MAX_LINE_BYTES - 32] + b"... [line truncated]\n"
    return stream + text


def lines_message(tagged: List[bytes]) -> bytes:
    return KIND_LINES + b"".join(tagged)


def report_message(report: dict) -> bytes:
    return KIND_REPORT + pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL)


def parse_lines(body: bytes) -> Iterator[Tuple[bytes, str]]:
    """``(stream, text without newline)`` for each line of a KIND_LINES body."""
    for raw in body.split(b"\n")[:-1]:
        yield raw[:1], raw[1:].decode("utf-8", "replace")


def chunks(data: bytes) -> List[bytes]:
    return [data[i:i + RESULT_CHUNK_BYTES]
            for i in range(0, len(data), RESULT_CHUNK_BYTES)] or [b""]
