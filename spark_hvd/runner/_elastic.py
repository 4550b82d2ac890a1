"""The coordinator of an elastic job: forms its membership epochs.

It runs beside the job's :class:`~spark_hvd.runner.rendezvous.RendezvousServer` (in
``spark-hvdrun`` or the Spark driver) and speaks the protocol of
:mod:`spark_hvd._job.elastic` through the server's store, in process. A launcher starts
workers (processes, Spark tasks) and tells the coordinator only which ones should leave
(:meth:`Coordinator.remove`); which workers are alive it reads from their registrations.

When an epoch forms:

- first: once ``num_proc`` workers ask (or, after ``start_timeout_s``, at least
  ``min_num_proc``);
- then: once every live member of the running epoch asks again (they do after a failed
  collective, or after a membership change interrupted them). A member that the others'
  requests name lost (their PeerLostError's ranks) and that has not asked within
  ``NAMED_LOST_GRACE_S`` of being named is left out, as if its registration had dropped:
  a host cut off keeps its connection to the service open until TCP keepalive gives up
  (~25 s), while its peers name it within the heartbeat timeout. If it asks later it is
  answered ``removed``. Workers that ask while
  the members still train are announced to them as an ``added`` update; workers the
  launcher removes as a ``removed`` one.

The new epoch keeps the surviving members in their old rank order, then adds new
workers, up to ``max_num_proc``. With fewer than ``min_num_proc`` (every live member
asked, or, for the first epoch, ``start_timeout_s`` passed) it waits up to
``elastic_timeout_s`` for more, then fails the job; each epoch after the first counts
as a reset, and more than ``reset_limit`` of them fail the job too. A failure is
answered to every waiting worker (they raise ElasticJobError) and kept in
:attr:`Coordinator.error`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable, Dict, List, Mapping, Optional, Set, Tuple

from spark_hvd._job import elastic as proto
from spark_hvd.exceptions import InvalidArgumentError, StoreError
from spark_hvd.runner.rendezvous import RendezvousServer

logger = logging.getLogger(__name__)

POLL_S = 0.05
# How long a member named lost by the others' requests has to ask for itself.
NAMED_LOST_GRACE_S = 3.0


def check_sizes(num_proc: Optional[int], min_num_proc: Optional[int],
                max_num_proc: Optional[int], reset_limit: Optional[int],
                what: Tuple[str, str, str] = ("num_proc", "min_num_proc", "max_num_proc")
                ) -> Tuple[int, int, int]:
    """``(num_proc, min, max)`` with the defaults filled in, or InvalidArgumentError naming
    the argument: min <= num_proc <= max, all >= 1 (num_proc defaults to min, min to
    num_proc, max to num_proc)."""
    n_name, lo_name, hi_name = what
    for name, value in ((n_name, num_proc), (lo_name, min_num_proc), (hi_name, max_num_proc),
                        ("reset_limit", reset_limit)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < (0 if name == "reset_limit" else 1)):
            low = 0 if name == "reset_limit" else 1
            raise InvalidArgumentError(f"{name} must be an int >= {low}, got {value!r}")
    if num_proc is None and min_num_proc is None:
        raise InvalidArgumentError(f"an elastic job needs {n_name} or {lo_name}")
    lo = min_num_proc if min_num_proc is not None else num_proc
    n = num_proc if num_proc is not None else lo
    hi = max_num_proc if max_num_proc is not None else max(n, lo)
    if not lo <= n <= hi:
        raise InvalidArgumentError(
            f"elastic sizes must satisfy {lo_name} <= {n_name} <= {hi_name}; got {lo_name}={lo}, "
            f"{n_name}={n}, {hi_name}={hi}")
    return n, lo, hi


def _workers(n: int) -> str:
    return f"{n} worker{'' if n == 1 else 's'}"


class Coordinator:
    """Forms the epochs of one elastic job (see the module docstring).

    ``log(message)`` receives one line per event (an epoch formed, a worker lost, the
    job failing); the launchers print it. ``names`` spells the settings in messages as
    the user gave them: ``{"min_num_proc": "--min-np {}"}`` (default ``min_num_proc={}``;
    keys ``min_num_proc``, ``reset_limit``, ``elastic_timeout_s``). ``clock`` is what the
    timeouts are measured on (seconds; a test can drive time). :attr:`steps` counts the
    passes of the loop (each reads every request and answers what it can), so a test
    can wait for a pass that saw a request instead of sleeping.
    """

    def __init__(self, server: RendezvousServer, num_proc: int, min_num_proc: int,
                 max_num_proc: int, start_timeout_s: float, elastic_timeout_s: float,
                 reset_limit: Optional[int] = None,
                 log: Callable[[str], None] = logger.info,
                 names: Optional[Mapping[str, str]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._server, self._store = server, server.store
        self.num_proc, self.min_num_proc, self.max_num_proc = num_proc, min_num_proc, max_num_proc
        self.start_timeout_s, self.elastic_timeout_s = start_timeout_s, elastic_timeout_s
        self.reset_limit = reset_limit
        self._log = log
        self._names = dict(names or {})
        self._lock = threading.Lock()
        self._answered: Dict[int, int] = {}      # worker -> its last answered request
        self._to_remove: Set[int] = set()
        self._removed: Set[int] = set()          # workers answered "removed"
        self._announced: Set[int] = set()        # workers whose arrival or removal was signalled
        self._members: List[int] = []
        self._member_hosts: Dict[int, str] = {}
        self._seen_lost: Set[int] = set()
        self._named_since: Dict[int, float] = {}
        self._dropped: Set[int] = set()          # left out on being named lost
        self.epoch = 0
        self.resets = 0
        self.error: Optional[str] = None
        self._clock = clock
        self._started_at = clock()
        self.steps = 0
        self._short_since: Optional[float] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._store.add(proto.UPDATES, 0)

    # -- for the launcher --------------------------------------------------------------

    def start(self) -> "Coordinator":
        self._thread = threading.Thread(target=self._run, name="shvd_elastic", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def remove(self, worker: int) -> None:
        """Take ``worker`` out of the job at the next epoch (its host left)."""
        with self._lock:
            self._to_remove.add(worker)

    def members(self) -> List[int]:
        """The workers of the current epoch, in rank order."""
        with self._lock:
            return list(self._members)

    def alive(self) -> List[int]:
        return self._server.registered_ranks(proto.WORKER_GROUP)

    def gone(self) -> Set[int]:
        """Workers the job has lost: their registration dropped, or the others named them
        lost and they did not ask in time (they may still run, cut off)."""
        with self._lock:
            return set(self._seen_lost) | set(self._dropped)

    # -- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self._step()
                self.steps += 1
            except StoreError:  # the server is stopping with the job
                return
            except Exception:  # never leave the workers waiting without a word
                logger.exception("elastic coordinator failed")
                self._fail("the elastic coordinator failed (see the launcher's log)", {})
                return

    def _requests(self) -> Tuple[Dict[int, Tuple[int, str]], Set[int]]:
        """Unanswered requests: worker -> (request number, host); and the workers they
        name lost."""
        out, named = {}, set()
        for key in self._store.keys(proto.JOIN):
            worker = int(key[len(proto.JOIN):])
            try:
                doc = json.loads(self._store.get(key, 1.0))
            except StoreError:
                continue
            if doc["n"] > self._answered.get(worker, 0):
                out[worker] = (int(doc["n"]), str(doc["host"]))
                named.update(int(w) for w in doc.get("lost", ()))
        return out, named

    def _answer(self, worker: int, request: int, value: str) -> None:
        self._answered[worker] = request
        self._store.set(f"{proto.ASSIGNED}{worker}/{request}", value.encode())

    def _announce(self, kind: str) -> None:
        u = self._store.add(proto.UPDATES, 1)
        self._store.set(f"{proto.UPDATE}{u}", kind.encode())

    def _fail(self, message: str, requests: Dict[int, Tuple[int, str]]) -> None:
        with self._lock:
            if self.error is None:
                self.error = message
                self._log(f"elastic job failed: {message}")
        self._store.set(proto.ERROR, self.error.encode())
        for worker, (n, _host) in requests.items():
            self._answer(worker, n, proto.FAILED)

    def _step(self) -> None:
        alive = set(self.alive())
        lost = set(self._server.lost_ranks(proto.WORKER_GROUP))
        for worker in sorted(lost - self._seen_lost):
            where = self._member_hosts.get(worker)
            self._log(f"worker {worker}{f' on {where}' if where else ''} lost"
                      + (f" (rank {self._members.index(worker)} of epoch {self.epoch})"
                         if worker in self._members else ""))
        with self._lock:
            self._seen_lost = lost
        unanswered, named = self._requests()
        requests = {w: r for w, r in unanswered.items() if w in alive}
        if self.error is not None:
            return self._fail(self.error, requests)
        with self._lock:
            removing = set(self._to_remove)
        for worker in sorted((removing | self._dropped) & set(requests)):
            self._answer(worker, requests.pop(worker)[0], proto.REMOVED)
            self._removed.add(worker)
            with self._lock:
                self._to_remove.discard(worker)
        members = self.members()
        live_members = [w for w in members if w in alive and w not in self._removed]
        finished = [w for w in members if w not in alive and w not in lost
                    and w not in self._removed]
        if finished and requests:
            return self._finishing(finished, requests, members)
        if not self.epoch:
            ready = len(requests) >= self.num_proc or (
                self._clock() - self._started_at >= self.start_timeout_s
                and len(requests) >= self.min_num_proc)
        else:
            self._drop_named(named, requests, live_members)
            live_members = [w for w in live_members if w not in self._dropped]
            ready = bool(requests) and all(w in requests for w in live_members)
            if not ready:
                self._announce_changes(requests, removing, members)
        if not ready:
            # Short only at the start (past the start timeout): later, members that have
            # not asked yet are still training and will ask at their next commit.
            return self._check_short(requests, not self.epoch and (
                self._clock() - self._started_at >= self.start_timeout_s))
        order = [w for w in members if w in requests] + sorted(w for w in requests
                                                              if w not in members)
        chosen, extra = order[:self.max_num_proc], order[self.max_num_proc:]
        if len(chosen) < self.min_num_proc:
            return self._check_short(requests, True)
        if self.epoch:
            self.resets += 1
            if self.reset_limit is not None and self.resets > self.reset_limit:
                return self._fail(f"reset limit reached: the job re-formed {self.resets} times, "
                                  f"more than {self._knob('reset_limit', self.reset_limit)}",
                                  requests)
        self._form(chosen, requests)
        for worker in extra:
            self._answer(worker, requests[worker][0], proto.REMOVED)
            self._removed.add(worker)

    def _drop_named(self, named: Set[int], requests: Dict[int, Tuple[int, str]],
                    live_members: List[int]) -> None:
        """Leaves out the live members the requests name lost (`named`) that have not asked
        within NAMED_LOST_GRACE_S of being named (once each: the poll that drops one may
        not form the epoch yet)."""
        now = self._clock()
        named = {w for w in named
                 if w in live_members and w not in requests and w not in self._dropped}
        self._named_since = {w: self._named_since.get(w, now) for w in named}
        for worker in sorted(named):
            if now - self._named_since[worker] >= NAMED_LOST_GRACE_S:
                with self._lock:
                    self._dropped.add(worker)
                where = self._member_hosts.get(worker)
                self._log(f"worker {worker}{f' on {where}' if where else ''} lost (rank "
                          f"{self._members.index(worker)} of epoch {self.epoch}): the others "
                          f"named it lost and it did not ask for {NAMED_LOST_GRACE_S:g} s")

    def _finishing(self, finished: List[int], requests: Dict[int, Tuple[int, str]],
                   members: List[int]) -> None:
        """A member left cleanly: its function returned, the job is ending. Workers still
        waiting to join are told to leave; a member asking for a new epoch now failed
        after a peer had finished (it ran collectives the finished ranks did not)."""
        stuck = {w: r for w, r in requests.items() if w in members}
        for worker, (n, _host) in requests.items():
            if worker not in stuck:
                self._answer(worker, n, proto.REMOVED)
                self._removed.add(worker)
        if stuck:
            ranks = ", ".join(str(members.index(w)) for w in finished)
            self._fail(f"rank(s) {ranks} of epoch {self.epoch} finished while rank(s) "
                       f"{', '.join(str(members.index(w)) for w in stuck)} still ran "
                       f"collectives; every rank must run the same ones", stuck)

    def _announce_changes(self, requests: Dict[int, Tuple[int, str]], removing: Set[int],
                          members: List[int]) -> None:
        """Tells the running epoch about workers waiting to join (up to the maximum size)
        and members to remove, once each."""
        room = self.max_num_proc - len(members)
        waiting = [w for w in sorted(requests) if w not in members and w not in self._announced]
        if waiting and room > 0:
            self._announced.update(waiting)
            self._log(f"worker{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} "
                      f"waiting to join epoch {self.epoch}'s {len(members)} ranks")
            self._announce(proto.ADDED)
        leaving = sorted((removing & set(members)) - self._announced)
        if leaving:
            self._announced.update(leaving)
            self._announce(proto.REMOVED)

    def _check_short(self, requests: Dict[int, Tuple[int, str]], short: bool) -> None:
        """Fails the job when too few workers (``short``) lasted for the elastic timeout."""
        if not short:
            self._short_since = None
            return
        now = self._clock()
        minimum = self._knob("min_num_proc", self.min_num_proc)
        if self._short_since is None:
            self._short_since = now
            self._log(f"{_workers(len(requests))} ready, fewer than {minimum}: waiting up to "
                      f"{self.elastic_timeout_s:g} s for more")
        elif now - self._short_since >= self.elastic_timeout_s:
            self._fail(f"only {_workers(len(requests))} after waiting {self.elastic_timeout_s:g} s "
                       f"({self._knob('elastic_timeout_s', self.elastic_timeout_s)}), fewer "
                       f"than {minimum}: add hosts or lower the minimum", requests)

    def _knob(self, name: str, value: object) -> str:
        """``name=value`` as the user spells the setting (``names`` of the constructor)."""
        return self._names.get(name, name + "={}").format(value)

    def _form(self, chosen: List[int], requests: Dict[int, Tuple[int, str]]) -> None:
        self._short_since = None
        updates = self._store.add(proto.UPDATES, 0)
        number = self.epoch + 1
        hosts = [requests[w][1] for w in chosen]
        self._store.set(f"{proto.EPOCH}{number}",
                        proto.Epoch(number, chosen, hosts, updates).to_bytes())
        with self._lock:
            self.epoch = number
            self._members = list(chosen)
            self._member_hosts.update(zip(chosen, hosts))
            self._announced.clear()
        for worker in chosen:
            self._answer(worker, requests[worker][0], str(number))
        self._log(f"epoch {number}: {len(chosen)} ranks (workers {', '.join(map(str, chosen))})"
                  + (f", reset {self.resets}" if self.resets else ""))
