"""The elastic membership protocol, shared by an elastic job's workers and its coordinator.

An elastic job is a set of *workers* (processes) that come and go; it trains in
*epochs* of fixed membership. The coordinator (:mod:`spark_hvd.runner._elastic`, in the
launcher or the Spark driver) forms each epoch; a worker joins one at its first
``init()`` and after each reset. Everything travels through the job's rendezvous
store, under ``__elastic__/``:

``join/<worker>``
    set by a worker asking for a place: ``{"n": <its n-th request>, "host": ...,
    "lost": [...]}``, ``lost`` the workers its last failure named lost (PeerLostError's
    ranks in its epoch), which the coordinator leaves out when they do not ask in time.
``assigned/<worker>/<n>``
    the coordinator's answer to request n: the epoch number, or ``removed`` (the
    worker has no place and should exit), or ``error`` (the job cannot go on; the
    reason is under ``error``).
``epoch/<E>``
    epoch E: ``{"workers": [...] (index = rank), "hosts": [...], "updates": U}``.
``updates`` and ``update/<u>``
    a counter of membership changes the running epoch should stop for (``added``:
    a worker waits to join; ``removed``: a worker is to leave), and the kind of each;
    ``updates`` in an epoch's record is the counter when the epoch formed, so a rank
    compares the two to know whether to raise HostsUpdatedInterrupt.

Workers hold a registration of their own (group ``w``, rank = worker id) for their
whole life; the coordinator reads liveness from it: a worker whose connection drops
without a goodbye crashed. Each epoch's ranks register in the group ``e<E>``, so the
lost ranks of one epoch never spill into the next.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import List, Optional, Sequence

from spark_hvd._job.client import RendezvousClient
from spark_hvd._job.topology import Topology, assign
from spark_hvd.exceptions import CollectiveTimeoutError, SparkHvdError

PREFIX = "__elastic__/"
JOIN = PREFIX + "join/"
ASSIGNED = PREFIX + "assigned/"
EPOCH = PREFIX + "epoch/"
UPDATES = PREFIX + "updates"
UPDATE = PREFIX + "update/"
ERROR = PREFIX + "error"
NEXT_WORKER = PREFIX + "next_worker"
WORKER_GROUP = "w"
REMOVED = "removed"
FAILED = "error"
ADDED = "added"


class ElasticJobError(SparkHvdError):
    """The elastic job cannot go on (too few workers within the elastic timeout, the
    reset limit reached): every waiting worker raises it. Not a HorovodInternalError,
    so ``hvd.elastic.run`` does not retry it."""


class WorkerRemoved(SparkHvdError):
    """This worker has no place in the next epoch (its host left the job, or the job
    is at its maximum size); ``hvd.elastic.run`` ends the process with status 0."""


def epoch_group(epoch: int) -> str:
    """The registration group of an epoch's ranks."""
    return f"e{epoch}"


@dataclass(frozen=True)
class Epoch:
    """One epoch's membership as a worker sees it."""

    number: int
    workers: List[int]   # worker id of each rank
    hosts: List[str]     # host of each rank
    updates: int         # the update counter when the epoch formed

    def topology_of(self, worker: int) -> Topology:
        return assign(self.hosts)[self.workers.index(worker)]

    def to_bytes(self) -> bytes:
        return json.dumps({"workers": self.workers, "hosts": self.hosts,
                           "updates": self.updates}).encode()

    @classmethod
    def from_bytes(cls, number: int, data: bytes) -> "Epoch":
        doc = json.loads(data)
        return cls(number, list(doc["workers"]), list(doc["hosts"]), int(doc["updates"]))


def join(client: RendezvousClient, worker: int, request: int, host: str,
         timeout_s: float, lost: Sequence[int] = ()) -> Epoch:
    """Asks the coordinator for a place and waits for the epoch it gives this worker.

    ``request`` numbers this worker's requests (1, 2, ...); ``lost``: the workers this
    worker's last failure named lost. Raises WorkerRemoved or ElasticJobError on those
    answers, ElasticJobError too when none comes in ``timeout_s``.
    """
    client.set(f"{JOIN}{worker}", json.dumps({"n": request, "host": host,
                                              "lost": sorted(lost)}).encode())
    try:
        answer = client.get(f"{ASSIGNED}{worker}/{request}", timeout_s).decode()
    except CollectiveTimeoutError:  # not a HorovodInternalError: elastic.run must not retry
        raise ElasticJobError(
            f"elastic worker {worker} got no place in the job within {timeout_s:g} s "
            f"(the coordinator forms an epoch once every live worker asks, or reports "
            f"too few workers after the elastic timeout)") from None
    if answer == REMOVED:
        raise WorkerRemoved(f"elastic worker {worker} on {host} was removed from the job")
    if answer == FAILED:
        raise ElasticJobError(client.get(ERROR, 10.0).decode("utf-8", "replace"))
    number = int(answer)
    return Epoch.from_bytes(number, client.get(f"{EPOCH}{number}", timeout_s))


def lost_workers(epoch: Optional[Epoch], ranks: Sequence[int]) -> List[int]:
    """The workers of ``epoch``'s ``ranks`` (a PeerLostError's), those it has."""
    if epoch is None:
        return []
    return sorted({epoch.workers[r] for r in ranks if 0 <= r < len(epoch.workers)})


def pending_updates(client: RendezvousClient, since: int) -> Optional[bool]:
    """None when no membership change has been signalled after counter ``since``; else
    whether every change since is a removal (Horovod's ``skip_sync``)."""
    now = client.add(UPDATES, 0)
    if now <= since:
        return None
    kinds = [client.get(f"{UPDATE}{u}", 10.0).decode() for u in range(since + 1, now + 1)]
    return all(k == REMOVED for k in kinds)

