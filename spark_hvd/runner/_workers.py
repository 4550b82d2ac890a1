"""The threads that run the rendezvous server's requests (internal to spark_hvd.runner)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, List, Optional

logger = logging.getLogger(__name__)


class Workers:
    """Daemon threads that run submitted jobs.

    A thread is started only when no started one is idle, and at most ``limit``
    are; they then wait for more jobs until :meth:`stop`.  So the thread count
    follows the jobs in flight at once.  A job that finds every thread busy at the
    limit waits for one.  Not thread-safe: one thread submits, then stops.
    """

    def __init__(self, name: str, limit: int) -> None:
        self._name = name
        self._limit = limit
        self._jobs: "queue.SimpleQueue[Optional[Callable[[], None]]]" = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._threads: List[threading.Thread] = []

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)
        if self._idle.acquire(blocking=False) or len(self._threads) >= self._limit:
            return
        thread = threading.Thread(target=self._work, daemon=True,
                                  name=f"{self._name}-{len(self._threads)}")
        self._threads.append(thread)
        thread.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # a thread that died would leave its idle slot counted
                logger.exception("%s: a job failed", self._name)
            self._idle.release()

    def stop(self, timeout_s: float) -> None:
        """Let every thread finish its job and exit; waits up to ``timeout_s`` in all."""
        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
