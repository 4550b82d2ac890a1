"""Rank topology: local and cross ranks from each rank's host."""

import random

import pytest

from spark_hvd._job.topology import Topology, assign
from spark_hvd.exceptions import InvalidArgumentError


def test_interleaved_hosts():
    got = [(t.local_rank, t.local_size, t.cross_rank, t.cross_size)
           for t in assign(["a", "b", "a", "b", "a"])]
    assert got == [
        (0, 3, 0, 2),  # rank 0: first on a; local rank 0 is held by ranks 0, 1
        (0, 2, 1, 2),  # rank 1: first on b
        (1, 3, 0, 2),  # rank 2: second on a; local rank 1 is held by ranks 2, 3
        (1, 2, 1, 2),  # rank 3: second on b
        (2, 3, 0, 1),  # rank 4: third on a, alone with local rank 2
    ]
    assert all(t.rank == r and t.size == 5 for r, t in enumerate(assign(list("ababa"))))


@pytest.mark.parametrize("size", [1, 2, 3])
def test_one_host(size):
    assert assign(["h"] * size) == [Topology(r, size, r, size, 0, 1) for r in range(size)]


@pytest.mark.parametrize("size", [1, 2, 3])
def test_one_rank_per_host(size):
    hosts = [f"h{r}" for r in range(size)]
    assert assign(hosts) == [Topology(r, size, 0, 1, r, size) for r in range(size)]


def test_empty():
    assert assign([]) == []


@pytest.mark.parametrize("bad", [[""], ["a", None]])
def test_bad_host(bad):
    with pytest.raises(InvalidArgumentError):
        assign(bad)


@pytest.mark.parametrize("seed", range(20))
def test_invariants_on_random_layouts(seed):
    rng = random.Random(seed)
    hosts = [rng.choice("abcd") for _ in range(rng.randint(1, 12))]
    topo = assign(hosts)
    for t in topo:
        same_host = [r for r, h in enumerate(hosts) if h == hosts[t.rank]]
        assert (t.local_rank, t.local_size) == (same_host.index(t.rank), len(same_host))
        same_local = [u.rank for u in topo if u.local_rank == t.local_rank]
        assert (t.cross_rank, t.cross_size) == (same_local.index(t.rank), len(same_local))
