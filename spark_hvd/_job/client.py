"""The client side of the rendezvous service (see :mod:`spark_hvd.runner.rendezvous`)."""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from collections import Counter
from typing import List, Optional, Sequence

from spark_hvd._job import wire as _wire
from spark_hvd._job.store import (DEFAULT_TIMEOUT_S, check_key, check_keys, check_timeout,
                                  check_value)
from spark_hvd._job.wire import Kind, Op
from spark_hvd.exceptions import (AuthenticationError, CollectiveTimeoutError,
                                  InvalidArgumentError, SparkHvdError, StoreError, from_code)

logger = logging.getLogger(__name__)

DEFAULT_CONNECT_TIMEOUT_S = 30.0
DEFAULT_REQUEST_TIMEOUT_S = 60.0
# A connection the server closes or resets before authenticating it is opened again,
# after a random pause of up to RETRY_BASE_S * 2**(attempt - 1) (at most RETRY_MAX_S):
# clients turned away together come back spread out, not together again.
HANDSHAKE_ATTEMPTS = 6
RETRY_BASE_S = 0.05
RETRY_MAX_S = 1.0


def _ms(timeout_s: float) -> bytes:
    return str(int(round(check_timeout(timeout_s) * 1000))).encode("ascii")


def _backoff(attempt: int) -> None:
    """Pause before connection attempt ``attempt + 1`` (full jitter)."""
    time.sleep(random.uniform(0.0, min(RETRY_MAX_S, RETRY_BASE_S * 2 ** (attempt - 1))))


def _ranks(result: List[bytes]) -> Optional[List[int]]:
    """The ranks a failed request's reply names (its second argument), if any."""
    try:
        return [int(r) for r in result[1].split(b",")] if len(result) > 1 and result[1] else None
    except ValueError:
        return None


class _Broken(Exception):
    """The transport failed; ``sent`` tells whether the request may have reached the server."""

    def __init__(self, message: str, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


class _Connection:
    """One authenticated connection to the server (not thread-safe).

    A server with too many connections authenticating closes the oldest, so a
    connection closed or reset before it is authenticated is opened again, up to
    ``HANDSHAKE_ATTEMPTS`` times with a jittered pause between; each retry counts in
    ``retries["handshake"]``.  A refused connect is not retried: on Linux a server
    whose backlog is full drops the SYN (the kernel resends it) rather than refuse, so
    a refusal means no server.
    """

    def __init__(self, addr: str, port: int, secret: bytes, run_id: bytes,
                 connect_timeout_s: float, retries: Counter) -> None:
        self.where = f"{addr}:{port}"
        self._secret, self._run_id = secret, run_id
        for attempt in range(1, HANDSHAKE_ATTEMPTS + 1):
            try:
                self._open(addr, port, connect_timeout_s)
                return
            except _Broken as e:
                logger.debug("the rendezvous server at %s closed connection attempt %d before "
                             "authenticating it: %s", self.where, attempt, e)
                if attempt == HANDSHAKE_ATTEMPTS:
                    raise StoreError(
                        f"the rendezvous server at {self.where} closed the connection before "
                        f"authenticating it, {attempt} times (last: {e}); it does so when "
                        f"more connections are authenticating at once than its max_pending "
                        f"(RendezvousServer, default 4096)") from None
                retries["handshake"] += 1
                _backoff(attempt)

    def _open(self, addr: str, port: int, connect_timeout_s: float) -> None:
        """Connect and authenticate; _Broken if the server closes the connection first."""
        self.closed = False
        try:
            self.sock = socket.create_connection((addr, port), timeout=connect_timeout_s)
        except socket.timeout:
            raise CollectiveTimeoutError(
                f"could not connect to the rendezvous server at {self.where} within "
                f"{connect_timeout_s:g} s") from None
        except socket.gaierror as e:
            raise StoreError(f"cannot resolve the rendezvous server address {self.where}: "
                             f"{e}") from None
        except (ConnectionResetError, ConnectionAbortedError) as e:
            raise _Broken(str(e), sent=False) from None
        except OSError as e:
            raise StoreError(f"could not connect to the rendezvous server at {self.where}: "
                             f"{e.strerror or e}; is the driver or launcher of this job "
                             f"still running?") from None
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.nonce = _wire.parse_hello(
                _wire.read_frame(self.sock, _wire.PRE_AUTH_MAX_FRAME_BYTES))
        except socket.timeout:
            self.close()
            raise CollectiveTimeoutError(f"the rendezvous server at {self.where} did not greet "
                                         f"within {connect_timeout_s:g} s") from None
        except (ConnectionError, _wire.ConnectionClosed) as e:
            self.close()
            raise _Broken(str(e), sent=False) from None
        except (OSError, _wire.ProtocolError) as e:
            self.close()
            raise StoreError(f"rendezvous handshake with {self.where} failed: {e}") from None
        self.seq = 0
        self.request(Op.AUTH, [], connect_timeout_s)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass

    def request(self, op: Op, args: Sequence[bytes], timeout_s: float) -> List[bytes]:
        """Send one request and read its response; server errors raise their exception."""
        if self.closed:
            raise _Broken("connection closed", sent=False)
        self.seq += 1
        data = _wire.signed_frame(Kind.REQUEST, self._secret, self._run_id, self.nonce,
                                  self.seq, op, args)
        try:
            self.sock.settimeout(timeout_s)
            self.sock.sendall(data)
        except OSError as e:
            self.close()
            raise _Broken(str(e), sent=False) from None
        try:
            payload = _wire.read_frame(self.sock, _wire.MAX_FRAME_BYTES)
        except socket.timeout:
            self.close()
            raise CollectiveTimeoutError(f"no reply from the rendezvous server at {self.where} "
                                         f"to {op.name} within {timeout_s:g} s") from None
        except (OSError, _wire.ConnectionClosed) as e:
            self.close()
            raise _Broken(str(e), sent=True) from None
        except _wire.ProtocolError as e:
            self.close()
            raise StoreError(f"bad reply from the rendezvous server at {self.where}: {e}") from None
        refused = _wire.parse_refused(payload)
        if refused is not None:
            self.close()
            code, message = refused
            cls = AuthenticationError if code == AuthenticationError.code else StoreError
            raise cls(f"the rendezvous server at {self.where} refused {op.name}: {message}")
        try:
            seq, status, result = _wire.parse_signed(payload, Kind.RESPONSE, self._secret,
                                                     self._run_id, self.nonce)
        except _wire.BadSignature:
            self.close()
            raise AuthenticationError(f"the reply from {self.where} is not signed with this "
                                      f"job's secret") from None
        except _wire.ProtocolError as e:
            self.close()
            raise StoreError(f"bad reply from the rendezvous server at {self.where}: {e}") from None
        if seq != self.seq:
            self.close()
            raise StoreError(f"reply {seq} from {self.where} does not match request {self.seq}")
        if status != _wire.OK:
            message = result[0].decode("utf-8", "replace") if result else ""
            raise from_code(status, message, ranks=_ranks(result))
        return result


class RendezvousClient:
    """A thread-safe client of a :class:`RendezvousServer`.

    Connects and authenticates in the constructor (AuthenticationError for a wrong
    secret or run id, StoreError/CollectiveTimeoutError naming ``addr:port`` when the
    server cannot be reached).  Each calling thread borrows a pooled connection, so a
    ``get`` blocked in one thread never holds up a ``set`` from another.  A broken
    connection is replaced once and the request retried, except ``add`` when the
    request may already have been applied.
    """

    def __init__(self, addr: str, port: int, secret: bytes, run_id: str,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> None:
        self.addr, self.port = addr, int(port)
        self._secret = bytes(secret)
        self._run_id = run_id.encode("utf-8")
        self._connect_timeout_s = check_timeout(connect_timeout_s)
        self._request_timeout_s = check_timeout(request_timeout_s)
        self._lock = threading.Lock()
        # Requests sent, by operation name (SET, GET, ...): what a rank costs the service,
        # read by bench/scale.py and the tests of the rendezvous' growth.
        self.requests: Counter = Counter()
        # What had to be tried again: "handshake" (a connection closed or reset before it
        # authenticated), "request" (a request sent again on a new connection).
        self.retries: Counter = Counter()
        self._idle: List[_Connection] = [self._connect()]
        self._registration: Optional[_Connection] = None
        self._group = ""
        self._closed = False

    def _connect(self) -> _Connection:
        return _Connection(self.addr, self.port, self._secret, self._run_id,
                           self._connect_timeout_s, self.retries)

    def _checkout(self) -> _Connection:
        with self._lock:
            if self._closed:
                raise StoreError(f"the rendezvous client of {self.addr}:{self.port} is closed")
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def _checkin(self, conn: _Connection) -> None:
        with self._lock:
            if not self._closed and not conn.closed:
                self._idle.append(conn)
                return
        conn.close()

    def _call(self, op: Op, args: Sequence[bytes], wait_s: float = 0.0,
              idempotent: bool = True) -> List[bytes]:
        self.requests[op.name] += 1
        conn = self._checkout()
        timeout_s = wait_s + self._request_timeout_s
        try:
            try:
                return conn.request(op, args, timeout_s)
            except _Broken as e:
                if e.sent and not idempotent:
                    raise StoreError(f"the connection to the rendezvous server at "
                                     f"{conn.where} broke during {op.name}: {e}") from None
                self.retries["request"] += 1
                conn = self._connect()
                try:
                    return conn.request(op, args, timeout_s)
                except _Broken as e2:
                    raise StoreError(f"lost the connection to the rendezvous server at "
                                     f"{conn.where} during {op.name}: {e2}") from None
        finally:
            self._checkin(conn)

    # -- store operations ------------------------------------------------------------

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` (at most ~64 MiB) under ``key``."""
        value = check_value(value)
        if len(value) > _wire.MAX_VALUE_BYTES:
            raise InvalidArgumentError(f"value of {key!r} is {len(value)} bytes; the rendezvous "
                                       f"store takes at most {_wire.MAX_VALUE_BYTES}")
        self._call(Op.SET, [check_key(key).encode("utf-8"), value])

    def get(self, key: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bytes:
        """The value of ``key``, waiting on the server until it is set.

        Raises CollectiveTimeoutError naming the key and the timeout.
        """
        return self._call(Op.GET, [check_key(key).encode("utf-8"), _ms(timeout_s)],
                          wait_s=timeout_s)[0]

    def get_many(self, keys: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S,
                 watch_lost: bool = False) -> List[bytes]:
        """The values of ``keys`` in their order, in one request (MGET) that waits on the
        server until every key is set.

        With ``watch_lost``, a rank of this client's registration group (the group
        :meth:`lost_ranks` answers for) that is lost, or is lost during the wait, ends
        it at once.  Values of all keys together travel in one reply: at most ~64 MiB.

        Raises
        ------
        CollectiveTimeoutError
            when keys are still missing after ``timeout_s``, naming them.
        PeerLostError
            with ``watch_lost``, while keys are missing and a rank is lost; ``ranks``
            names the lost ranks, the message them and the missing keys.
        """
        return self._read_many(Op.MGET, [], keys, timeout_s, watch_lost)

    def set_and_get_many(self, key: str, value: bytes, keys: Sequence[str],
                         timeout_s: float = DEFAULT_TIMEOUT_S,
                         watch_lost: bool = False) -> List[bytes]:
        """:meth:`set` of ``key`` then :meth:`get_many` of ``keys``, in one request
        (SETMGET): what a rank does at init to publish its address and read its peers'.
        Raises as both do."""
        value = check_value(value)
        return self._read_many(Op.SETMGET, [check_key(key).encode("utf-8"), value], keys,
                               timeout_s, watch_lost)

    def _read_many(self, op: Op, publish: List[bytes], keys: Sequence[str], timeout_s: float,
                   watch_lost: bool) -> List[bytes]:
        """MGET (``publish`` empty) or SETMGET (``publish``: the key and its value) of
        ``keys``, checked as both take them."""
        encoded = [k.encode("utf-8") for k in check_keys(keys)]
        value_bytes = len(publish[1]) if publish else 0
        if value_bytes + sum(len(k) + 4 for k in encoded) > _wire.MAX_VALUE_BYTES:
            raise InvalidArgumentError(
                (f"a value of {value_bytes} bytes and " if publish else "")
                + f"{len(encoded)} keys take more than one request carries "
                f"({_wire.MAX_VALUE_BYTES} bytes); ask for fewer")
        if not isinstance(watch_lost, bool):
            raise InvalidArgumentError(f"watch_lost must be a bool, got {watch_lost!r}")
        watch = b"/" + self._group.encode("utf-8") if watch_lost else b""
        values = self._call(op, [_ms(timeout_s), watch] + publish + encoded, wait_s=timeout_s)
        if len(values) != len(encoded):
            raise StoreError(f"the rendezvous server at {self.addr}:{self.port} answered "
                             f"{len(values)} values to {'an' if op == Op.MGET else 'a'} "
                             f"{op.name} of {len(encoded)} keys")
        return values

    def wait(self, keys: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Block until every key is set (CollectiveTimeoutError after ``timeout_s``)."""
        self._call(Op.WAIT, [_ms(timeout_s)] + [k.encode("utf-8") for k in check_keys(keys)],
                   wait_s=timeout_s)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key is set; never blocks."""
        return self._call(Op.CHECK, [k.encode("utf-8") for k in check_keys(keys)])[0] == b"1"

    def add(self, key: str, amount: int = 1) -> int:
        """Atomically add ``amount`` to the counter ``key``; returns the new value."""
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise InvalidArgumentError(f"add() needs an int amount, got {amount!r}")
        result = self._call(Op.ADD, [check_key(key).encode("utf-8"), str(amount).encode()],
                            idempotent=False)
        return int(result[0])

    def delete(self, key: str) -> bool:
        """Remove ``key``; returns whether it existed."""
        return self._call(Op.DELETE, [check_key(key).encode("utf-8")])[0] == b"1"

    def keys(self, prefix: str = "") -> List[str]:
        """The keys starting with ``prefix``, sorted."""
        if not isinstance(prefix, str):
            raise InvalidArgumentError(f"prefix must be a str, got {prefix!r}")
        return [k.decode("utf-8") for k in self._call(Op.KEYS, [prefix.encode("utf-8")])]

    # -- ranks -----------------------------------------------------------------------

    def register_rank(self, rank: int, host: Optional[str] = None, group: str = "") -> None:
        """Register ``rank`` on a dedicated connection the server watches.

        If that connection drops before :meth:`close`, the server records the rank as
        lost.  ``host`` (default: :meth:`local_address`) is stored as ``__host__/<rank>``.
        ``group`` (no ``/``) gives the rank numbers a namespace of their own (an elastic
        job's workers, each of its membership epochs); :meth:`lost_ranks` then answers
        for that group.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise InvalidArgumentError(f"rank must be an int >= 0, got {rank!r}")
        if not isinstance(group, str) or "/" in group:
            raise InvalidArgumentError(f"group must be a str without '/', got {group!r}")
        conn = self._connect()
        try:
            host = host if host is not None else conn.sock.getsockname()[0]
            args = [str(rank).encode(), host.encode("utf-8")]
            self.requests[Op.REGISTER.name] += 1
            conn.request(Op.REGISTER, args + [group.encode("utf-8")] if group else args,
                         self._request_timeout_s)
        except BaseException:
            conn.close()
            raise
        with self._lock:
            old, self._registration, self._group = self._registration, conn, group
        if old is not None:
            old.close()

    def lost_ranks(self) -> List[int]:
        """Ranks of this client's registration group the server has recorded as lost."""
        group = self._group
        return [int(r) for r in self._call(Op.LOST, [group.encode("utf-8")] if group else [])]

    def local_address(self) -> str:
        """This side's IP address on the route to the server: where other ranks reach us."""
        conn = self._checkout()
        try:
            return conn.sock.getsockname()[0]
        finally:
            self._checkin(conn)

    def close(self) -> None:
        """Say goodbye on the registration connection (so the rank is not lost) and close."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle, self._idle = self._idle, []
            registration, self._registration = self._registration, None
        if registration is not None:
            try:
                registration.request(Op.GOODBYE, [], self._request_timeout_s)
            except (SparkHvdError, _Broken) as e:
                logger.debug("rendezvous goodbye failed: %s", e)
            registration.close()
        for conn in idle:
            conn.close()

    def __enter__(self) -> "RendezvousClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
