"""The in-memory key-value store behind the rendezvous service.

Keys are strings, values bytes.  Every blocking call waits on one condition
variable that every write notifies, so a ``get`` returns as soon as the key is
set and never polls.
"""

from __future__ import annotations

import threading
import time
from typing import Dict, List, Sequence

from spark_hvd.exceptions import CollectiveTimeoutError, InvalidArgumentError, StoreError

DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 1e8  # ~3 years: beyond what condition waits and socket timeouts accept


def check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise InvalidArgumentError(f"a rendezvous key must be a non-empty str, got {key!r}")
    return key


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


class InMemoryStore:
    """A thread-safe key-value store with blocking reads.

    Parameters
    ----------
    name:
        How timeout messages name this store (e.g. the server address and run id).
    """

    def __init__(self, name: str = "rendezvous store") -> None:
        self._name = name
        self._data: Dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``, replacing any previous value; never blocks."""
        key, value = check_key(key), check_value(value)
        with self._cond:
            self._check_open()
            self._data[key] = value
            self._cond.notify_all()

    def get(self, key: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bytes:
        """The value of ``key``, blocking until it is set.

        Raises
        ------
        CollectiveTimeoutError
            when the key is still missing after ``timeout_s`` seconds.
        """
        key = check_key(key)
        with self._cond:
            self._wait_locked([key], check_timeout(timeout_s))
            return self._data[key]

    def wait(self, keys: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Block until every key in ``keys`` is set (CollectiveTimeoutError after ``timeout_s``)."""
        keys = [check_key(k) for k in keys]
        with self._cond:
            self._wait_locked(keys, check_timeout(timeout_s))

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in ``keys`` is set; never blocks."""
        keys = [check_key(k) for k in keys]
        with self._cond:
            self._check_open()
            return all(k in self._data for k in keys)

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer counter ``key`` (0 when unset).

        The counter is stored as ASCII decimal; returns the new value.
        """
        key = check_key(key)
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise InvalidArgumentError(f"add() needs an int amount, got {amount!r}")
        with self._cond:
            self._check_open()
            old = self._data.get(key, b"0")
            try:
                value = int(old) + amount
            except ValueError:
                raise StoreError(
                    f"add({key!r}): the key holds {old[:32]!r}, not an integer counter") from None
            self._data[key] = str(value).encode("ascii")
            self._cond.notify_all()
            return value

    def delete(self, key: str) -> bool:
        """Remove ``key``; returns whether it existed."""
        key = check_key(key)
        with self._cond:
            self._check_open()
            return self._data.pop(key, None) is not None

    def keys(self, prefix: str = "") -> List[str]:
        """The keys starting with ``prefix``, sorted."""
        if not isinstance(prefix, str):
            raise InvalidArgumentError(f"prefix must be a str, got {prefix!r}")
        with self._cond:
            self._check_open()
            return sorted(k for k in self._data if k.startswith(prefix))

    def close(self) -> None:
        """Refuse further calls and wake every blocked ``get``/``wait`` with StoreError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self._name} is shut down (the job is ending)")

    def _wait_locked(self, keys: List[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_open()
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                what = (f"key {missing[0]!r}" if len(keys) == 1
                        else f"keys {keys!r} (missing {missing!r})")
                raise CollectiveTimeoutError(
                    f"timed out after {timeout_s:g} s waiting for rendezvous {what} in "
                    f"{self._name}; a rank may have failed to start or crashed, or the "
                    f"timeout is too short (SPARK_HVD_START_TIMEOUT_S)")
            self._cond.wait(remaining)
