"""Run a generator in a background thread, handing its items over through a bounded queue.

Protocol between the producer thread and the consumer:

1. The producer pulls the next item from the generator, then checks the ``stop`` event; if
   set it stops, otherwise it puts the item into the queue (blocking while the queue is full).
2. When the generator ends the producer puts the ``_END`` marker; when it raises, it puts a
   ``_Failure`` carrying the exception, which the consumer re-raises as is.
3. ``close()`` (called when the consumer finishes, breaks out of its loop, or the consuming
   generator is garbage collected) sets ``stop``, then empties the queue so a producer
   blocked in ``put`` wakes up, sees ``stop`` and exits, and joins the thread.  At most one
   more item can be put after ``stop`` is set, and the emptied queue has room for it, so the
   join cannot hang on a full queue.  Then it puts ``_END`` so that a consumer blocked in
   ``get`` in another thread ends its loop instead of waiting forever.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Generic, Iterator, Optional, TypeVar

T = TypeVar("T")

_END = object()


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Prefetcher(Generic[T]):
    """Iterate over ``make_iter()`` in a daemon thread, at most ``depth`` items ahead."""

    def __init__(self, make_iter: Callable[[], Iterator[T]], depth: int,
                 name: str = "spark_hvd-prefetch") -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._queue: "queue.Queue[object]" = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._make_iter = make_iter
        self._thread: Optional[threading.Thread] = threading.Thread(
            target=self._produce, name=name, daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        it = None
        try:
            it = self._make_iter()
            for item in it:
                if self._stop.is_set():
                    return
                self._queue.put(item)
            if not self._stop.is_set():
                self._queue.put(_END)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            if not self._stop.is_set():
                self._queue.put(_Failure(exc))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def __iter__(self) -> Iterator[T]:
        try:
            while True:
                item = self._queue.get()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.exc
                yield item  # type: ignore[misc]
        finally:
            self.close()

    def close(self) -> None:
        """Stop the producer and wait for its thread to end (idempotent)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        self._drain()
        thread.join()
        # Wake a consumer blocked in get() in another thread: its loop ends.
        self._drain()
        self._queue.put_nowait(_END)

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
