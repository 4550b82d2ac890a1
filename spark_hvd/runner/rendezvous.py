"""The job's rendezvous service: a signed key-value store over TCP.

The driver (or ``spark-hvdrun``) runs one :class:`RendezvousServer` per job;
ranks reach it with a :class:`RendezvousClient`.  Collective backends exchange
their connection addresses through it, ranks register their hosts, and a
rank whose registration connection drops without a goodbye is recorded as
lost (``lost_ranks()`` and the key ``__lost__/<rank>``).

The wire protocol is described in :mod:`spark_hvd.runner._wire`.  Every
request is signed with HMAC-SHA256 under the job's secret, bound to the run id,
a per-connection server nonce and a sequence number.
"""

from __future__ import annotations

import logging
import os
import select
import selectors
import socket
import threading
from typing import Dict, List, Optional, Set, Tuple

from spark_hvd.exceptions import (AuthenticationError, InvalidArgumentError, SparkHvdError,
                                  StoreError)
from spark_hvd.runner import _wire
from spark_hvd.runner._client import (DEFAULT_CONNECT_TIMEOUT_S,  # noqa: F401 (re-exported)
                                      DEFAULT_REQUEST_TIMEOUT_S, RendezvousClient)
from spark_hvd.runner._wire import Kind, Op
from spark_hvd.runner.store import DEFAULT_TIMEOUT_S, InMemoryStore

__all__ = ["RendezvousServer", "RendezvousClient", "LOST_KEY_PREFIX", "HOST_KEY_PREFIX"]

logger = logging.getLogger(__name__)

SECRET_BYTES = 32
LOST_KEY_PREFIX = "__lost__/"
HOST_KEY_PREFIX = "__host__/"
DEFAULT_FRAME_TIMEOUT_S = 30.0
_JOIN_TIMEOUT_S = 5.0


def _keepalive(sock: socket.socket) -> None:
    """Let the kernel notice a peer host that vanished without closing its socket."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class _ConnState:
    """What the server knows about one client connection."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.nonce = _wire.new_nonce()
        self.authenticated = False
        self.next_seq = 1
        self.rank: Optional[int] = None
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
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 0, secret: Optional[bytes] = None,
                 run_id: Optional[str] = None,
                 frame_timeout_s: float = DEFAULT_FRAME_TIMEOUT_S) -> None:
        if secret is not None and (not isinstance(secret, bytes) or not secret):
            raise InvalidArgumentError("secret must be non-empty bytes")
        self.secret: bytes = secret if secret is not None else os.urandom(SECRET_BYTES)
        self.run_id: str = run_id if run_id is not None else os.urandom(8).hex()
        self._run_id_b = self.run_id.encode("utf-8")
        self._requested = (host, int(port))
        self._frame_timeout_s = frame_timeout_s
        self.host: Optional[str] = None
        self.port: Optional[int] = None
        self.store = InMemoryStore(f"the rendezvous store of run {self.run_id}")
        self._lock = threading.Lock()
        self._lsock: Optional[socket.socket] = None
        self._wake_r: Optional[socket.socket] = None
        self._wake_w: Optional[socket.socket] = None
        self._accept_thread: Optional[threading.Thread] = None
        self._conns: Dict[threading.Thread, _ConnState] = {}
        self._lost: Set[int] = set()
        self._rank_owner: Dict[int, _ConnState] = {}
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
                self._lsock = socket.create_server((host, port), family=family, backlog=128,
                                                   dualstack_ipv6=dualstack)
            except OSError as e:
                raise StoreError(f"rendezvous server cannot listen on {host}:{port}: {e}") from e
            self.host, self.port = self._lsock.getsockname()[:2]
            self._wake_r, self._wake_w = socket.socketpair()
            self._accept_thread = threading.Thread(
                target=self._accept_loop, name=f"spark_hvd-rendezvous-{self.port}", daemon=True)
            self._accept_thread.start()
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
        self._wake_w.send(b"x")
        self._accept_thread.join(_JOIN_TIMEOUT_S)
        with self._lock:
            conns = dict(self._conns)
        for state in conns.values():
            try:
                state.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in conns:
            thread.join(_JOIN_TIMEOUT_S)
        for s in (self._lsock, self._wake_r, self._wake_w):
            s.close()

    def __enter__(self) -> "RendezvousServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- in-process access for the launcher ----------------------------------------

    def lost_ranks(self) -> List[int]:
        """Ranks whose registration connection dropped without a goodbye."""
        with self._lock:
            return sorted(self._lost)

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bytes:
        return self.store.get(key, timeout_s)

    # -- serving -------------------------------------------------------------------

    def _accept_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._lsock, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while True:
                ready = {key.fileobj for key, _ in sel.select()}
                if self._wake_r in ready:
                    return
                try:
                    sock, addr = self._lsock.accept()
                except OSError as e:
                    # e.g. out of file descriptors: back off instead of spinning on accept
                    logger.warning("rendezvous server %s:%s cannot accept: %s",
                                   self.host, self.port, e)
                    select.select([self._wake_r], [], [], 0.1)
                    continue
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                state = _ConnState(sock, f"{addr[0]}:{addr[1]}")
                thread = threading.Thread(target=self._serve, args=(state,), daemon=True,
                                          name=f"spark_hvd-rendezvous-conn-{state.peer}")
                with self._lock:
                    if self._stopping:
                        sock.close()
                        return
                    self._conns[thread] = state
                thread.start()
        finally:
            sel.close()

    def _refuse(self, state: _ConnState, code: int, message: str) -> None:
        logger.warning("rendezvous server %s:%s refused a request from %s: %s",
                       self.host, self.port, state.peer, message)
        try:
            state.sock.sendall(_wire.refused_frame(code, message))
        except OSError:
            pass

    def _serve(self, state: _ConnState) -> None:
        sock = state.sock
        try:
            sock.sendall(_wire.hello_frame(state.nonce))
            while not self._stopping:
                limit = (_wire.MAX_FRAME_BYTES if state.authenticated
                         else _wire.PRE_AUTH_MAX_FRAME_BYTES)
                try:
                    payload = _wire.read_frame(sock, limit, self._frame_timeout_s)
                except _wire.ConnectionClosed as e:
                    if e.mid_frame:
                        logger.warning("rendezvous: %s closed its connection inside a frame",
                                       state.peer)
                    return
                except _wire.ProtocolError as e:
                    return self._refuse(state, StoreError.code, f"malformed frame: {e}")
                try:
                    seq, op, args = _wire.parse_signed(payload, Kind.REQUEST, self.secret,
                                                       self._run_id_b, state.nonce)
                except _wire.BadSignature:
                    return self._refuse(state, AuthenticationError.code,
                                        f"request not signed with the secret of run "
                                        f"{self.run_id} (wrong secret or run id)")
                except _wire.ProtocolError as e:
                    return self._refuse(state, StoreError.code, f"malformed request: {e}")
                if seq != state.next_seq:
                    return self._refuse(state, AuthenticationError.code,
                                        f"request sequence {seq}, expected {state.next_seq} "
                                        f"(replayed or reordered request)")
                state.next_seq += 1
                if not state.authenticated and op != Op.AUTH:
                    return self._refuse(state, AuthenticationError.code,
                                        "the first request must authenticate")
                try:
                    status, result = _wire.OK, self._dispatch(state, op, args)
                except SparkHvdError as e:
                    status, result = e.code, [e.message.encode("utf-8", "replace")]
                sock.sendall(_wire.signed_frame(Kind.RESPONSE, self.secret, self._run_id_b,
                                                state.nonce, seq, status, result))
                if op == Op.GOODBYE:
                    return
        except OSError as e:
            logger.debug("rendezvous connection from %s ended: %s", state.peer, e)
        finally:
            self._connection_ended(state)

    def _connection_ended(self, state: _ConnState) -> None:
        try:
            state.sock.close()
        except OSError:
            pass
        with self._lock:
            self._conns.pop(threading.current_thread(), None)
            rank = state.rank
            if rank is None or state.goodbye or self._stopping \
                    or self._rank_owner.get(rank) is not state:
                return
            del self._rank_owner[rank]
            self._lost.add(rank)
        logger.info("rendezvous: rank %d (%s) lost its connection without a goodbye",
                       rank, state.peer)
        try:
            self.store.set(f"{LOST_KEY_PREFIX}{rank}",
                           f"connection from {state.peer} dropped".encode())
        except StoreError:
            pass

    def _dispatch(self, state: _ConnState, op: int, args: List[bytes]) -> List[bytes]:
        def need(n: int) -> None:
            if len(args) != n:
                raise InvalidArgumentError(f"op {op} takes {n} arguments, got {len(args)}")

        def text(b: bytes) -> str:
            try:
                return b.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidArgumentError("a key is not valid UTF-8") from None

        def number(b: bytes) -> int:
            try:
                return int(b)
            except ValueError:
                raise InvalidArgumentError(f"not an integer: {b[:32]!r}") from None

        store = self.store
        if op == Op.AUTH:
            need(0)
            state.authenticated = True
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
        if op == Op.REGISTER:
            need(2)
            return self._register(state, number(args[0]), text(args[1]))
        if op == Op.GOODBYE:
            need(0)
            state.goodbye = True
            return []
        if op == Op.LOST:
            need(0)
            return [str(r).encode("ascii") for r in self.lost_ranks()]
        raise InvalidArgumentError(f"unknown rendezvous op {op}")

    def _register(self, state: _ConnState, rank: int, host: str) -> List[bytes]:
        if rank < 0:
            raise InvalidArgumentError(f"rank must be >= 0, got {rank}")
        _keepalive(state.sock)
        with self._lock:
            state.rank = rank
            self._rank_owner[rank] = state
            self._lost.discard(rank)
        self.store.delete(f"{LOST_KEY_PREFIX}{rank}")
        self.store.set(f"{HOST_KEY_PREFIX}{rank}", host.encode("utf-8"))
        return []
