"""The rendezvous store: its contract, the signed wire protocol, lost-rank detection."""

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from spark_hvd._job import env
from spark_hvd._job import wire as _wire
from spark_hvd._job.store import InMemoryStore
from spark_hvd.exceptions import (AuthenticationError, CollectiveTimeoutError,
                                  InvalidArgumentError, PeerLostError, StoreError)
from spark_hvd.runner.rendezvous import RendezvousClient, RendezvousServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WAIT_S = 10.0  # upper bound for things that should happen at once


@pytest.fixture
def server():
    with RendezvousServer(host="127.0.0.1") as s:
        yield s


def connect(server, **kwargs):
    return RendezvousClient("127.0.0.1", server.port, server.secret, server.run_id, **kwargs)


@pytest.fixture
def client(server):
    c = connect(server)
    yield c
    c.close()


class StoreContract:
    """Behaviour every store implementation shares; subclasses give ``store`` and ``other``.

    ``other`` is a second handle on the same data, used from another thread.
    """

    def test_set_get(self, store):
        store.set("a", b"1")
        assert store.get("a", 1.0) == b"1"
        store.set("a", b"2")
        assert store.get("a", 1.0) == b"2"

    @pytest.mark.parametrize("value", [b"", bytes(range(256)) * 3, os.urandom(1 << 22)])
    def test_values_are_binary_safe(self, store, value):
        store.set("k", value)
        assert store.get("k", 1.0) == value

    def test_unicode_keys(self, store):
        store.set("häst/ключ/鍵", b"x")
        assert store.keys("häst/") == ["häst/ключ/鍵"]

    def test_get_missing_times_out_naming_key_and_timeout(self, store):
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as info:
            store.get("missing/key", 0.3)
        assert time.monotonic() - start < WAIT_S
        assert "missing/key" in str(info.value) and "0.3 s" in str(info.value)

    def test_get_blocks_until_another_thread_sets(self, store, other):
        got = []
        reader = threading.Thread(target=lambda: got.append(store.get("late", WAIT_S)))
        reader.start()
        reader.join(0.2)
        assert reader.is_alive() and not got  # still waiting for the key
        other.set("late", b"here")
        reader.join(WAIT_S)
        assert got == [b"here"]

    def test_wait_and_check(self, store, other):
        assert store.check([])
        assert not store.check(["w1", "w2"])
        store.set("w1", b"")
        with pytest.raises(CollectiveTimeoutError) as info:
            store.wait(["w1", "w2"], 0.2)
        assert "w2" in str(info.value)
        setter = threading.Thread(target=other.set, args=("w2", b""))
        setter.start()
        store.wait(["w1", "w2"], WAIT_S)
        setter.join()
        assert store.check(["w1", "w2"])

    def test_get_many_answers_in_order_once_every_key_is_set(self, store, other):
        store.set("m/b", b"2")
        assert store.get_many([], 1.0) == []
        assert store.get_many(["m/b"], 1.0) == [b"2"]
        got = []
        reader = threading.Thread(
            target=lambda: got.append(store.get_many(["m/c", "m/a", "m/b", "m/a"], WAIT_S)))
        reader.start()
        other.set("m/a", b"1")
        reader.join(0.2)
        assert reader.is_alive() and not got  # m/c is still missing
        other.set("m/c", b"")
        reader.join(WAIT_S)
        assert got == [[b"", b"1", b"2", b"1"]]

    def test_get_many_times_out_naming_the_missing_keys(self, store):
        store.set("t/0", b"")
        keys = [f"t/{i}" for i in range(20)]
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as info:
            store.get_many(keys, 0.3)
        assert time.monotonic() - start < WAIT_S
        message = str(info.value)
        assert "0.3 s" in message and "missing 19: ['t/1', 't/2'," in message
        assert "... and 11 more" in message and "t/19" not in message  # bounded at any N
        with pytest.raises(InvalidArgumentError, match="wrap it in a list"):
            store.get_many("t/0", 1.0)

    def test_add(self, store):
        assert store.add("n", 5) == 5
        assert store.add("n", -7) == -2
        assert store.add("n", 0) == -2
        assert store.get("n", 1.0) == b"-2"
        assert store.add("big", 1 << 70) == 1 << 70

    def test_add_on_a_non_counter_fails(self, store):
        store.set("s", b"not a number")
        with pytest.raises(StoreError, match="not an integer"):
            store.add("s", 1)

    def test_delete(self, store):
        store.set("d", b"x")
        assert store.delete("d") is True
        assert store.delete("d") is False
        assert not store.check(["d"])

    def test_keys_by_prefix(self, store):
        for k in ("p/2", "p/1", "q/1", "p"):
            store.set(k, b"")
        assert store.keys("p/") == ["p/1", "p/2"]
        assert store.keys("") == ["p", "p/1", "p/2", "q/1"]
        assert store.keys("none/") == []

    def test_bad_arguments(self, store):
        with pytest.raises(InvalidArgumentError):
            store.set("k", "a str, not bytes")
        with pytest.raises(InvalidArgumentError):
            store.set("", b"x")
        with pytest.raises(InvalidArgumentError):
            store.get("k", -1)
        with pytest.raises(InvalidArgumentError):
            store.add("k", 1.5)


class TestInMemoryStore(StoreContract):
    @pytest.fixture
    def store(self):
        return InMemoryStore()

    @pytest.fixture
    def other(self, store):
        return store

    def test_close_wakes_waiters(self, store):
        errors = []

        def read():
            try:
                store.get("never", WAIT_S)
            except StoreError as e:
                errors.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        store.close()
        reader.join(WAIT_S)
        assert len(errors) == 1 and "shut down" in str(errors[0])

    def test_close_wakes_a_bulk_read(self, store):
        errors = []

        def read():
            try:
                store.get_many(["never", "nor"], WAIT_S, abort_prefix="lost/")
            except StoreError as e:
                errors.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        until(lambda: len(store._waiters) == 2)
        store.close()
        reader.join(WAIT_S)
        assert len(errors) == 1 and "shut down" in str(errors[0])
        assert not reader.is_alive()

    @pytest.mark.parametrize("n", [1, 3, 256])
    def test_a_set_wakes_only_the_calls_waiting_for_its_key(self, store, n):
        """n calls blocked on n keys, the keys set one at a time: n wake-ups in all (one
        condition notified on every set woke every blocked call: n(n+1)/2 here)."""
        readers = [threading.Thread(target=store.get, args=(f"w/{i}", WAIT_S))
                   for i in range(n)]
        for r in readers:
            r.start()
        until(lambda: len(store._waiters) == n)
        for i, r in enumerate(readers):
            store.set(f"w/{i}", b"")
            r.join(WAIT_S)  # the others wait meanwhile, and would be woken by every set
            assert not r.is_alive()
        assert store.wakeups == n
        assert not store._waiters  # nothing left registered

    def test_a_bulk_read_is_woken_once(self, store):
        n = 64
        got = []
        reader = threading.Thread(target=lambda: got.append(
            store.get_many([f"b/{i}" for i in range(n)], WAIT_S)))
        reader.start()
        until(lambda: len(store._waiters) == n)
        for i in range(n):
            store.set(f"b/{i}", str(i).encode())
        reader.join(WAIT_S)
        assert got == [[str(i).encode() for i in range(n)]] and store.wakeups == 1

    def test_a_key_deleted_before_the_wake_up_is_waited_for_again(self, store):
        got = []
        reader = threading.Thread(target=lambda: got.append(store.get_many(["a", "b"], WAIT_S)))
        reader.start()
        until(lambda: len(store._waiters) == 2)
        store.set("a", b"1")
        store.delete("a")
        store.set("b", b"2")  # its last missing key: woken, finds "a" gone, waits again
        until(lambda: store.wakeups == 1 and "a" in store._waiters)
        assert reader.is_alive() and not got
        store.set("a", b"3")
        reader.join(WAIT_S)
        assert got == [[b"3", b"2"]] and store.wakeups == 2

    def test_a_key_under_the_watched_prefix_ends_a_bulk_read(self, store):
        store.set("lost/e1/4", b"connection dropped")  # another group's: not under lost/
        store.set("have", b"x")
        errors = []

        def read():
            try:
                store.get_many(["have", "addr/1", "addr/3"], WAIT_S, abort_prefix="lost/")
            except PeerLostError as e:
                errors.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        until(lambda: "lost/" in store._watchers)
        store.set("lost/3", b"connection from 10.0.0.3:4000 dropped")
        reader.join(WAIT_S)
        assert len(errors) == 1 and errors[0].ranks == [3]
        message = str(errors[0])
        assert message.startswith("rank 3 lost (3: connection from 10.0.0.3:4000 dropped)")
        assert "missing 2: ['addr/1', 'addr/3']" in message
        start = time.monotonic()
        with pytest.raises(PeerLostError) as info:  # lost already: fails without waiting
            store.get_many(["addr/1"], WAIT_S, abort_prefix="lost/")
        assert time.monotonic() - start < WAIT_S / 2
        assert info.value.ranks == [3] and "key 'addr/1'" in str(info.value)
        store.set("addr/1", b"a1")
        store.set("addr/3", b"a3")  # every key set: the values, lost ranks or not
        assert store.get_many(["addr/1", "addr/3"], 1.0, abort_prefix="lost/") == [b"a1", b"a3"]
        store.delete("lost/3")
        with pytest.raises(CollectiveTimeoutError):
            store.get_many(["addr/2"], 0.1, abort_prefix="lost/")
        with pytest.raises(InvalidArgumentError, match="ending in '/'"):
            store.get_many(["addr/2"], 0.1, abort_prefix="lost")


class TestRendezvousClient(StoreContract):
    @pytest.fixture
    def store(self, client):
        return client

    @pytest.fixture
    def other(self, server):
        c = connect(server)
        yield c
        c.close()


class TestServer:
    def test_start_binds_once_and_reports_the_port(self):
        s = RendezvousServer(host="127.0.0.1")
        host, port = s.start()
        try:
            assert (host, port) == ("127.0.0.1", s.port) and port > 0
            assert s.start() == (host, port)
            assert len(s.secret) == 32 and s.run_id
            with socket.create_connection((host, port), timeout=WAIT_S):
                pass  # listening without any client having connected before
        finally:
            s.stop()
        with pytest.raises(StoreError):
            connect(s)

    def test_in_process_access_shares_the_store(self, server, client):
        server.set("from/server", b"1")
        assert client.get("from/server", 1.0) == b"1"
        client.set("from/client", b"2")
        assert server.get("from/client", 1.0) == b"2"

    def test_stop_wakes_a_blocked_client(self):
        s = RendezvousServer(host="127.0.0.1")
        s.start()
        c = connect(s)
        errors = []

        def read():
            try:
                c.get("never", 60.0)
            except StoreError as e:
                errors.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        reader.join(0.1)
        s.stop()
        reader.join(WAIT_S)
        assert not reader.is_alive() and len(errors) == 1
        c.close()

    def test_concurrent_clients_add_atomically(self, server):
        clients = [connect(server) for _ in range(4)]
        threads = [threading.Thread(target=lambda c=c: [c.add("counter", 1) for _ in range(50)])
                   for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert server.get("counter", 1.0) == b"200"
        for c in clients:
            c.close()

    def test_one_client_shared_by_threads(self, client):
        threads = [threading.Thread(target=lambda i=i: [client.set(f"t{i}/{j}", b"v")
                                                          for j in range(30)])
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert len(client.keys("t")) == 120

    def test_blocked_get_does_not_hold_up_the_same_client(self, client):
        got = []
        reader = threading.Thread(target=lambda: got.append(client.get("x", WAIT_S)))
        reader.start()
        reader.join(0.1)
        client.set("x", b"1")  # would deadlock with a single locked connection
        reader.join(WAIT_S)
        assert got == [b"1"]

    def test_local_address(self, client):
        assert client.local_address() == "127.0.0.1"


class TestAuthentication:
    def test_wrong_secret_is_refused_and_server_keeps_serving(self, server):
        with pytest.raises(AuthenticationError, match="wrong secret or run id") as info:
            RendezvousClient("127.0.0.1", server.port, b"not the secret", server.run_id)
        assert f"127.0.0.1:{server.port}" in str(info.value)
        good = connect(server)
        good.set("still", b"serving")
        assert good.get("still", 1.0) == b"serving"
        good.close()

    def test_wrong_run_id_is_refused(self, server):
        with pytest.raises(AuthenticationError):
            RendezvousClient("127.0.0.1", server.port, server.secret, "another-run")

    def test_no_server_gives_store_error_with_address(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with pytest.raises(StoreError, match=f"127.0.0.1:{port}"):
            RendezvousClient("127.0.0.1", port, b"s", "r", connect_timeout_s=2.0)


def raw_connect(server) -> tuple:
    """A plain socket to the server and the nonce of its greeting."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
    nonce = _wire.parse_hello(_wire.read_frame(sock, 1 << 16))
    return sock, nonce


def refusal_or_eof(sock):
    """What the server answers a bad frame with: a REFUSED frame, or just closing."""
    try:
        payload = _wire.read_frame(sock, 1 << 16)
    except (_wire.ConnectionClosed, ConnectionResetError):
        return "eof"
    refused = _wire.parse_refused(payload)
    assert refused is not None, bytes(payload)
    sock.settimeout(WAIT_S)
    with pytest.raises((_wire.ConnectionClosed, ConnectionResetError)):
        _wire.read_frame(sock, 1 << 16)  # and the connection is closed after it
    return refused


class TestMalformedInput:
    @pytest.mark.parametrize("garbage", [
        pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", id="http"),
        pytest.param(b"\x00\x00\x00\x10" + b"\x02" * 16, id="short-request"),
        pytest.param(b"\x00\x00\x00\x00", id="zero-length"),
        pytest.param(b"\xff\xff\xff\xff", id="huge-length"),
        pytest.param(struct.pack(">I", 1 << 20) + b"\x02" * 100, id="large-before-auth"),
        pytest.param(os.urandom(300), id="random"),
    ])
    def test_garbage_is_refused_and_server_keeps_serving(self, server, client, garbage):
        sock, _ = raw_connect(server)
        with sock:
            sock.sendall(garbage)
            answer = refusal_or_eof(sock)
        assert answer == "eof" or answer[0] in (StoreError.code, AuthenticationError.code)
        client.set("after", b"garbage")
        assert client.get("after", 1.0) == b"garbage"

    def test_truncated_frame(self, server, client):
        sock, _ = raw_connect(server)
        with sock:
            sock.sendall(struct.pack(">I", 100) + b"\x02" * 10)
            sock.shutdown(socket.SHUT_WR)
            assert refusal_or_eof(sock) == "eof"
        assert client.add("after-truncation", 1) == 1

    def test_signed_request_replayed_on_another_connection_is_refused(self, server):
        sock_a, nonce_a = raw_connect(server)
        auth = _wire.signed_frame(_wire.Kind.REQUEST, server.secret, server.run_id.encode(),
                                  nonce_a, 1, _wire.Op.AUTH, [])
        with sock_a:
            sock_a.sendall(auth)
            seq, status, _ = _wire.parse_signed(
                _wire.read_frame(sock_a, 1 << 16), _wire.Kind.RESPONSE, server.secret,
                server.run_id.encode(), nonce_a)
            assert (seq, status) == (1, _wire.OK)
            sock_a.sendall(auth)  # the same request again on the same connection
            assert refusal_or_eof(sock_a)[0] == AuthenticationError.code
        sock_b, _ = raw_connect(server)
        with sock_b:
            sock_b.sendall(auth)  # signed for connection A's nonce
            assert refusal_or_eof(sock_b)[0] == AuthenticationError.code

    def test_unauthenticated_request_is_refused(self, server):
        sock, nonce = raw_connect(server)
        with sock:
            sock.sendall(_wire.signed_frame(_wire.Kind.REQUEST, server.secret,
                                            server.run_id.encode(), nonce, 1, _wire.Op.SET,
                                            [b"k", b"v"]))
            assert refusal_or_eof(sock)[0] == AuthenticationError.code
        assert not server.store.check(["k"])


REGISTER_AND_DIE = """
import os, sys
from spark_hvd.runner.rendezvous import RendezvousClient
c = RendezvousClient("127.0.0.1", int(sys.argv[1]), bytes.fromhex(sys.argv[2]), sys.argv[3])
c.register_rank(1, host="dying-host")
os._exit(1)
"""


class TestLostRanks:
    def test_process_dying_after_registering_is_lost(self, server, client):
        proc = subprocess.run(
            [sys.executable, "-c", REGISTER_AND_DIE, str(server.port), server.secret.hex(),
             server.run_id], env=dict(os.environ, PYTHONPATH=ROOT), timeout=30)
        assert proc.returncode == 1
        client.get("__lost__/1", WAIT_S)  # set by the server when the connection dropped
        assert server.lost_ranks() == [1]
        assert client.lost_ranks() == [1]
        assert client.get("__host__/1", 1.0) == b"dying-host"

    def test_abrupt_close_is_lost_and_clean_close_is_not(self, server, client):
        clean = connect(server)
        clean.register_rank(2)
        clean.close()
        abrupt = connect(server)
        abrupt.register_rank(3)
        abrupt._registration.sock.close()  # the socket goes away without a goodbye
        client.get("__lost__/3", WAIT_S)
        assert server.lost_ranks() == [3]
        assert not client.check(["__lost__/2"])
        assert client.get("__host__/2", 1.0) == b"127.0.0.1"
        abrupt.close()

    def test_registering_again_clears_lost(self, server, client):
        first = connect(server)
        first.register_rank(0)
        first._registration.sock.close()
        client.get("__lost__/0", WAIT_S)
        second = connect(server)
        second.register_rank(0)
        assert server.lost_ranks() == [] and not client.check(["__lost__/0"])
        second.close()
        first.close()

    def test_groups_keep_their_lost_ranks_apart(self, server, client):
        """An elastic job's epochs register the same rank numbers in groups of their own:
        rank 1 lost in epoch e1 is not lost in e2, nor in the default group."""
        old = connect(server)
        old.register_rank(1, group="e1")
        old._registration.sock.close()
        client.get("__lost__/e1/1", WAIT_S)
        new = connect(server)
        new.register_rank(1, group="e2")
        assert server.lost_ranks("e1") == [1] and old.lost_ranks() == [1]
        assert server.lost_ranks("e2") == [] and new.lost_ranks() == []
        assert server.lost_ranks() == [] and client.lost_ranks() == []
        assert server.registered_ranks("e2") == [1] and server.registered_ranks("e1") == []
        assert client.get("__host__/e2/1", 1.0) == b"127.0.0.1"
        new.close()
        until(lambda: server.registered_ranks("e2") == [])
        assert server.lost_ranks("e2") == []  # a goodbye is not a loss
        with pytest.raises(InvalidArgumentError, match="without '/'"):
            client.register_rank(0, group="a/b")
        old.close()

    def test_a_launcher_ending_a_rank_loses_it_only_if_it_never_registered(self, server,
                                                                             client):
        """rank_ended: a rank that ended before registering is lost at once; one that is
        registered, or left with a goodbye, is judged by its connection as before."""
        clean = connect(server)
        clean.register_rank(1)
        clean.close()
        until(lambda: server.registered_ranks() == [])
        alive = connect(server)
        alive.register_rank(2)
        for rank in (0, 1, 2):
            server.rank_ended(rank, why="its process exited with code 0")
        assert server.lost_ranks() == [0] and client.lost_ranks() == [0]
        assert b"before it registered" in client.get("__lost__/0", 1.0)
        alive.close()

    @pytest.mark.parametrize("group", ["", "e2"])
    def test_a_bulk_read_watching_lost_ranks_fails_at_once(self, server, client, group):
        """A rank waiting in get_many(watch_lost=True) for a peer's key hears at once that
        a rank of its group lost its connection: PeerLostError naming it, not a timeout.
        A loss in another group does not end it."""
        other_group = connect(server)
        other_group.register_rank(5, group="e1")
        victim = connect(server)
        victim.register_rank(3, group=group)
        reader = connect(server)
        reader.register_rank(0, group=group)
        client.set("addr/1", b"a1")
        errors = []

        def read():
            try:
                reader.get_many(["addr/1", "addr/2", "addr/3"], 60.0, watch_lost=True)
            except PeerLostError as e:
                errors.append(e)

        thread = threading.Thread(target=read)
        thread.start()
        other_group._registration.sock.close()
        client.get("__lost__/e1/5", WAIT_S)
        thread.join(0.2)
        assert thread.is_alive() and not errors
        start = time.monotonic()
        victim._registration.sock.close()  # no goodbye
        thread.join(WAIT_S)
        assert time.monotonic() - start < WAIT_S and len(errors) == 1
        error = errors[0]
        assert error.ranks == [3] and error.code == 6
        assert str(error).startswith("rank 3 lost (3: connection from 127.0.0.1:")
        assert "missing 2: ['addr/2', 'addr/3']" in str(error)
        assert reader.requests["MGET"] == 1
        with pytest.raises(CollectiveTimeoutError):  # without watching, it waits
            reader.get_many(["addr/2"], 0.2)
        for c in (other_group, victim, reader):
            c.close()

    def test_set_and_get_many_publishes_then_reads_in_one_request(self, server, client):
        """SETMGET: the key is set before the read waits (a peer reading it is not held
        by this rank's wait), the read fails as get_many's does, and a SETMGET short of
        its key and value is refused, naming what it needs."""
        victim, reader = connect(server), connect(server)
        victim.register_rank(3)
        reader.register_rank(0)
        errors = []

        def read():
            try:
                reader.set_and_get_many("addr/0", b"a0", ["addr/3"], 60.0, watch_lost=True)
            except PeerLostError as e:
                errors.append(e)

        thread = threading.Thread(target=read)
        thread.start()
        assert client.get("addr/0", WAIT_S) == b"a0"  # published while its read waits
        victim._registration.sock.close()  # no goodbye
        thread.join(WAIT_S)
        assert len(errors) == 1 and errors[0].ranks == [3], errors
        assert reader.requests["SETMGET"] == 1 and "SET" not in reader.requests
        with pytest.raises(CollectiveTimeoutError, match="addr/9"):
            reader.set_and_get_many("addr/0", b"again", ["addr/9"], 0.2)
        assert client.get("addr/0", WAIT_S) == b"again"
        with pytest.raises(InvalidArgumentError, match="SETMGET needs a timeout, a watch"):
            reader._call(_wire.Op.SETMGET, [b"100", b"", b"addr/0"])
        for c in (victim, reader):
            c.close()

    def test_stopping_the_server_loses_nobody(self):
        s = RendezvousServer(host="127.0.0.1")
        s.start()
        c = connect(s)
        c.register_rank(0)
        s.stop()
        assert s.lost_ranks() == []
        c.close()


RANKS = 1024  # the scale of issue #33's goals


class TestGrowth:
    """What N ranks cost the service grows as N: requests, wake-ups, connections."""

    @pytest.mark.parametrize("n", [2, 64])
    @pytest.mark.parametrize("publish", ["SET+MGET", "SETMGET"])
    def test_a_ring_rendezvous_costs_each_rank_three_requests(self, server, n, publish):
        """Each of n ranks registers, publishes its address and reads its ring neighbours'
        in one MGET: 3 requests per rank, at most one wake-up per rank on the server; or
        publishes and reads in one SETMGET, as the core does: 2 requests."""
        clients = [connect(server) for _ in range(n)]
        got = [None] * n

        def rank(i):
            c = clients[i]
            c.register_rank(i)
            mine, peers = f"host{i}".encode(), [f"addr/{(i - 1) % n}", f"addr/{(i + 1) % n}"]
            if publish == "SETMGET":
                got[i] = c.set_and_get_many(f"addr/{i}", mine, peers, WAIT_S, watch_lost=True)
            else:
                c.set(f"addr/{i}", mine)
                got[i] = c.get_many(peers, WAIT_S, watch_lost=True)

        threads = [threading.Thread(target=rank, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert got == [[f"host{(i - 1) % n}".encode(), f"host{(i + 1) % n}".encode()]
                       for i in range(n)]
        for c in clients:
            assert c.requests == ({"REGISTER": 1, "SETMGET": 1} if publish == "SETMGET"
                                  else {"REGISTER": 1, "SET": 1, "MGET": 1})
            assert not c.retries
            c.close()
        assert server.store.wakeups <= n

    @pytest.fixture
    def files_for_both_ends(self):
        """An open-files limit for RANKS connections with both ends in this process."""
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        need = 2 * RANKS + 256
        if soft < need:
            if hard != resource.RLIM_INFINITY and hard < need:
                pytest.skip(f"needs {need} open files, the hard limit is {hard}")
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        yield
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    def test_a_thousand_connections_authenticating_at_once(self, files_for_both_ends):
        """RANKS connections accepted and greeted before any authenticates (ranks on other
        hosts, a round trip away, connecting at once), then all authenticate: the server's
        defaults keep every one (128 pending at most closed all but the last 128)."""
        with RendezvousServer(host="127.0.0.1") as server:
            socks = [raw_connect(server) for _ in range(RANKS)]
            try:
                assert server.connection_counts() == (0, RANKS)
                for sock, nonce in socks:
                    sock.sendall(_wire.signed_frame(_wire.Kind.REQUEST, server.secret,
                                                    server.run_id.encode(), nonce, 1,
                                                    _wire.Op.AUTH, []))
                for sock, nonce in socks:
                    assert _wire.parse_signed(_wire.read_frame(sock, 1 << 16),
                                              _wire.Kind.RESPONSE, server.secret,
                                              server.run_id.encode(), nonce)[:2] == (1, _wire.OK)
                assert server.connection_counts() == (RANKS, 0)
            finally:
                for sock, _ in socks:
                    sock.close()

    def test_a_thousand_ranks_connect_at_once(self, files_for_both_ends):
        """RANKS clients connect, authenticate and send a request at the same moment against
        the server's defaults: none is refused, reset or closed before authenticating (no
        retry), and every request gets through."""
        n = RANKS
        start = threading.Barrier(n)
        clients, errors = [None] * n, []

        def rank(i):
            start.wait()
            try:
                clients[i] = connect(server)
                clients[i].set(f"at-once/{i}", b"")
            except Exception as e:  # noqa: BLE001 - every failure is reported below
                errors.append(e)

        with RendezvousServer(host="127.0.0.1") as server:
            threads = [threading.Thread(target=rank, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60.0)
            assert not errors, f"{len(errors)} failed, e.g. {errors[0]!r}"
            assert None not in clients
            assert sum((c.retries for c in clients), Counter()) == Counter()
            assert len(server.store.keys("at-once/")) == n
            assert server.connection_counts() == (n, 0)
            for c in clients:
                c.close()


class TestEnv:
    def test_secret_round_trip(self):
        secret = os.urandom(32)
        assert env.secret_from_env(env.secret_to_env(secret)) == secret
        with pytest.raises(InvalidArgumentError):
            env.secret_from_env("not hex")

    def test_client_from_env(self, server):
        assert env.client_from_env({}) is None
        environ = env.rendezvous_env("127.0.0.1", server.port, server.secret, server.run_id)
        assert set(environ) == {env.RENDEZVOUS_ADDR_ENV_VAR, env.RENDEZVOUS_PORT_ENV_VAR,
                                env.SECRET_ENV_VAR, env.RUN_ID_ENV_VAR}
        c = env.client_from_env(environ)
        c.set("env", b"ok")
        assert server.get("env", 1.0) == b"ok"
        c.close()
        del environ[env.SECRET_ENV_VAR]
        with pytest.raises(InvalidArgumentError, match=env.SECRET_ENV_VAR):
            env.client_from_env(environ)


def until(condition, timeout_s=WAIT_S):
    """Wait for ``condition()`` to hold (polling); fails the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still not true after {timeout_s} s"
        threading.Event().wait(0.005)


def authenticated_raw(server):
    """A plain socket that has authenticated, and its nonce."""
    sock, nonce = raw_connect(server)
    sock.sendall(_wire.signed_frame(_wire.Kind.REQUEST, server.secret, server.run_id.encode(),
                                    nonce, 1, _wire.Op.AUTH, []))
    _wire.read_frame(sock, 1 << 16)
    return sock, nonce


def closed_by_server(sock):
    sock.settimeout(WAIT_S)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def warnings_about(caplog, text):
    return [r for r in caplog.records
            if r.levelname == "WARNING" and text in r.getMessage()]


class TestHostileConnections:
    @pytest.mark.parametrize("sent", [b"", b"\x00\x00", struct.pack(">I", 100) + b"\x02" * 10],
                             ids=["silent", "half-a-header", "half-a-frame"])
    def test_unauthenticated_connections_are_closed_after_the_deadline(self, sent, caplog):
        with RendezvousServer(host="127.0.0.1", handshake_timeout_s=0.3) as server:
            idle, nonce = authenticated_raw(server)
            slow, _ = raw_connect(server)
            with idle, slow:
                slow.sendall(sent)
                start = time.monotonic()
                assert closed_by_server(slow)
                assert time.monotonic() - start < WAIT_S
                # an authenticated connection may stay idle past the deadline
                idle.sendall(_wire.signed_frame(_wire.Kind.REQUEST, server.secret,
                                                server.run_id.encode(), nonce, 2, _wire.Op.SET,
                                                [b"k", b"v"]))
                _wire.read_frame(idle, 1 << 16)
            assert server.get("k", 1.0) == b"v"
        assert warnings_about(caplog, "did not authenticate within 0.3 s")

    def test_a_frame_stalled_after_authenticating_is_dropped(self, caplog):
        with RendezvousServer(host="127.0.0.1", frame_timeout_s=0.3) as server:
            sock, _ = authenticated_raw(server)
            with sock:
                sock.sendall(struct.pack(">I", 100) + b"\x02" * 10)
                assert closed_by_server(sock)
        assert warnings_about(caplog, "then nothing for 0.3 s")

    def test_pending_connections_are_capped_and_clients_get_through(self):
        with RendezvousServer(host="127.0.0.1", max_pending=8) as server:
            flood = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(200)]
            try:
                threads = threading.active_count()
                c = connect(server)  # the oldest pending connections make room
                c.set("through", b"1")
                assert c.get("through", 1.0) == b"1"
                authenticated, pending = server.connection_counts()
                assert authenticated == 1 and pending <= 8
                assert threading.active_count() <= threads + 2  # a worker for the requests
                c.close()
            finally:
                for s in flood:
                    s.close()

    def test_authenticated_connections_are_capped(self, caplog):
        with RendezvousServer(host="127.0.0.1", max_connections=3) as server:
            clients = [connect(server) for _ in range(3)]
            with pytest.raises(StoreError, match="max_connections=3"):
                connect(server)
            clients.pop().close()
            until(lambda: server.connection_counts()[0] < 3)
            clients.append(connect(server))
            clients[-1].set("k", b"v")
            for c in clients:
                c.close()
        assert len(warnings_about(caplog, "max_connections=3")) == 1

    def test_refusals_are_logged_at_a_bounded_rate(self, server, client, caplog):
        for _ in range(20):
            with pytest.raises(AuthenticationError):
                RendezvousClient("127.0.0.1", server.port, b"not the secret", server.run_id)
        assert len(warnings_about(caplog, "wrong secret or run id")) == 1
        client.set("still", b"serving")

    def test_rate_limited_log_counts_what_it_held_back(self, caplog):
        import logging

        from spark_hvd.runner._ratelimit import RateLimitedLog

        now = [0.0]
        log = RateLimitedLog(logging.getLogger("test.ratelimit"), 10.0, clock=lambda: now[0])
        for t in (0.0, 1.0, 2.0, 3.0, 5.0, 12.0):
            now[0] = t
            log.warning("a", "event at %g", t)
            log.warning("b", "other at %g", t)
        messages = [r.getMessage() for r in caplog.records]
        assert messages == ["event at 0", "other at 0",
                            "event at 12 (and 4 more like it in the last 12 s)",
                            "other at 12 (and 4 more like it in the last 12 s)"]


SERVE = """
import json, resource, sys
from spark_hvd.runner.rendezvous import RendezvousServer
nofile = int(sys.argv[1])
if nofile:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
with RendezvousServer(host="127.0.0.1", max_pending=int(sys.argv[2])) as s:
    print(json.dumps([s.port, s.secret.hex(), s.run_id]), flush=True)
    sys.stdin.read()  # until the test closes stdin
"""
FLOOD = 3000


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
@pytest.mark.parametrize("nofile, max_pending", [
    pytest.param(0, 128, id="no-limit"),
    pytest.param(256, 128, id="256-fds"),
    pytest.param(64, 1000, id="out-of-fds-first"),  # descriptors run out before the budget
])
def test_a_flood_of_idle_connections(nofile, max_pending, tmp_path):
    """The server (another process) holds a bounded number of descriptors and threads while
    thousands of connections sit idle, and legitimate clients connect during and after."""
    import json
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < FLOOD + 500:
        pytest.skip("the open-files limit of this process is below the flood")
    with open(tmp_path / "stderr", "w+") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", SERVE, str(nofile), str(max_pending)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                env=dict(os.environ, PYTHONPATH=ROOT))
        flood = []
        try:
            port, secret, run_id = json.loads(proc.stdout.readline())

            def usage():
                return (len(os.listdir(f"/proc/{proc.pid}/fd")),
                        len(os.listdir(f"/proc/{proc.pid}/task")))

            def legitimate(key):
                c = RendezvousClient("127.0.0.1", port, bytes.fromhex(secret), run_id)
                c.set(key, b"v")
                assert c.get(key, WAIT_S) == b"v"
                c.close()

            fds0, threads0 = usage()
            flooder = threading.Thread(target=lambda: flood.extend(
                socket.create_connection(("127.0.0.1", port)) for _ in range(FLOOD)))
            flooder.start()
            peak, rounds = (fds0, threads0), 0
            while flooder.is_alive() or rounds == 0:
                legitimate(f"during/{rounds}")
                peak = tuple(map(max, peak, usage()))
                rounds += 1
            flooder.join()
            assert len(flood) == FLOOD
            legitimate("all-open")  # every flood connection still open on this side
            peak = tuple(map(max, peak, usage()))
            for s in flood:
                s.close()
            legitimate("after")
            fds, threads = peak
            assert fds <= fds0 + max_pending + 8, (fds0, fds)  # the pending budget, a client
            assert not nofile or fds <= nofile
            assert threads <= threads0 + 4, (threads0, threads)
        finally:
            for s in flood:
                s.close()
            proc.stdin.close()
            proc.wait(WAIT_S)
        stderr.seek(0)
        lines = stderr.read().splitlines()
    assert proc.returncode == 0, lines
    assert len(lines) < 20, lines  # thousands of connections closed, a few warnings
    if 0 < nofile < max_pending:
        assert any("out of file descriptors" in line for line in lines), lines
