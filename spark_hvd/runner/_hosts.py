"""Where ``spark-hvdrun``'s ranks run: the ``-H`` host list, and this host's addresses."""

from __future__ import annotations

import socket
import struct
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

from spark_hvd.exceptions import InvalidArgumentError

# Names of this machine.  Other loopback addresses (127.0.0.2...) count as other
# hosts, reached over ssh like any other: that is how a job spanning "hosts" is
# tested on one machine.
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class Slot:
    """Where one rank runs.

    ``host`` is its ``-H`` name (what ssh connects to), ``identity`` the name its
    ranks are grouped by for local_rank/cross_rank (SPARK_HVD_HOSTNAME): this host's
    name for every alias of this host, the -H name (without ``user@``) for another.
    """

    rank: int
    host: str
    identity: str
    remote: bool


def parse_hosts(spec: str, default_slots: int = 1,
                what: Optional[str] = None) -> List[Tuple[str, int]]:
    """``host:slots,host:slots`` (slots default ``default_slots``) as a list of
    ``(host, slots)``; errors name the input as ``what`` (default ``-H 'spec'``)."""
    what = f"-H {spec!r}" if what is None else what
    hosts = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        host, sep, slots = item.rpartition(":")
        if not sep or host.endswith(":"):  # no slots given, or a bare IPv6 address
            host, slots = item, str(default_slots)
        try:
            n = int(slots)
        except ValueError:
            raise InvalidArgumentError(f"{what}: slots of {host!r} must be an int, "
                                       f"got {slots!r}") from None
        if n < 1:
            raise InvalidArgumentError(f"{what}: slots of {host!r} must be >= 1")
        hosts.append((host.strip("[]"), n))
    if not hosts:
        raise InvalidArgumentError(f"{what} names no host")
    return hosts


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine: localhost, 127.0.0.1, ::1 or its own names."""
    return host in LOCAL_NAMES or host == socket.gethostname() or host == socket.getfqdn()


def place(spec: Optional[str], np: int, local_identity: str) -> List[Slot]:
    """Ranks 0..np-1 filling the hosts of ``-H spec`` in order (all here when None)."""
    if spec is None:
        return [Slot(r, "localhost", local_identity, False) for r in range(np)]
    hosts = parse_hosts(spec)
    total = sum(n for _, n in hosts)
    if np > total:
        raise InvalidArgumentError(f"-np {np} is more than the {total} slots given by -H {spec}")
    slots: List[Slot] = []
    for host, n in hosts:
        for _ in range(min(n, np - len(slots))):
            slots.append(slot(len(slots), host, local_identity))
    return slots


def slot(rank: int, host: str, local_identity: str) -> Slot:
    """The Slot of ``rank`` on ``host`` (see Slot for its identity)."""
    local = is_local(host)
    return Slot(rank, host, local_identity if local else host.rpartition("@")[2], not local)


def interface_address(name: str) -> str:
    """The address of ``--network-interface``: an IP address as it is, or a NIC's IPv4."""
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in name else socket.AF_INET, name)
        return name
    except OSError:
        pass
    if sys.platform.startswith("linux"):
        import fcntl

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name.encode()[:15]))
                return socket.inet_ntoa(packed[20:24])
            except OSError:
                pass
    names = ", ".join(n for _, n in socket.if_nameindex())
    raise InvalidArgumentError(
        f"--network-interface {name!r} is neither an IP address nor an interface with an IPv4 "
        f"address here (interfaces: {names}); give one of those or this host's address")


def source_address(host: str) -> Optional[str]:
    """This host's address on the route to ``host`` (no packet is sent), or None."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return s.getsockname()[0]
    except (OSError, IndexError):
        return None
