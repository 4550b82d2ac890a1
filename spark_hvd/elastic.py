"""Elastic training, as Horovod's ``hvd.elastic``: state that survives a changing job.

A function decorated with :func:`run` takes a :class:`State` first. It is called after
the state has been synchronised from rank 0; when a collective fails (a rank was lost:
HorovodInternalError) the state goes back to its last :meth:`State.commit`, when the
membership changes (HostsUpdatedInterrupt, raised by ``commit()`` or
``check_host_updates()`` on every rank at once) it is kept; either way spark_hvd shuts
down and initialises again with the new membership (new rank numbers, new size), the
reset callbacks run, the state is synchronised from the new rank 0 (Horovod's order: a
callback's changes to synced state are overwritten), and the function is called again.
So a failure costs at most the work since the last commit.

The framework states are ``spark_hvd.torch.elastic.TorchState``,
``spark_hvd.tensorflow.elastic.TensorFlowKerasState`` and friends; :class:`ObjectState`
here holds plain Python values. Outside an elastic job (plain ``spark-hvdrun -np``,
``spark_hvd.spark.run``) the same code runs, and a failure ends the job as usual.
"""

from __future__ import annotations

import copy
import functools
import logging
from typing import Any, Callable, Dict, Iterable, List, Optional

from spark_hvd._job import elastic as _proto
from spark_hvd._job.elastic import ElasticJobError, WorkerRemoved
from spark_hvd.exceptions import HorovodInternalError, HostsUpdatedInterrupt, PeerLostError

__all__ = ["State", "ObjectState", "run", "run_fn", "ElasticJobError", "WorkerRemoved"]

logger = logging.getLogger(__name__)


def _in_elastic_job() -> bool:
    """Whether this process joined an elastic job's epoch (it stays so across resets)."""
    from spark_hvd._runtime import RUNTIME

    return RUNTIME.epoch is not None


def _pending_updates() -> Optional[bool]:
    """This rank's view of membership changes signalled since its epoch formed: None, or
    whether they are all removals. None outside an elastic job."""
    from spark_hvd._runtime import RUNTIME

    epoch, client = RUNTIME.epoch, RUNTIME.client
    if epoch is None or client is None:
        return None
    return _proto.pending_updates(client, epoch.updates)


class State:
    """What a training function keeps across resets (Horovod's ``hvd.elastic.State``).

    Subclasses implement :meth:`save`, :meth:`restore` and :meth:`sync`.
    ``bcast_object(obj)`` broadcasts a picklable object from rank 0 and ``get_rank()``
    gives this rank, in the framework the subclass is for; by default spark_hvd's own
    (every framework's ``broadcast_object`` and ``rank`` come down to them).
    """

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None) -> None:
        if bcast_object is None or get_rank is None:
            from spark_hvd import _ops, _runtime

            bcast_object = bcast_object or _ops.broadcast_object
            get_rank = get_rank or _runtime.rank
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions called, in order, after each reset (after the state was synced)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float = 0.0, update_res: Any = None) -> None:
        """Horovod's notification hook; membership changes are read from the job's
        rendezvous service at :meth:`check_host_updates` instead."""

    def commit(self) -> None:
        """Saves the state (what a failure rolls back to), then checks for membership
        changes: HostsUpdatedInterrupt on every rank when there are some."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises HostsUpdatedInterrupt on every rank, at the same call, when workers
        wait to join or are to leave. Rank 0's view decides, so all ranks agree; it is a
        broadcast, so every rank must call this (``commit()`` does) at the same point."""
        if not _in_elastic_job():  # nothing can change
            return
        update = self._bcast_object(_pending_updates() if self._rank() == 0 else None)
        if update is not None:
            raise HostsUpdatedInterrupt(bool(update), "the job's membership changed")

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class ObjectState(State):
    """State made of picklable attributes: ``ObjectState(epoch=0)`` (or Horovod's
    ``ObjectState(bcast_object, get_rank, epoch=0)``) gives ``state.epoch``; commit()
    saves a copy, restore() puts it back, sync() broadcasts rank 0's saved values."""

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None, **kwargs: Any) -> None:
        self._saved_state: Dict[str, Any] = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name))
                             for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()


def run_fn(func: Callable, reset: Callable[[], None]) -> Callable:
    """``func(state, ...)`` made elastic, with ``reset()`` re-initialising the framework
    (shutdown, then init with the new membership)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        try:
            while True:
                try:
                    if not skip_sync:
                        state.sync()
                    return func(state, *args, **kwargs)
                except HorovodInternalError as e:
                    if not _in_elastic_job():  # no one re-forms it: the job fails
                        raise
                    _note_lost(e)
                    logger.warning("elastic: collective failed (%s); restoring the last "
                                   "commit and re-forming the job", e)
                    state.restore()
                    skip_sync = False
                except HostsUpdatedInterrupt as e:
                    skip_sync = e.skip_sync
                _reset_until_formed(reset, state)
                state.on_reset()
        except WorkerRemoved as e:
            logger.warning("elastic: %s; this process exits", e)
            raise SystemExit(0) from None

    return wrapper


def _note_lost(error: HorovodInternalError) -> None:
    """Keeps the workers a PeerLostError named lost for the next request for a place."""
    from spark_hvd._runtime import RUNTIME

    if isinstance(error, PeerLostError):
        RUNTIME.lost_workers = _proto.lost_workers(RUNTIME.epoch, error.ranks or [])


def _reset_until_formed(reset: Callable[[], None], state: State) -> None:
    """Runs ``reset`` until the new epoch's ranks have connected: a rank lost while they
    connect fails the attempt (HorovodInternalError), and the survivors form another."""
    while True:
        try:
            reset()
            return
        except HorovodInternalError as e:
            _note_lost(e)
            logger.warning("elastic: re-forming the job failed (%s); trying again", e)
            state.restore()


def _reset() -> None:
    from spark_hvd import _basics

    _basics.shutdown()
    _basics.init()


def run(func: Callable) -> Callable:
    """Decorator: ``@hvd.elastic.run def train(state, ...)`` (see the module docstring)."""
    return run_fn(func, _reset)

