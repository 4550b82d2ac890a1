"""Where each rank sits: its index on its host and across hosts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

from spark_hvd.exceptions import InvalidArgumentError


@dataclass(frozen=True)
class Topology:
    """One rank's place in the job.

    ``local_rank`` is its index among the ranks on its host (by rank order),
    ``local_size`` the number of ranks on that host; ``cross_rank`` is its index
    among the ranks with the same ``local_rank`` (by rank order) and
    ``cross_size`` the number of those ranks.
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def assign(hosts: Sequence[str]) -> List[Topology]:
    """The topology of every rank, where ``hosts[r]`` names rank ``r``'s host.

    Examples
    --------
    >>> [(t.local_rank, t.cross_rank) for t in assign(["a", "b", "a"])]
    [(0, 0), (0, 1), (1, 0)]
    """
    for r, h in enumerate(hosts):
        if not isinstance(h, str) or not h:
            raise InvalidArgumentError(f"host of rank {r} must be a non-empty str, got {h!r}")
    size = len(hosts)
    on_host: Dict[str, List[int]] = {}
    local_rank = []
    for r, h in enumerate(hosts):
        ranks = on_host.setdefault(h, [])
        local_rank.append(len(ranks))
        ranks.append(r)
    with_local: Dict[int, List[int]] = {}
    cross_rank = []
    for r in range(size):
        ranks = with_local.setdefault(local_rank[r], [])
        cross_rank.append(len(ranks))
        ranks.append(r)
    return [Topology(rank=r, size=size,
                     local_rank=local_rank[r], local_size=len(on_host[hosts[r]]),
                     cross_rank=cross_rank[r], cross_size=len(with_local[local_rank[r]]))
            for r in range(size)]
