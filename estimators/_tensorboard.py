"""Rank 0's TensorBoard event file: each epoch's loss and metrics under ``<run>/logs/``.

``tensorboard --logdir <store root>/runs`` then shows every run of a Store, one TensorBoard
run per ``run_id``.  An epoch is one event whose step is the epoch index (0 = the first
epoch, as Keras' TensorBoard callback and MLflow count) and whose tags are the history's
names (``loss``, ``accuracy``, ``val_loss``...).  A resumed or restarted run adds a new
event file to the same directory, holding the epochs it trains.

The file is encoded with TensorBoard's protos (``tensorboard.compat.proto``) in TFRecord
framing (:func:`record`: length, masked CRC-32C, data, masked CRC-32C), not through
``torch.utils.tensorboard.SummaryWriter`` or ``tensorboard.summary.Writer``: both open
files through TensorBoard's gfile, which imports all of TensorFlow when it is installed
(5-10 s and hundreds of MB in a torch rank).  Nor through TensorBoard's ``RecordWriter``:
importing it imports ``tensorboard.summary``, its gfile stub and boto3 (0.5-2 s on rank 0
before the first step, while every other rank waits).  Where the Store's filesystem can append
(local disks, DBFS, HDFS) each epoch's record is appended, so a running ``tensorboard``
follows the file; on object stores, which cannot append, the whole file (a few hundred
bytes per epoch) is rewritten after each epoch (``write_bytes_atomic``).

Optional: without the ``tensorboard`` package, :func:`open_events` says so in one line and
returns None, and training goes on without an event file.
"""

from __future__ import annotations

import logging
import os
import posixpath
import socket
import struct
import time
from typing import Any, Mapping, Optional, Tuple

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
    except ImportError as exc:
        line = (f"no TensorBoard event file for run '{run_id}': the tensorboard package does "
                f"not import ({exc}); pip install tensorboard to get one")
        if verbose:
            print(line, flush=True)
        else:
            logger.info("%s", line)
        return None
    return EpochEvents(store, run_id, event_pb2)


def _crc32c_table() -> Tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)  # Castagnoli, reflected
        table.append(crc)
    return tuple(table)


_CRC32C = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: CRC-32C of ``data``, rotated right by 15 bits plus a constant."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord: the length (uint64), its masked CRC, ``data``, its masked CRC (all
    little-endian)."""
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", masked_crc32c(length)) + data
            + struct.pack("<I", masked_crc32c(data)))


class EpochEvents:
    """One event file of a run, written as the epochs end (see the module docstring)."""

    def __init__(self, store: Any, run_id: str, event_pb2: Any) -> None:
        self.store, self._event_pb2 = store, event_pb2
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
        framed = record(event.SerializeToString())
        self._written += framed
        if self._append:
            try:
                with self.store.filesystem.open_append_stream(self.path) as f:
                    f.write(framed)
                return
            except NotImplementedError:  # pyarrow's ArrowNotImplementedError is one too
                self._append = False
        self.store.write_bytes_atomic(self.path, bytes(self._written))
