"""Where a ``spark-hvdrun`` job's rendezvous server listens, and where each rank (here
or on another host) is told to reach it."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from spark_hvd.runner import _hosts, _ssh
from spark_hvd.runner._hosts import Slot
from spark_hvd.runner._procs import Sink

PROG = _ssh.PROG


class Addresses:
    """Where the rendezvous server listens and where each rank is told to reach it.

    ``pinned``: every rank reaches it at ``local`` (``--network-interface``).
    """

    def __init__(self, bind: str, local: str, remote: Mapping[str, str],
                 pinned: bool = False) -> None:
        self.bind, self.local, self.remote, self.pinned = bind, local, dict(remote), pinned

    def of(self, slot: Slot) -> str:
        return self.remote[slot.host] if slot.remote else self.local

    def learn(self, host: str, seen: str) -> None:
        """A host found later (elastic): its ranks reach the server at ``seen`` (what its
        ssh probe saw), or at ``local`` when pinned."""
        self.remote[host] = self.local if self.pinned else seen


def addresses(slots: Sequence[Slot], ssh: Optional[_ssh.Ssh], network_interface: Optional[str],
              env: Mapping[str, str], timeout_s: float, err: Sink) -> Addresses:
    remote = list(dict.fromkeys(s.host for s in slots if s.remote))
    addr = _hosts.interface_address(network_interface) if network_interface else None
    seen = ssh.probe(remote, env, timeout_s) if remote else {}  # also fails fast if unreachable
    if addr is not None:
        return Addresses(addr, addr, {h: addr for h in remote}, pinned=True)
    if not remote:
        return Addresses("127.0.0.1", "127.0.0.1", {})
    # Ranks here bind Gloo on the address they reach the server at, so tell them the
    # one the (first) other host sees: that is where the other hosts reach them.
    local = seen[remote[0]]
    if len(set(seen.values())) > 1:
        err.write(f"{PROG}: note: the hosts reach this one at different addresses "
                  f"({', '.join(f'{h}: {a}' for h, a in seen.items())}); ranks here listen on "
                  f"{local}; choose another with --network-interface\n".encode())
    bind = "::" if any(":" in a for a in seen.values()) else "0.0.0.0"
    return Addresses(bind, local, seen)
