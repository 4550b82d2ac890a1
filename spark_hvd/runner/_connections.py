"""The rendezvous server's connections (internal to spark_hvd.runner).

:class:`ConnectionLoop` keeps idle, silent and hostile connections from costing a
thread each, or more than a bounded number of descriptors; the protocol on top
(signatures, requests, ranks) is the server's, in :mod:`.rendezvous`.

1. One thread runs a selector over the listening socket and every connection
   that is not in the middle of a request: it accepts, reads frames as their
   bytes arrive and hands each whole frame to the server, which answers at once
   or passes the connection to a worker thread.
2. A connection that has not yet authenticated is *pending*.  At most
   ``max_pending`` are; accepting one more closes the oldest pending one (its
   client connects again).  A pending connection that has not authenticated
   within ``handshake_timeout_s`` is closed.
3. At most ``max_connections`` connections are authenticated at once.
4. A worker runs one request (GET and WAIT block until their key is set), sends
   the response and gives the connection back to the selector.  A worker thread
   is started only when none is idle, so threads follow the requests in flight,
   not the connections.
5. An authenticated connection may stay idle for as long as it likes (clients
   pool them); once a frame has begun, each further piece must arrive within
   ``frame_timeout_s``.
6. When accepting fails for want of descriptors, the oldest pending connection
   is closed to make room; with none pending, accepting pauses briefly.
"""

from __future__ import annotations

import errno
import logging
import queue
import selectors
import socket
import threading
import time
from typing import Callable, Dict, Optional, Set, Tuple

from spark_hvd._job import wire as _wire
from spark_hvd.runner._workers import Workers

logger = logging.getLogger(__name__)

_ACCEPT_BACKOFF_S = 0.1


class Connection:
    """One accepted connection: the loop's while it is idle, a worker's while it runs a request."""

    def __init__(self, sock: socket.socket, peer: str, deadline: float) -> None:
        self.sock = sock
        self.peer = peer
        self.reader = _wire.FrameReader()
        # while pending: when the handshake times out; once authenticated and in the
        # middle of a frame: when the frame does
        self.deadline = deadline
        self.authenticated = False
        self.done = False  # set by a worker: close the connection rather than watch it again


class ConnectionLoop:
    """Serves the connections of a listening socket from one thread (see the module notes).

    The server plugs in through callables, all called in the loop thread:
    ``new_connection(sock, peer, deadline)`` makes the :class:`Connection` (a
    subclass may carry protocol state); ``on_accepted(conn)`` greets it;
    ``on_frame(conn, payload)`` gets each whole frame and must not block: it
    answers with :meth:`send_now`, closes, or calls :meth:`to_worker`;
    ``on_bad_frame(conn, error)`` gets a frame that is not one (bad length);
    ``on_closed(conn)`` hears of every authenticated connection that closed.
    ``warn(reason, msg, *args)`` logs what a peer may cause at will.
    """

    def __init__(self, lsock: socket.socket, *,
                 new_connection: Callable[[socket.socket, str, float], Connection],
                 on_accepted: Callable[[Connection], None],
                 on_frame: Callable[[Connection, memoryview], None],
                 on_bad_frame: Callable[[Connection, _wire.ProtocolError], None],
                 on_closed: Callable[[Connection], None],
                 warn: Callable[..., None], max_connections: int, max_pending: int,
                 handshake_timeout_s: float, frame_timeout_s: float) -> None:
        self._lsock = lsock
        self._new_connection = new_connection
        self._on_accepted = on_accepted
        self._on_frame = on_frame
        self._on_bad_frame = on_bad_frame
        self._on_closed = on_closed
        self._warn = warn
        self._max_connections = max_connections
        self._max_pending = max_pending
        self._handshake_timeout_s = handshake_timeout_s
        self._frame_timeout_s = frame_timeout_s
        host, port = lsock.getsockname()[:2]
        self.where = f"rendezvous server {host}:{port}"
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._pending: Dict[Connection, None] = {}  # oldest first
        self._partial: Set[Connection] = set()  # authenticated, in the middle of a frame
        self._authenticated: Set[Connection] = set()  # idle, or with a worker
        self._accept_paused_until: Optional[float] = None
        # at most one request in flight per authenticated connection, so never short of one
        self._workers = Workers(f"spark_hvd-rendezvous-{port}-worker", max_connections)
        self._returned: "queue.SimpleQueue[Connection]" = queue.SimpleQueue()  # from workers
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"spark_hvd-rendezvous-{port}")

    # -- lifecycle (the server's thread) ---------------------------------------------

    def start(self) -> None:
        self._lsock.setblocking(False)
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self._sel.register(self._lsock, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Close every connection; a worker's once it has finished its request (which
        fails fast: its socket is shut down).  Leaves the listening socket open."""
        self._stopping = True
        self._wake()
        self._thread.join(timeout_s)
        with_workers = list(self._authenticated)  # the loop closed the others as it ended
        for conn in with_workers:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._workers.stop(timeout_s)
        for conn in with_workers:
            conn.sock.close()
        self._wake_r.close()
        self._wake_w.close()

    def counts(self) -> Tuple[int, int]:
        """``(authenticated, pending)`` connections now (a snapshot from any thread)."""
        return len(self._authenticated), len(self._pending)

    # -- for on_frame (the loop thread) -----------------------------------------------

    def authenticate(self, conn: Connection) -> bool:
        """Count ``conn`` as authenticated; False (and no change) when the limit is reached."""
        if len(self._authenticated) >= self._max_connections:
            return False
        del self._pending[conn]
        conn.authenticated = True
        self._authenticated.add(conn)
        return True

    def send_now(self, conn: Connection, data: bytes) -> bool:
        """Send a short frame without blocking (it fits an idle socket's buffer), else close."""
        try:
            if conn.sock.send(data) == len(data):
                return True
        except OSError as e:
            logger.debug("%s: connection from %s ended: %s", self.where, conn.peer, e)
        self.close(conn)
        return False

    def to_worker(self, conn: Connection, job: Callable[[], None]) -> None:
        """Run ``job`` in a worker with ``conn`` blocking and unwatched, then watch it again
        (or close it, when the job set ``conn.done``)."""
        def run() -> None:
            try:
                job()
            finally:
                self._returned.put(conn)
                self._wake()

        self._sel.unregister(conn.sock)
        conn.sock.setblocking(True)
        self._workers.submit(run)

    def close(self, conn: Connection) -> None:
        try:
            self._sel.unregister(conn.sock)
        except KeyError:  # with a worker, or never registered
            pass
        conn.sock.close()
        self._pending.pop(conn, None)
        self._partial.discard(conn)
        if conn.authenticated:
            self._authenticated.discard(conn)
            self._on_closed(conn)

    # -- the loop --------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stopping:
                events = self._sel.select(self._next_timeout())
                # frames of connections already accepted go before new connections
                for key, _ in sorted(events, key=lambda event: event[0].fileobj is self._lsock):
                    if key.data is not None:
                        self._on_readable(key.data)
                    elif key.fileobj is self._wake_r:
                        self._take_back()
                    else:
                        self._accept()
                self._expire()
        finally:
            for key in list(self._sel.get_map().values()):
                if key.data is not None:
                    self.close(key.data)
            self._sel.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # full (so the loop wakes anyway), or closed
            pass

    def _next_timeout(self) -> Optional[float]:
        deadlines = [conn.deadline for conn in self._partial]
        if self._pending:
            deadlines.append(next(iter(self._pending)).deadline)
        if self._accept_paused_until is not None:
            deadlines.append(self._accept_paused_until)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _expire(self) -> None:
        now = time.monotonic()
        if self._accept_paused_until is not None and now >= self._accept_paused_until:
            self._accept_paused_until = None
            self._sel.register(self._lsock, selectors.EVENT_READ)
        while self._pending:  # they share one timeout, so the oldest expires first
            conn = next(iter(self._pending))
            if conn.deadline > now:
                break
            self._warn("handshake timeout", "%s closed the connection from %s: it did not "
                       "authenticate within %g s", self.where, conn.peer,
                       self._handshake_timeout_s)
            self.close(conn)
        for conn in [c for c in self._partial if c.deadline <= now]:
            self._warn("frame timeout", "%s closed the connection from %s: it sent part of a "
                       "frame, then nothing for %g s", self.where, conn.peer,
                       self._frame_timeout_s)
            self.close(conn)

    def _accept(self) -> None:
        try:
            sock, addr = self._lsock.accept()
        except BlockingIOError:
            return
        except OSError as e:
            out_of_fds = e.errno in (errno.EMFILE, errno.ENFILE)
            if out_of_fds and self._pending:
                self._close_oldest_pending("the server is out of file descriptors")
                return  # the waiting connection is accepted on the next round
            self._warn("accept", "%s cannot accept: %s%s", self.where, e,
                       " (raise the open-files limit, ulimit -n, of this process)"
                       if out_of_fds else "")
            self._sel.unregister(self._lsock)  # rather than spin on accept
            self._accept_paused_until = time.monotonic() + _ACCEPT_BACKOFF_S
            return
        if len(self._pending) >= self._max_pending:
            self._close_oldest_pending(f"{self._max_pending} connections are authenticating")
        conn = self._new_connection(sock, f"{addr[0]}:{addr[1]}",
                                    time.monotonic() + self._handshake_timeout_s)
        self._pending[conn] = None
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sel.register(sock, selectors.EVENT_READ, conn)
        except OSError as e:  # e.g. reset already
            logger.debug("%s: connection from %s failed at once: %s", self.where, conn.peer, e)
            self.close(conn)
            return
        self._on_accepted(conn)

    def _close_oldest_pending(self, why: str) -> None:
        conn = next(iter(self._pending))
        self._warn("too many pending", "%s closed the connection from %s before it "
                   "authenticated: %s", self.where, conn.peer, why)
        self.close(conn)

    def _on_readable(self, conn: Connection) -> None:
        limit = _wire.MAX_FRAME_BYTES if conn.authenticated else _wire.PRE_AUTH_MAX_FRAME_BYTES
        try:
            payload = conn.reader.read(conn.sock, limit)
        except _wire.ConnectionClosed as e:
            if e.mid_frame:
                self._warn("closed mid-frame", "%s: %s closed its connection inside a frame",
                           self.where, conn.peer)
            self.close(conn)
            return
        except _wire.ProtocolError as e:
            self._on_bad_frame(conn, e)
            return
        except OSError as e:
            logger.debug("%s: connection from %s ended: %s", self.where, conn.peer, e)
            self.close(conn)
            return
        if payload is None:
            if conn.authenticated and conn.reader.mid_frame:
                conn.deadline = time.monotonic() + self._frame_timeout_s
                self._partial.add(conn)
            return
        self._partial.discard(conn)
        self._on_frame(conn, payload)

    def _take_back(self) -> None:
        """Watch again the connections workers are done with."""
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while not self._stopping:
            try:
                conn = self._returned.get_nowait()
            except queue.Empty:
                return
            if conn.done:
                self.close(conn)
            else:
                conn.sock.setblocking(False)
                self._sel.register(conn.sock, selectors.EVENT_READ, conn)
