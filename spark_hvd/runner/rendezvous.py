"""The job's rendezvous service: a signed key-value store over TCP.

The driver (or ``spark-hvdrun``) runs one :class:`RendezvousServer` per job;
ranks reach it with a :class:`RendezvousClient`.  Collective backends exchange
their connection addresses through it, ranks register their hosts, and a
rank whose registration connection drops without a goodbye is recorded as
lost (``lost_ranks()`` and the key ``__lost__/<rank>``).

What a rank costs the service does not grow with the job: it publishes its
keys (a SET each) and reads what it needs in one ``MGET``, which waits on the
server for every key and, when it watches the rank's registration group, fails
at once when a rank of it is lost; the store wakes a blocked request only when
its keys are all set (:mod:`spark_hvd._job.store`), so N ranks cost O(N)
requests and O(N) wake-ups in all.

The wire protocol is described in :mod:`spark_hvd._job.wire`.  Every
request is signed with HMAC-SHA256 under the job's secret, bound to the run id,
a per-connection server nonce and a sequence number.

The server may listen on every interface, so it bounds what anyone who can
reach it costs (:mod:`spark_hvd.runner._connections`): one thread watches all
connections; at most ``max_pending`` may be authenticating, each for at most
``handshake_timeout_s``; at most ``max_connections`` may be authenticated; a
thread is taken only while a request runs; and warnings a peer can trigger are
logged at most once per ``warning_interval_s`` for each reason.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Dict, List, Optional, Set, Tuple

from spark_hvd._job import wire as _wire
from spark_hvd._job.client import (DEFAULT_CONNECT_TIMEOUT_S,  # noqa: F401 (re-exported)
                                   DEFAULT_REQUEST_TIMEOUT_S, RendezvousClient)
from spark_hvd._job.store import DEFAULT_TIMEOUT_S, InMemoryStore
from spark_hvd._job.wire import Kind, Op
from spark_hvd.exceptions import (AuthenticationError, InvalidArgumentError, SparkHvdError,
                                  StoreError)
from spark_hvd.runner._connections import Connection, ConnectionLoop
from spark_hvd.runner._ratelimit import DEFAULT_INTERVAL_S as DEFAULT_WARNING_INTERVAL_S
from spark_hvd.runner._ratelimit import RateLimitedLog

__all__ = ["RendezvousServer", "RendezvousClient", "LOST_KEY_PREFIX", "HOST_KEY_PREFIX"]

logger = logging.getLogger(__name__)

SECRET_BYTES = 32
LOST_KEY_PREFIX = "__lost__/"
HOST_KEY_PREFIX = "__host__/"
DEFAULT_FRAME_TIMEOUT_S = 30.0
# A client authenticates one round trip after connecting.
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0
# Authenticated connections: a rank holds about three (twice that under Spark), so
# thousands of ranks fit; the limit stops a client that leaks connections.
DEFAULT_MAX_CONNECTIONS = 16384
# Connections still authenticating: thousands of ranks connecting at once pass (each
# needs only a round trip, within the handshake deadline), while a flood holds at most
# this many descriptors (the oldest is closed beyond it; its client connects again).
DEFAULT_MAX_PENDING = 4096
# Connections the kernel holds until they are accepted (capped by net.core.somaxconn);
# they cost the server no descriptor, and a burst of ranks connecting at once fits.
_BACKLOG = 4096
_SOMAXCONN = "/proc/sys/net/core/somaxconn"
_JOIN_TIMEOUT_S = 5.0


def _keepalive(sock: socket.socket) -> None:
    """Let the kernel notice a peer host that vanished without closing its socket."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _backlog_cap() -> Optional[int]:
    """The kernel's cap on a listen backlog (Linux: net.core.somaxconn); None if unknown."""
    try:
        with open(_SOMAXCONN) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


class _ConnState(Connection):
    """A connection and what the protocol knows about it."""

    def __init__(self, sock: socket.socket, peer: str, deadline: float) -> None:
        super().__init__(sock, peer, deadline)
        self.nonce = _wire.new_nonce()
        self.next_seq = 1
        self.rank: Optional[int] = None
        self.group = ""
        self.goodbye = False


class RendezvousServer:
    """The key-value store server of one job.

    Parameters
    ----------
    host, port:
        Where to listen; port 0 picks a free port.  The socket is bound once in
        :meth:`start` and kept open until :meth:`stop`.
    secret:
        The HMAC key every request must be signed with; 32 random bytes if None.
    run_id:
        Identifies the job; bound into every signature.  Random hex if None.
    frame_timeout_s:
        Once a frame has begun, how long the server waits for each further piece
        of it before dropping the connection.
    handshake_timeout_s:
        How long a new connection has to authenticate before it is closed.
    max_connections:
        How many authenticated connections are served at once; one more is refused.
    max_pending:
        How many connections may be authenticating at once; one more closes the oldest.
    warning_interval_s:
        The least time between two warnings for the same reason (refused requests,
        dropped connections); the next one says how many were held back.
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 0, secret: Optional[bytes] = None,
                 run_id: Optional[str] = None,
                 frame_timeout_s: float = DEFAULT_FRAME_TIMEOUT_S,
                 handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 max_pending: int = DEFAULT_MAX_PENDING,
                 warning_interval_s: float = DEFAULT_WARNING_INTERVAL_S) -> None:
        if secret is not None and (not isinstance(secret, bytes) or not secret):
            raise InvalidArgumentError("secret must be non-empty bytes")
        if max_connections < 1 or max_pending < 1:
            raise InvalidArgumentError(f"max_connections ({max_connections}) and max_pending "
                                       f"({max_pending}) must be at least 1")
        self.secret: bytes = secret if secret is not None else os.urandom(SECRET_BYTES)
        self.run_id: str = run_id if run_id is not None else os.urandom(8).hex()
        self._run_id_b = self.run_id.encode("utf-8")
        self._requested = (host, int(port))
        self._limits = dict(max_connections=max_connections, max_pending=max_pending,
                            handshake_timeout_s=handshake_timeout_s,
                            frame_timeout_s=frame_timeout_s)
        self._warn = RateLimitedLog(logger, warning_interval_s).warning
        self.host: Optional[str] = None
        self.port: Optional[int] = None
        self.store = InMemoryStore(f"the rendezvous store of run {self.run_id}")
        self._lock = threading.Lock()
        self._lsock: Optional[socket.socket] = None
        self._conns: Optional[ConnectionLoop] = None
        # Registrations are per group: "" for a fixed job's ranks; an elastic job
        # registers its workers and each membership epoch's ranks in groups of their own.
        self._lost: Set[Tuple[str, int]] = set()
        self._left: Set[Tuple[str, int]] = set()  # ended their registration with a goodbye
        self._rank_owner: Dict[Tuple[str, int], _ConnState] = {}
        self._stopping = False

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> Tuple[str, int]:
        """Bind, listen and serve in daemon threads; returns the ``(host, port)`` bound."""
        with self._lock:
            if self._stopping:
                raise StoreError("a stopped RendezvousServer cannot be restarted")
            if self._lsock is not None:
                return self.host, self.port
            host, port = self._requested
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                        flags=socket.AI_PASSIVE)[0][0]
            try:
                dualstack = family == socket.AF_INET6 and host in ("::", "") \
                    and socket.has_dualstack_ipv6()  # "::" serves IPv4 clients too
                self._lsock = socket.create_server((host, port), family=family, backlog=_BACKLOG,
                                                   dualstack_ipv6=dualstack)
            except OSError as e:
                raise StoreError(f"rendezvous server cannot listen on {host}:{port}: {e}") from e
            self.host, self.port = self._lsock.getsockname()[:2]
            cap = _backlog_cap()
            if cap is not None and cap < _BACKLOG:
                logger.info("rendezvous server: net.core.somaxconn (%d) caps the listen "
                            "backlog below %d; more ranks than that connecting at once wait "
                            "for the kernel to resend their SYN (sysctl -w "
                            "net.core.somaxconn=%d)", cap, _BACKLOG, _BACKLOG)
            self._conns = ConnectionLoop(
                self._lsock, new_connection=_ConnState, on_accepted=self._greet,
                on_frame=self._on_frame, on_bad_frame=self._on_bad_frame,
                on_closed=self._connection_ended, warn=self._warn, **self._limits)
            self._conns.start()
            logger.debug("rendezvous server for run %s listening on %s:%s",
                         self.run_id, self.host, self.port)
            return self.host, self.port

    def stop(self) -> None:
        """Stop accepting, wake blocked requests, close every connection, join threads."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            started = self._lsock is not None
        self.store.close()
        if not started:
            return
        self._conns.stop(_JOIN_TIMEOUT_S)
        self._lsock.close()

    def __enter__(self) -> "RendezvousServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- in-process access for the launcher ----------------------------------------

    def lost_ranks(self, group: str = "") -> List[int]:
        """Ranks of ``group`` whose registration connection dropped without a goodbye."""
        with self._lock:
            return sorted(r for g, r in self._lost if g == group)

    def rank_ended(self, rank: int, group: str = "", why: str = "its process ended") -> None:
        """A launcher's news that ``rank``'s process has ended. A rank that is not
        registered and never said goodbye is lost from now on: one that ended before
        init() registered it (the others' init then fails naming it, rather than waiting
        out the start timeout). A registered one is judged by its connection, as always."""
        key = (group, rank)
        with self._lock:
            if self._stopping or key in self._rank_owner or key in self._left or \
                    key in self._lost:
                return
            self._lost.add(key)
        logger.info("rendezvous: rank %d%s ended (%s) without registering", rank,
                    f" of {group}" if group else "", why)
        try:
            self.store.set(f"{LOST_KEY_PREFIX}{_group_path(group)}{rank}",
                           f"{why} before it registered".encode())
        except StoreError:
            pass

    def registered_ranks(self, group: str = "") -> List[int]:
        """Ranks of ``group`` registered now (their connection open, no goodbye yet)."""
        with self._lock:
            return sorted(r for (g, r), conn in self._rank_owner.items()
                          if g == group and not conn.goodbye)

    def connection_counts(self) -> Tuple[int, int]:
        """``(authenticated, authenticating)`` connections now; ``(0, 0)`` before start."""
        return self._conns.counts() if self._conns is not None else (0, 0)

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bytes:
        return self.store.get(key, timeout_s)

    # -- the protocol, in the connection loop's thread -------------------------------

    def _greet(self, conn: _ConnState) -> None:
        self._conns.send_now(conn, _wire.hello_frame(conn.nonce))

    def _refuse(self, conn: _ConnState, code: int, reason: str, message: str) -> None:
        self._warn(reason, "%s refused a request from %s: %s", self._conns.where, conn.peer,
                   message)
        try:
            conn.sock.send(_wire.refused_frame(code, message))  # best effort, never blocks
        except OSError:
            pass
        self._conns.close(conn)

    def _on_bad_frame(self, conn: _ConnState, error: _wire.ProtocolError) -> None:
        self._refuse(conn, StoreError.code, "malformed frame", f"malformed frame: {error}")

    def _on_frame(self, conn: _ConnState, payload: memoryview) -> None:
        try:
            seq, op, args = _wire.parse_signed(payload, Kind.REQUEST, self.secret,
                                               self._run_id_b, conn.nonce)
        except _wire.BadSignature:
            return self._refuse(conn, AuthenticationError.code, "bad signature",
                                f"request not signed with the secret of run {self.run_id} "
                                f"(wrong secret or run id)")
        except _wire.ProtocolError as e:
            return self._refuse(conn, StoreError.code, "malformed request",
                                f"malformed request: {e}")
        if seq != conn.next_seq:
            return self._refuse(conn, AuthenticationError.code, "bad sequence",
                                f"request sequence {seq}, expected {conn.next_seq} "
                                f"(replayed or reordered request)")
        conn.next_seq += 1
        if conn.authenticated:
            self._conns.to_worker(conn, lambda: self._run_request(conn, seq, op, args))
        elif op != Op.AUTH or args:
            self._refuse(conn, AuthenticationError.code, "no authentication",
                         "the first request must authenticate (AUTH, without arguments)")
        elif not self._conns.authenticate(conn):
            n = self._limits["max_connections"]
            self._refuse(conn, StoreError.code, "too many connections",
                         f"it already serves {n} connections, its limit (RendezvousServer "
                         f"max_connections={n}); a client may be leaking connections")
        else:
            self._conns.send_now(conn, self._response(conn, seq, _wire.OK, []))

    def _response(self, conn: _ConnState, seq: int, status: int, args: List[bytes]) -> bytes:
        return _wire.signed_frame(Kind.RESPONSE, self.secret, self._run_id_b, conn.nonce, seq,
                                  status, args)

    def _connection_ended(self, state: _ConnState) -> None:
        with self._lock:
            rank, key = state.rank, (state.group, state.rank)
            if rank is None or self._stopping or self._rank_owner.get(key) is not state:
                return
            del self._rank_owner[key]
            if state.goodbye:
                self._left.add(key)
                return
            self._lost.add(key)
        logger.info("rendezvous: rank %d%s (%s) lost its connection without a goodbye",
                    rank, f" of {state.group}" if state.group else "", state.peer)
        try:
            self.store.set(f"{LOST_KEY_PREFIX}{_group_path(state.group)}{rank}",
                           f"connection from {state.peer} dropped".encode())
        except StoreError:
            pass

    # -- requests, in worker threads -------------------------------------------------

    def _run_request(self, conn: _ConnState, seq: int, op: int, args: List[bytes]) -> None:
        try:
            status, result = _wire.OK, self._dispatch(conn, op, args)
        except SparkHvdError as e:
            status, result = e.code, [e.message.encode("utf-8", "replace")]
            if e.ranks:  # the evidence travels: PeerLostError's lost ranks
                result.append(",".join(map(str, e.ranks)).encode("ascii"))
        try:
            conn.sock.sendall(self._response(conn, seq, status, result))
        except OSError as e:
            logger.debug("rendezvous connection from %s ended: %s", conn.peer, e)
            conn.done = True
        if op == Op.GOODBYE:
            conn.done = True

    def _dispatch(self, state: _ConnState, op: int, args: List[bytes]) -> List[bytes]:
        def need(n: int) -> None:
            if len(args) != n:
                raise InvalidArgumentError(f"op {op} takes {n} arguments, got {len(args)}")

        text, number = _text, _number
        store = self.store
        if op == Op.AUTH:  # again: already authenticated
            need(0)
            return []
        if op == Op.SET:
            need(2)
            store.set(text(args[0]), args[1])
            return []
        if op == Op.GET:
            need(2)
            return [store.get(text(args[0]), number(args[1]) / 1000.0)]
        if op == Op.WAIT:
            if not args:
                raise InvalidArgumentError("WAIT needs a timeout")
            store.wait([text(a) for a in args[1:]], number(args[0]) / 1000.0)
            return []
        if op == Op.CHECK:
            return [b"1" if store.check([text(a) for a in args]) else b"0"]
        if op == Op.ADD:
            need(2)
            return [str(store.add(text(args[0]), number(args[1]))).encode("ascii")]
        if op == Op.DELETE:
            need(1)
            return [b"1" if store.delete(text(args[0])) else b"0"]
        if op == Op.KEYS:
            need(1)
            return [k.encode("utf-8") for k in store.keys(text(args[0]))]
        if op == Op.REGISTER:  # rank, host[, group]
            if len(args) not in (2, 3):
                raise InvalidArgumentError(f"REGISTER takes 2 or 3 arguments, got {len(args)}")
            return self._register(state, number(args[0]), text(args[1]),
                                  text(args[2]) if len(args) == 3 else "")
        if op == Op.GOODBYE:
            need(0)
            state.goodbye = True
            return []
        if op == Op.LOST:  # [group]
            if len(args) > 1:
                raise InvalidArgumentError(f"LOST takes at most 1 argument, got {len(args)}")
            group = text(args[0]) if args else ""
            return [str(r).encode("ascii") for r in self.lost_ranks(group)]
        if op == Op.MGET:  # timeout_ms, watch ("" or "/" + group), key...
            if len(args) < 2:
                raise InvalidArgumentError("MGET needs a timeout and a watch argument")
            return self._get_many(args[0], args[1], args[2:], "MGET")
        if op == Op.SETMGET:  # timeout_ms, watch, key, value, key...
            if len(args) < 4:
                raise InvalidArgumentError("SETMGET needs a timeout, a watch argument, a key "
                                           "and its value")
            store.set(text(args[2]), args[3])
            return self._get_many(args[0], args[1], args[4:], "SETMGET")
        raise InvalidArgumentError(f"unknown rendezvous op {op}")

    def _get_many(self, timeout_ms: bytes, watch_arg: bytes, keys: List[bytes],
                  op: str) -> List[bytes]:
        """MGET's answer (and SETMGET's, after its SET): the keys' values once all are set."""
        watch = _text(watch_arg)
        if watch and (watch[0] != "/" or "/" in watch[1:]):
            raise InvalidArgumentError(f"{op}'s watch is empty or '/<group>', got {watch!r}")
        values = self.store.get_many([_text(a) for a in keys], _number(timeout_ms) / 1000.0,
                                     f"{LOST_KEY_PREFIX}{_group_path(watch[1:])}" if watch
                                     else None)
        size = sum(len(v) + 4 for v in values)
        if size > _wire.MAX_VALUE_BYTES:
            raise InvalidArgumentError(
                f"the values of {len(values)} keys take {size} bytes, more than one reply "
                f"carries ({_wire.MAX_VALUE_BYTES}); read them in several MGETs")
        return values

    def _register(self, state: _ConnState, rank: int, host: str, group: str) -> List[bytes]:
        if rank < 0:
            raise InvalidArgumentError(f"rank must be >= 0, got {rank}")
        if "/" in group:
            raise InvalidArgumentError(f"a registration group has no '/', got {group!r}")
        _keepalive(state.sock)
        with self._lock:
            state.rank, state.group = rank, group
            self._rank_owner[(group, rank)] = state
            self._lost.discard((group, rank))
            self._left.discard((group, rank))
        self.store.delete(f"{LOST_KEY_PREFIX}{_group_path(group)}{rank}")
        self.store.set(f"{HOST_KEY_PREFIX}{_group_path(group)}{rank}", host.encode("utf-8"))
        return []


def _text(b: bytes) -> str:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgumentError("a key is not valid UTF-8") from None


def _number(b: bytes) -> int:
    try:
        return int(b)
    except ValueError:
        raise InvalidArgumentError(f"not an integer: {b[:32]!r}") from None


def _group_path(group: str) -> str:
    """The key segment of a registration group: none for the default group."""
    return f"{group}/" if group else ""
