"""Processes and namespaces as the kernel shows them (/proc, /run/netns), for the box."""

from __future__ import annotations

import os
import select
import signal
import time
from typing import Iterable, List, Optional, Set


class BoxError(RuntimeError):
    """The box cannot be made, or an operation on it failed."""


class BoxBusy(BoxError):
    """Another live process (or ``make cluster-up``) holds the box."""


def start_time(pid: int) -> Optional[int]:
    """The start time of ``pid`` in clock ticks since boot (field 22 of /proc/pid/stat),
    which tells a process from a later one with its pid; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def netns_names() -> List[str]:
    try:
        return sorted(os.listdir("/run/netns"))
    except FileNotFoundError:
        return []


def _netns_inode(pid: int) -> Optional[int]:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def pids_in_netns(inodes: Iterable[int]) -> List[int]:
    """The live processes whose network namespace is one of ``inodes``."""
    wanted: Set[int] = set(inodes)
    if not wanted:
        return []
    return [int(p) for p in os.listdir("/proc")
            if p.isdigit() and _netns_inode(int(p)) in wanted]


def netns_pids(name: str) -> List[int]:
    """The processes in the named network namespace (what ``ip netns pids`` lists)."""
    try:
        inode = os.stat(f"/run/netns/{name}").st_ino
    except OSError:
        return []
    return pids_in_netns([inode])


def wait_gone(pids: Iterable[int], timeout_s: float) -> List[int]:
    """Waits until every one of ``pids`` has ended (on pidfds: no polling of /proc);
    those still alive at the deadline."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + timeout_s
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        left = dict(fds)
        while left:
            wait_ms = (deadline - time.monotonic()) * 1000
            if wait_ms <= 0:
                break
            for fd, _ in poller.poll(wait_ms):
                poller.unregister(fd)
                left.pop(fd, None)
        return sorted(left.values())
    finally:
        for fd in fds:
            os.close(fd)


def kill_all(pids: List[int], grace_s: float = 5.0) -> int:
    """SIGTERM to every pid, SIGKILL to those alive after ``grace_s``; how many there were.
    Only processes of the box's namespaces are passed here."""
    pids = [p for p in pids if p != os.getpid()]
    count = len(pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        pids = wait_gone(pids, grace_s)
        if not pids:
            break
    return count
