"""Framing and signing of the rendezvous protocol (the server: spark_hvd.runner.rendezvous;
the client: spark_hvd._job.client).

Protocol, version 1 (all integers big-endian):

1. Frame: ``u32 length | payload``; ``1 <= length <= limit`` (64 MiB once the
   connection is authenticated, 64 KiB before).  ``payload[0]`` is the kind.
2. On connect the server sends ``HELLO``: ``kind=1 | b"SHVD" | u8 version |
   nonce[16]``; the nonce is fresh per connection.
3. The client sends ``REQUEST``: ``kind=2 | mac[32] | u64 seq | u8 op | args``
   and the server answers ``RESPONSE``: ``kind=3 | mac[32] | u64 seq | u8
   status | args``.  ``args`` is ``u32 count | (u32 len | bytes) * count``.
   ``mac = HMAC-SHA256(secret, kind | u16 len(run_id) | run_id | nonce |
   body)`` where body is everything after the mac.  ``seq`` starts at 1 and
   grows by exactly 1 per request, so a signed request replays neither on
   another connection (other nonce) nor on the same one (old seq); the kind
   byte keeps a response from being reflected as a request.
4. The first request must be ``AUTH``; until it succeeds nothing else is read.
   A connection that has not authenticated within a few seconds is closed, and
   so is the oldest unauthenticated one when too many are waiting; a client
   whose connection is closed before ``AUTH`` is answered connects again, after
   a random pause that doubles with each attempt.
5. A bad signature, a malformed frame or a wrong sequence number is answered
   with ``REFUSED``: ``kind=4 | u8 code | utf-8 message`` (code 8 for
   authentication, 7 otherwise) and the connection is closed.
6. A request that fails is answered with ``status`` = the error's code
   (spark_hvd.exceptions) and args ``message[, ranks]``, ranks comma-separated
   decimal (PeerLostError's lost ranks).
7. ``MGET`` (args ``timeout_ms | watch | key * n``) answers the n values in order
   once every key is set: one request and one reply per rank, whatever n is.
   ``watch`` is empty, or ``/`` and a registration group (``/`` alone: the
   default group); then, while keys are missing, a rank of that group that is
   or becomes lost fails it at once with PeerLostError naming the rank.
8. ``SETMGET`` (args ``timeout_ms | watch | key | value | key * n``) is a ``SET`` of
   ``key`` followed by an ``MGET`` of the n keys, in one request: a rank publishes its
   address and reads its peers' with one round trip (at init: ``REGISTER``, then one
   ``SETMGET`` per kind of connection).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import socket
import struct
from typing import List, Optional, Sequence

MAGIC = b"SHVD"
VERSION = 1
NONCE_BYTES = 16
MAC_BYTES = 32
MAX_FRAME_BYTES = 64 * 1024 * 1024
PRE_AUTH_MAX_FRAME_BYTES = 64 * 1024
# Room left in a frame for the mac, seq, op and argument headers.
FRAME_OVERHEAD_BYTES = 4096
MAX_VALUE_BYTES = MAX_FRAME_BYTES - FRAME_OVERHEAD_BYTES

_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")

OK = 0


class Kind(enum.IntEnum):
    HELLO = 1
    REQUEST = 2
    RESPONSE = 3
    REFUSED = 4


class Op(enum.IntEnum):
    AUTH = 1
    SET = 2
    GET = 3
    WAIT = 4
    CHECK = 5
    ADD = 6
    DELETE = 7
    KEYS = 8
    REGISTER = 9
    GOODBYE = 10
    LOST = 11
    MGET = 12
    SETMGET = 13


class ProtocolError(Exception):
    """A frame that does not follow the protocol (garbage, truncation, bad size)."""


class ConnectionClosed(ProtocolError):
    """The peer closed the connection (``mid_frame`` when it did so inside a frame)."""

    def __init__(self, message: str, mid_frame: bool = False) -> None:
        super().__init__(message)
        self.mid_frame = mid_frame


class BadSignature(ProtocolError):
    """A request or response whose HMAC does not verify."""


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def encode_args(args: Sequence[bytes]) -> bytes:
    parts = [_U32.pack(len(args))]
    for a in args:
        parts.append(_U32.pack(len(a)))
        parts.append(bytes(a))
    return b"".join(parts)


def decode_args(data: memoryview) -> List[bytes]:
    if len(data) < 4:
        raise ProtocolError("argument block shorter than its count")
    (count,) = _U32.unpack_from(data, 0)
    pos = 4
    out: List[bytes] = []
    for _ in range(count):
        if pos + 4 > len(data):
            raise ProtocolError("argument header past the end of the frame")
        (n,) = _U32.unpack_from(data, pos)
        pos += 4
        if pos + n > len(data):
            raise ProtocolError("argument past the end of the frame")
        out.append(bytes(data[pos:pos + n]))
        pos += n
    if pos != len(data):
        raise ProtocolError("trailing bytes after the arguments")
    return out


def _mac(secret: bytes, run_id: bytes, nonce: bytes, kind: Kind, body: bytes) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    h.update(bytes([kind]))
    h.update(struct.pack(">H", len(run_id)))
    h.update(run_id)
    h.update(nonce)
    h.update(body)
    return h.digest()


def frame(payload: bytes) -> bytes:
    return _U32.pack(len(payload)) + payload


def hello_frame(nonce: bytes) -> bytes:
    return frame(bytes([Kind.HELLO]) + MAGIC + bytes([VERSION]) + nonce)


def refused_frame(code: int, message: str) -> bytes:
    return frame(bytes([Kind.REFUSED, code]) + message.encode("utf-8", "replace"))


def signed_frame(kind: Kind, secret: bytes, run_id: bytes, nonce: bytes, seq: int,
                 code: int, args: Sequence[bytes]) -> bytes:
    """A REQUEST (code = op) or RESPONSE (code = status) frame."""
    body = _U64.pack(seq) + bytes([code]) + encode_args(args)
    return frame(bytes([kind]) + _mac(secret, run_id, nonce, kind, body) + body)


def parse_hello(payload: memoryview) -> bytes:
    if (len(payload) != 1 + len(MAGIC) + 1 + NONCE_BYTES or payload[0] != Kind.HELLO
            or bytes(payload[1:5]) != MAGIC):
        raise ProtocolError("the peer is not a spark_hvd rendezvous server (bad greeting)")
    if payload[5] != VERSION:
        raise ProtocolError(f"rendezvous protocol version {payload[5]} is not {VERSION}")
    return bytes(payload[6:])


def parse_signed(payload: memoryview, kind: Kind, secret: bytes, run_id: bytes,
                 nonce: bytes) -> tuple:
    """Verify a REQUEST/RESPONSE payload; returns ``(seq, code, args)``."""
    if len(payload) < 1 + MAC_BYTES + 8 + 1 + 4:
        raise ProtocolError(f"frame too short ({len(payload)} bytes)")
    if payload[0] != kind:
        raise ProtocolError(f"expected a frame of kind {kind.name}, got kind {payload[0]}")
    mac = bytes(payload[1:1 + MAC_BYTES])
    body = payload[1 + MAC_BYTES:]
    if not hmac.compare_digest(mac, _mac(secret, run_id, nonce, kind, body)):
        raise BadSignature("bad signature")
    (seq,) = _U64.unpack_from(body, 0)
    return seq, body[8], decode_args(body[9:])


def parse_refused(payload: memoryview) -> Optional[tuple]:
    """``(code, message)`` when the payload is a REFUSED frame, else None."""
    if len(payload) >= 2 and payload[0] == Kind.REFUSED:
        return payload[1], bytes(payload[2:]).decode("utf-8", "replace")
    return None


class FrameReader:
    """Reads one frame at a time from a socket, as its bytes arrive.

    On a non-blocking socket :meth:`read` takes what has arrived and returns None
    until the frame is complete, so one thread can read many connections; on a
    blocking socket it returns the whole frame.  It never reads past the frame.
    """

    def __init__(self) -> None:
        self._header = bytearray()
        self._body: Optional[bytearray] = None
        self._got = 0

    @property
    def mid_frame(self) -> bool:
        """Whether part of a frame has been read."""
        return bool(self._header)

    def read(self, sock: socket.socket, limit: int) -> Optional[memoryview]:
        """The payload once the frame is complete, else None (nothing more to read now).

        The length is checked against ``limit`` before anything is allocated.
        """
        try:
            while self._body is None:
                chunk = sock.recv(4 - len(self._header))
                if not chunk:
                    raise ConnectionClosed("connection closed by the peer",
                                           mid_frame=self.mid_frame)
                self._header += chunk
                if len(self._header) == 4:
                    (n,) = _U32.unpack(self._header)
                    if n == 0 or n > limit:
                        raise ProtocolError(f"frame length {n} outside 1..{limit} bytes")
                    self._body = bytearray(n)
            view = memoryview(self._body)
            while self._got < len(view):
                k = sock.recv_into(view[self._got:], min(len(view) - self._got, 1 << 20))
                if k == 0:
                    raise ConnectionClosed("connection closed by the peer", mid_frame=True)
                self._got += k
        except BlockingIOError:
            return None
        self._header, self._body, self._got = bytearray(), None, 0
        return view


def read_frame(sock: socket.socket, limit: int) -> memoryview:
    """Read one frame's payload from a blocking socket (its timeout applies to each read)."""
    payload = FrameReader().read(sock, limit)
    if payload is None:
        raise ProtocolError("read_frame needs a blocking socket")
    return payload
