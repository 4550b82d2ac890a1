"""Rank 0's TensorBoard event file: each epoch's loss and metrics under ``<run>/logs/``.

``tensorboard --logdir <store root>/runs`` then shows every run of a Store, one TensorBoard
run per ``run_id``.  An epoch is one event whose step is the epoch index (0 = the first
epoch, as Keras' TensorBoard callback and MLflow count) and whose tags are the history's
names (``loss``, ``accuracy``, ``val_loss``...).  A resumed or restarted run adds a new
event file to the same directory, holding the epochs it trains.

The file is encoded with TensorBoard's own record framing and protos
(``tensorboard.summary.writer.record_writer``, ``tensorboard.compat.proto``), not through
``torch.utils.tensorboard.SummaryWriter`` or ``tensorboard.summary.Writer``: both open
files through TensorBoard's gfile, which imports all of TensorFlow when it is installed
(5-10 s and hundreds of MB in a torch rank).  Where the Store's filesystem can append
(local disks, DBFS, HDFS) each epoch's record is appended, so a running ``tensorboard``
follows the file; on object stores, which cannot append, the whole file (a few hundred
bytes per epoch) is rewritten after each epoch (``write_bytes_atomic``).

Optional: without the ``tensorboard`` package, :func:`open_events` says so in one line and
returns None, and training goes on without an event file.
"""

from __future__ import annotations

import io
import logging
import os
import posixpath
import socket
import time
from typing import Any, Mapping, Optional

logger = logging.getLogger(__name__)

EVENT_FILE_PREFIX = "events.out.tfevents"
# The first record of every event file: the event format's version.
FILE_VERSION = "brain.Event:2"


def open_events(store: Any, run_id: str, verbose: int) -> Optional["EpochEvents"]:
    """A new event file of ``run_id`` in ``store`` (None, and one line, without tensorboard).

    The line is printed with ``verbose`` (streamed to the driver like the progress lines),
    else logged."""
    try:
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter
    except ImportError as exc:
        line = (f"no TensorBoard event file for run '{run_id}': the tensorboard package does "
                f"not import ({exc}); pip install tensorboard to get one")
        if verbose:
            print(line, flush=True)
        else:
            logger.info("%s", line)
        return None
    return EpochEvents(store, run_id, event_pb2, RecordWriter)


class EpochEvents:
    """One event file of a run, written as the epochs end (see the module docstring)."""

    def __init__(self, store: Any, run_id: str, event_pb2: Any, record_writer: Any) -> None:
        self.store, self._event_pb2, self._record_writer = store, event_pb2, record_writer
        name = (f"{EVENT_FILE_PREFIX}.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.spark_hvd")
        self.path = posixpath.join(store.get_logs_path(run_id), name)
        self._written = bytearray()
        # Filesystems with directories (local, DBFS, HDFS) append; object stores cannot.
        self._append = not store.object_store
        if self._append:
            store.makedirs(posixpath.dirname(self.path))
        self._write(event_pb2.Event(wall_time=time.time(), file_version=FILE_VERSION))

    def add_epoch(self, epoch: int, logs: Mapping[str, float]) -> None:
        """The epoch's values (``epoch`` 0-based), one scalar each."""
        event = self._event_pb2.Event(wall_time=time.time(), step=int(epoch))
        for tag, value in logs.items():
            event.summary.value.add(tag=tag, simple_value=float(value))
        self._write(event)

    def _write(self, event: Any) -> None:
        buf = io.BytesIO()
        self._record_writer(buf).write(event.SerializeToString())
        record = buf.getvalue()
        self._written += record
        if self._append:
            try:
                with self.store.filesystem.open_append_stream(self.path) as f:
                    f.write(record)
                return
            except NotImplementedError:  # pyarrow's ArrowNotImplementedError is one too
                self._append = False
        self.store.write_bytes_atomic(self.path, bytes(self._written))
