"""This process's spark_hvd state, below the collectives that use it.

One :class:`_Runtime` object (``RUNTIME``) holds what init() sets up besides the
native engine: the rendezvous client, this rank's topology, the counters behind
generated op names. Here too: the queries on it (rank, size, ...), process sets,
and :func:`explain_failure`, which the collectives (``spark_hvd._ops``) apply to
the core's errors. init/shutdown and process-set registration run collectives, so
they live above those, in ``spark_hvd._basics``.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import List, Optional, Sequence

from spark_hvd import _config, _core
from spark_hvd._job.client import RendezvousClient
from spark_hvd._job.topology import Topology
from spark_hvd.exceptions import (InvalidArgumentError, NotInitializedError, PeerLostError,
                                  SparkHvdError, format_ranks)


class _Runtime:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.client: Optional[RendezvousClient] = None
        self.store_prefix = ""
        self.topology: Optional[Topology] = None
        self.init_count = 0
        self.atexit_registered = False
        self.name_counters: dict = {}  # (op, process set id) -> itertools.count
        # An elastic job's worker: its own registration (kept across resets), its id,
        # how many places it asked for, the epoch it is in, and the workers its last
        # failure named lost (its next request tells the coordinator).
        self.worker_client: Optional[RendezvousClient] = None
        self.elastic_worker: Optional[int] = None
        self.elastic_requests = 0
        self.epoch = None
        self.lost_workers: list = []

    # -- names -------------------------------------------------------------
    def auto_name(self, op: str, process_set_id: Optional[int] = 0) -> str:
        """Deterministic name for an unnamed op: identical across the ranks of a
        process set that issue their unnamed ops of each kind in the same order."""
        counter = self.name_counters.get((op, process_set_id))
        if counter is None:
            with self.lock:
                counter = self.name_counters.setdefault((op, process_set_id), itertools.count())
        n = next(counter)  # one step under the GIL: threads never share a number
        return f"{op}.noname.{n}" if not process_set_id else f"{op}.noname.ps{process_set_id}.{n}"

    # -- lost ranks --------------------------------------------------------
    def exited_key(self, rank_: int) -> str:
        return f"{self.store_prefix}/__exited__/{rank_}"

    def exited_ranks(self) -> List[int]:
        """Ranks that shut down cleanly (they leave a mark in the store first)."""
        if self.client is None:
            return []
        try:
            keys = self.client.keys(self.exited_key(0)[:-1])
        except Exception:  # the service may be gone with the driver
            return []
        return sorted(int(k.rsplit("/", 1)[1]) for k in keys)

    def lost_ranks(self, wait_s: float) -> List[int]:
        """Ranks the rendezvous service saw disappear; waits up to wait_s for news."""
        if self.client is None:
            return []
        deadline = time.monotonic() + wait_s
        while True:
            try:
                lost = self.client.lost_ranks()
            except Exception:  # the service may be gone with the driver
                return []
            if lost or time.monotonic() >= deadline:
                return lost
            time.sleep(0.05)  # polling a remote fact on an error path; bounded by wait_s


RUNTIME = _Runtime()


def explain_failure(exc: SparkHvdError) -> SparkHvdError:
    """Adds what the rendezvous service knows to a PeerLostError the core could not
    name the lost ranks of: which peers vanished (crashed or unreachable: the cause),
    or else which had already shut down cleanly (often ranks that stopped on the same
    failure first, or a rank that left while others still ran collectives)."""
    if not isinstance(exc, PeerLostError) or exc.ranks:
        return exc
    me = _core.rank() if _core.is_initialized() else -1
    lost = [r for r in RUNTIME.lost_ranks(0.0) if r != me]
    exited = [] if lost else [r for r in RUNTIME.exited_ranks() if r != me]
    if exited:
        return PeerLostError(f"{exc.message} -- {format_ranks(exited)} had already shut down "
                             "(called shutdown() or exited); every rank must run the same "
                             "collectives", ranks=exited, tensor=exc.tensor)
    if not lost:
        lost = RUNTIME.lost_ranks(_config.lost_rank_wait_s())
    if lost:
        return PeerLostError(f"{exc.message} -- lost {format_ranks(lost)} (the process "
                             "exited or its host is unreachable)", ranks=lost, tensor=exc.tensor)
    return exc


# -- where this rank sits ------------------------------------------------------------

def _topology() -> Topology:
    # Still answers after a peer failure stopped the engine; only shutdown() clears it.
    if RUNTIME.topology is None:
        raise NotInitializedError("spark_hvd is not initialized: call spark_hvd.init() first")
    return RUNTIME.topology


def rank() -> int:
    return _topology().rank


def size() -> int:
    return _topology().size


def local_rank() -> int:
    return _topology().local_rank


def local_size() -> int:
    return _topology().local_size


def cross_rank() -> int:
    return _topology().cross_rank


def cross_size() -> int:
    return _topology().cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    t = _topology()
    return t.local_size * t.cross_size == t.size


def require_initialized() -> None:
    """NotInitializedError unless init() has run (and shutdown() has not)."""
    _topology()


# -- process sets ----------------------------------------------------------------------

class ProcessSet:
    """A subset of ranks with its own collectives (Horovod's ``hvd.ProcessSet``).

    Create it on every rank with the same ranks, in the same order relative to
    other process-set calls, either through ``init(process_sets=[...])`` or
    ``add_process_set``. Ops take it as ``process_set=``.
    """

    def __init__(self, ranks: Sequence[int]) -> None:
        ranks = sorted(int(r) for r in ranks)
        if len(set(ranks)) != len(ranks) or not ranks:
            raise InvalidArgumentError(f"a process set needs distinct ranks, got {list(ranks)}")
        self.ranks: List[int] = ranks
        self.process_set_id: Optional[int] = None

    def _require(self) -> int:
        if self.process_set_id is None:
            raise InvalidArgumentError(
                f"process set {self.ranks} is not registered: pass it to init(process_sets=...) or "
                "add_process_set() on every rank first")
        return self.process_set_id

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set, or -1 if it is not a member."""
        me = rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> bool:
        return rank() in self.ranks

    def _set_rank_of(self, global_rank: int) -> int:
        """The set rank of ``global_rank``: a broadcast's root_rank is a global rank,
        as in Horovod, and the core takes the root's rank within the set."""
        if global_rank not in self.ranks:
            raise InvalidArgumentError(
                f"root_rank {global_rank} is not a member of process set {self.ranks}: "
                "root_rank is a global rank (as in Horovod); pass one of the set's ranks")
        return self.ranks.index(global_rank)

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    def __init__(self) -> None:
        self.ranks = []
        self.process_set_id = 0

    def _require(self) -> int:
        return 0

    def size(self) -> int:
        return size()

    def rank(self) -> int:
        return rank()

    def included(self) -> bool:
        return True

    def _set_rank_of(self, global_rank: int) -> int:
        return global_rank

    def __repr__(self) -> str:
        return "global_process_set"


global_process_set = _GlobalProcessSet()
