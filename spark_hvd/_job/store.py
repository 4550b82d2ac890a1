"""The in-memory key-value store behind the rendezvous service.

Keys are strings, values bytes.  A blocking call never polls, and a write wakes
only the calls waiting for it:

1. A call that finds keys missing registers a waiter (an Event) on each key it
   misses, and on the watched prefix if it watches one (``get_many``), then waits
   on its Event without the lock.
2. ``set``/``add`` of a key takes that key's waiters off it and crosses the key off
   each one's missing set; a waiter whose set is now empty is woken.  A write under
   a watched prefix wakes that prefix's waiters.  ``close`` wakes every waiter.
3. A woken call looks again under the lock: every key there, it returns; a key
   deleted since it was set, it registers again; the store closed, StoreError; a
   key under its watched prefix, PeerLostError.

So N calls blocked on N distinct keys cost N wake-ups for N writes, not N^2 (one
condition notified on every write woke every blocked call); a call for K keys is
woken once, not once per key.  :attr:`InMemoryStore.wakeups` counts them.
"""

from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional, Sequence, Set, Tuple

from spark_hvd.exceptions import (CollectiveTimeoutError, InvalidArgumentError, PeerLostError,
                                  StoreError)

DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 1e8  # ~3 years: beyond what condition waits and socket timeouts accept
_SHOWN_KEYS = 8  # how many keys an error message lists before "... and N more"


def check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise InvalidArgumentError(f"a rendezvous key must be a non-empty str, got {key!r}")
    return key


def check_keys(keys: object) -> List[str]:
    """A list of keys (a str is one key, not a sequence of them: refused)."""
    if isinstance(keys, (str, bytes)):
        raise InvalidArgumentError(f"keys must be a sequence of str keys, got the one key "
                                   f"{keys!r}; wrap it in a list")
    return [check_key(k) for k in keys]


def check_value(value: object) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError(
            f"a rendezvous value must be bytes, got {type(value).__name__}; encode it first")
    return bytes(value)


def check_timeout(timeout_s: object) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or not 0 <= timeout_s <= MAX_TIMEOUT_S:
        raise InvalidArgumentError(
            f"timeout_s must be a number of seconds in [0, {MAX_TIMEOUT_S:g}], got {timeout_s!r}")
    return float(timeout_s)


def _split(key: str) -> Tuple[str, str]:
    """``(parent, name)``: ``"a/b/c"`` is ``("a/b/", "c")``, ``"c"`` is ``("", "c")``."""
    head, sep, name = key.rpartition("/")
    return head + sep, name


def _listed(keys: Sequence[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_SHOWN_KEYS])
    more = len(keys) - _SHOWN_KEYS
    return f"[{shown}{f', ... and {more} more' if more > 0 else ''}]"


def _what(keys: Sequence[str], missing: Sequence[str]) -> str:
    if len(keys) == 1:
        return f"key {keys[0]!r}"
    return f"keys {_listed(keys)} (missing {len(missing)}: {_listed(missing)})"


class _Waiter:
    """A blocked call: the keys it still misses and the Event that wakes it."""

    __slots__ = ("event", "missing")

    def __init__(self, missing: Set[str]) -> None:
        self.event = threading.Event()
        self.missing = missing


class InMemoryStore:
    """A thread-safe key-value store with blocking reads (see the module notes).

    Parameters
    ----------
    name:
        How timeout messages name this store (e.g. the server address and run id).
    """

    def __init__(self, name: str = "rendezvous store") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._data: Dict[str, bytes] = {}
        # parent ("a/b/") -> names of the keys directly under it: a watch's first look
        self._children: Dict[str, Set[str]] = {}
        self._waiters: Dict[str, Set[_Waiter]] = {}  # key -> blocked calls missing it
        self._watchers: Dict[str, Set[_Waiter]] = {}  # parent -> blocked calls watching it
        self._closed = False
        #: Blocked calls woken so far (each a thread switch on the server): what the
        #: tests of the store's growth count.
        self.wakeups = 0

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``, replacing any previous value; never blocks."""
        key, value = check_key(key), check_value(value)
        with self._lock:
            self._check_open()
            self._put(key, value)

    def get(self, key: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bytes:
        """The value of ``key``, blocking until it is set.

        Raises
        ------
        CollectiveTimeoutError
            when the key is still missing after ``timeout_s`` seconds.
        """
        key = check_key(key)
        with self._lock:
            self._await_locked([key], check_timeout(timeout_s), None)
            return self._data[key]

    def get_many(self, keys: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S,
                 abort_prefix: Optional[str] = None) -> List[bytes]:
        """The values of ``keys`` in their order, blocking until every one is set.

        ``abort_prefix`` (``""`` or ending in ``/``): while keys are missing, a key
        directly under it (``abort_prefix + name``, no ``/`` in ``name``) ends the wait
        at once.  The rendezvous server watches a group's lost ranks so
        (``__lost__/<rank>``): the error names them.

        Raises
        ------
        CollectiveTimeoutError
            when keys are still missing after ``timeout_s`` seconds.
        PeerLostError
            when a key exists under ``abort_prefix`` while keys are missing; ``ranks``:
            the names under it that are integers.
        """
        keys = check_keys(keys)
        if abort_prefix is not None and (not isinstance(abort_prefix, str)
                                         or abort_prefix and not abort_prefix.endswith("/")):
            raise InvalidArgumentError(f"abort_prefix must be None, '' or a str ending in '/', "
                                       f"got {abort_prefix!r}")
        with self._lock:
            self._await_locked(keys, check_timeout(timeout_s), abort_prefix)
            return [self._data[k] for k in keys]

    def wait(self, keys: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Block until every key in ``keys`` is set (CollectiveTimeoutError after ``timeout_s``)."""
        keys = check_keys(keys)
        with self._lock:
            self._await_locked(keys, check_timeout(timeout_s), None)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in ``keys`` is set; never blocks."""
        keys = check_keys(keys)
        with self._lock:
            self._check_open()
            return all(k in self._data for k in keys)

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer counter ``key`` (0 when unset).

        The counter is stored as ASCII decimal; returns the new value.
        """
        key = check_key(key)
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise InvalidArgumentError(f"add() needs an int amount, got {amount!r}")
        with self._lock:
            self._check_open()
            old = self._data.get(key, b"0")
            try:
                value = int(old) + amount
            except ValueError:
                raise StoreError(
                    f"add({key!r}): the key holds {old[:32]!r}, not an integer counter") from None
            self._put(key, str(value).encode("ascii"))
            return value

    def delete(self, key: str) -> bool:
        """Remove ``key``; returns whether it existed."""
        key = check_key(key)
        with self._lock:
            self._check_open()
            if self._data.pop(key, None) is None:
                return False
            parent, name = _split(key)
            names = self._children[parent]
            names.discard(name)
            if not names:
                del self._children[parent]
            return True

    def keys(self, prefix: str = "") -> List[str]:
        """The keys starting with ``prefix``, sorted."""
        if not isinstance(prefix, str):
            raise InvalidArgumentError(f"prefix must be a str, got {prefix!r}")
        with self._lock:
            self._check_open()
            return sorted(k for k in self._data if k.startswith(prefix))

    def close(self) -> None:
        """Refuse further calls and wake every blocked call with StoreError."""
        with self._lock:
            self._closed = True
            for waiters in (*self._waiters.values(), *self._watchers.values()):
                for waiter in waiters:
                    self._wake(waiter)

    # -- under the lock ----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self._name} is shut down (the job is ending)")

    def _put(self, key: str, value: bytes) -> None:
        parent, name = _split(key)
        if key not in self._data:
            self._children.setdefault(parent, set()).add(name)
        self._data[key] = value
        for waiter in self._waiters.pop(key, ()):
            waiter.missing.discard(key)
            if not waiter.missing:
                self._wake(waiter)
        for waiter in self._watchers.get(parent, ()):
            self._wake(waiter)

    def _wake(self, waiter: _Waiter) -> None:
        if not waiter.event.is_set():
            waiter.event.set()
            self.wakeups += 1

    def _await_locked(self, keys: List[str], timeout_s: float, watch: Optional[str]) -> None:
        """Return, the lock held, once every key is set (steps 1 and 3 of the notes)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_open()
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return
            if watch is not None and watch in self._children:
                raise self._lost(watch, keys, missing)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CollectiveTimeoutError(
                    f"timed out after {timeout_s:g} s waiting for rendezvous "
                    f"{_what(keys, missing)} in {self._name}; a rank may have failed to start "
                    f"or crashed, or the timeout is too short (SPARK_HVD_START_TIMEOUT_S)")
            waiter = _Waiter(set(missing))
            for key in waiter.missing:
                self._waiters.setdefault(key, set()).add(waiter)
            if watch is not None:
                self._watchers.setdefault(watch, set()).add(waiter)
            self._lock.release()
            try:
                waiter.event.wait(remaining)
            finally:
                self._lock.acquire()
                self._forget(waiter, watch)

    def _forget(self, waiter: _Waiter, watch: Optional[str]) -> None:
        """Take ``waiter`` off the keys it still misses and off its watch."""
        for table, names in ((self._waiters, waiter.missing),
                             (self._watchers, () if watch is None else (watch,))):
            for name in names:
                waiters = table.get(name)
                if waiters is not None:
                    waiters.discard(waiter)
                    if not waiters:
                        del table[name]

    def _lost(self, watch: str, keys: List[str], missing: List[str]) -> PeerLostError:
        names = sorted(self._children[watch], key=lambda n: (not n.isdigit(), len(n), n))
        ranks = [int(n) for n in names if n.isdigit()]
        why = "; ".join(f"{n}: {self._data[watch + n][:200].decode('utf-8', 'replace')}"
                        for n in names[:_SHOWN_KEYS])
        return PeerLostError(
            f"rank{'s' if len(names) > 1 else ''} {','.join(names)} lost ({why}) while waiting "
            f"for rendezvous {_what(keys, missing)} in {self._name}; a rank's process ended or "
            f"its connection broke: its output says why", ranks=ranks)
