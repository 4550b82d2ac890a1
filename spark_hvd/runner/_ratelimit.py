"""Warnings that a hostile or broken peer can trigger at will, logged at a bounded rate."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict

DEFAULT_INTERVAL_S = 10.0


class RateLimitedLog:
    """Logs at most one warning per ``interval_s`` for each reason.

    The warnings held back are counted, and the next one logged for that reason
    says how many there were.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: Dict[str, float] = {}
        self._held: Dict[str, int] = {}

    def warning(self, reason: str, msg: str, *args: object) -> None:
        """Log ``msg % args`` unless a warning for ``reason`` was logged within the interval."""
        with self._lock:
            now = self._clock()
            last = self._last.get(reason)
            if last is not None and now - last < self._interval_s:
                self._held[reason] = self._held.get(reason, 0) + 1
                return
            self._last[reason] = now
            held = self._held.pop(reason, 0)
        if held:
            msg += " (and %d more like it in the last %.0f s)"
            args += (held, now - last)
        self._logger.warning(msg, *args)
