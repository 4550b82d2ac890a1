"""A cluster in a box: hosts as Linux network namespaces joined by a bridge.

    python tests/cluster/box.py up [--hosts 4] [--rate 1gbit] [--no-spark]   (make cluster-up)
    python tests/cluster/box.py status | env | down                        (make cluster-down)
    python tests/cluster/box.py exec host2 -- hostname

Layout (the default subnet 10.213.77.0/24; nothing else on the machine may use it):

    root namespace   bridge shvdbox0, 10.213.77.1: the driver's (and launcher's) address
    boxmaster        10.213.77.2, a Spark standalone Master on port 7077
    host1 .. hostN   10.213.77.11 .., one veth each (eth0 inside, shvdbox<i> on the bridge),
                     an sshd on port 22, a Spark Worker with fake GPUs

Every host is a network namespace of that name; whatever the box starts there runs under
``ip netns exec <host> unshare --uts``, with the host name set to the namespace's, and
``ip netns exec`` lays /etc/netns/<host>/{hosts,resolv.conf} over /etc: the box's names
resolve inside it, nothing else does. A host's only route is the box's subnet (no
default route: a packet for anywhere else is refused at the host, ENETUNREACH, whether
or not the machine forwards), so the addresses exist only on the bridge; IPv6 is off on
every box link. A host's link may be capped (``tc ... tbf``
on both ends of its veth), set down and up again.

What the box made is written down before it is made (``/run/spark_hvd_box/state.json``:
names, namespace inodes, the owner's pid). ``down()`` kills every process in the box's
namespaces (TERM, then KILL), deletes them, the bridge and the files; the owner's exit
calls it (atexit), and ``up()`` first cleans what a killed owner left, and refuses while a
live owner holds the box.
"""

from __future__ import annotations

import argparse
import atexit
import fcntl
import ipaddress
import json
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: its siblings by their names
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _box_net as _net  # noqa: E402
import _box_procs as _procs  # noqa: E402
import _box_services as _services  # noqa: E402
from _box_procs import BoxBusy, BoxError  # noqa: E402,F401

DEFAULT_NAME = _net.DEFAULT_NAME
DEFAULT_SUBNET = "10.213.77.0/24"


@dataclass(frozen=True)
class Node:
    """A namespace of the box: its name (= its host name), address and bridge-side veth."""

    name: str
    addr: str
    veth: str


def namespaces_refused() -> Optional[str]:
    """Why this machine cannot make the box (the kernel refuses new namespaces), or None."""
    try:
        proc = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True,
                              text=True, timeout=30)
    except FileNotFoundError:
        return None  # no unshare: up() says what to install
    if proc.returncode != 0 and ("Operation not permitted" in proc.stderr
                                 or "Permission denied" in proc.stderr):
        return (f"the kernel refuses new network/UTS namespaces to this user (uid "
                f"{os.getuid()}): {proc.stderr.strip()}; the box needs root (CAP_SYS_ADMIN "
                f"and CAP_NET_ADMIN)")
    return None


@contextmanager
def _locked() -> Iterator[None]:
    """One up()/down() at a time on this machine (a lock on /run, gone with the process)."""
    fd = os.open("/run", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _owner_alive(owner: Optional[dict]) -> bool:
    return owner is None or _procs.start_time(owner["pid"]) == owner["start"]


def _describe_owner(owner: Optional[dict]) -> str:
    if owner is None:
        return "`make cluster-up` (python tests/cluster/box.py up)"
    return f"pid {owner['pid']} ({_procs.cmdline(owner['pid'])[:120]})"


class Box:
    """The box described by a state (see up()); its methods act on the live box."""

    def __init__(self, state: dict) -> None:
        self.state = state
        self.subnet = ipaddress.ip_network(state["subnet"])
        self.driver_addr: str = state["bridge_addr"]
        self.master = Node(**state["master"])
        self.hosts: List[Node] = [Node(**h) for h in state["hosts"]]
        self.dir: str = state["dir"]
        self.services = _services.Services(self)

    # -- names and processes -------------------------------------------------------------

    @property
    def names(self) -> List[str]:
        return [h.name for h in self.hosts]

    def host(self, name: str) -> Node:
        for node in [*self.hosts, self.master]:
            if node.name == name:
                return node
        raise BoxError(f"no host {name!r} in the box ({', '.join(self.names)})")

    def argv(self, host: str, argv: Sequence[str]) -> List[str]:
        """``argv`` as run on ``host``: in its namespace, under its host name."""
        self.host(host)
        return ["ip", "netns", "exec", host, "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', host, *argv]

    def popen(self, host: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.argv(host, argv), **kwargs)

    def exec(self, host: str, argv: Sequence[str], timeout_s: float = 120,
             **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(host, argv), capture_output=True, text=True,
                              timeout=timeout_s, **kwargs)

    def pids(self, host: str) -> List[int]:
        """The processes in ``host``'s namespace."""
        return _procs.netns_pids(host)

    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """An environment whose ``ssh`` reaches the hosts by name (the box's keys and
        known hosts; see _services)."""
        return self.services.ssh_env(dict(os.environ if base is None else base))

    # -- the network ---------------------------------------------------------------------

    def link(self, host: str, up: bool) -> None:
        """Plugs (up) or unplugs (down) ``host``'s cable at the bridge."""
        _net.run("ip", "link", "set", self.host(host).veth, "up" if up else "down")

    def cap(self, host: str, rate: Optional[str]) -> None:
        """Caps ``host``'s link to ``rate`` (tc's units: 1gbit, 100mbit) both ways, or
        lifts the cap (None)."""
        node = self.host(host)
        for dev, ns in ((node.veth, None), ("eth0", host)):
            _net.run("tc", "qdisc", "del", "dev", dev, "root", check=False, ns=ns)
            if rate:
                bits = _net.tc_rate_bits(rate)
                burst = max(64 * 1024, bits // 8 // 100)  # 10 ms at the rate
                _net.run("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", str(burst), "latency", "100ms", ns=ns)

    # -- Spark ---------------------------------------------------------------------------

    @property
    def master_url(self) -> str:
        return f"spark://{self.master.addr}:{_services.MASTER_PORT}"

    def spark_conf(self, **overrides: str) -> Dict[str, str]:
        return self.services.spark_conf(**overrides)


def up(hosts: int = 4, rate: Optional[str] = None, rates: Optional[Sequence[Optional[str]]] = None,
       sshd: bool = True, spark: bool = False, gpus: int = 2, subnet: str = DEFAULT_SUBNET,
       owner: Optional[int] = -1, name: str = DEFAULT_NAME) -> Box:
    """Makes a box of ``hosts`` hosts (host1..hostN) and returns it.

    ``rate`` caps every host's link (tc units, e.g. ``1gbit``), ``rates`` each host's
    (None: no cap). ``sshd``: an sshd on port 22 of every host; ``spark``: a standalone
    Master and a Worker per host with ``gpus`` fake GPUs. ``owner`` is the process whose
    end frees the box (default: this one; None: only down() does, as after ``make
    cluster-up``). What a dead owner left is removed first; a live one's box is refused
    (BoxBusy). ``name``: boxes of other names (and subnets) may be up beside it.
    """
    per_host = list(rates) if rates is not None else [rate] * hosts
    if len(per_host) != hosts:
        raise BoxError(f"rates names {len(per_host)} hosts, the box has {hosts}")
    state = _net.plan(name, hosts, subnet, per_host, os.getpid() if owner == -1 else owner)
    with _locked():
        old = _net.read_state(name)
        if old is not None:
            if _owner_alive(old["owner"]):
                raise BoxBusy(f"a box is up, held by {_describe_owner(old['owner'])}; "
                              f"`make cluster-down` removes it")
            _net.clean(old)
        _net.check_free(state)
        try:
            _net.make(state)
            box = Box(state)
            for node, r in zip(box.hosts, per_host):
                if r:
                    box.cap(node.name, r)
            box.services.start(sshd=sshd, spark=spark, gpus=gpus)
            _net.write_state(box.state)
        except BaseException:
            _net.clean(state)
            raise
    if state["owner"] is not None and state["owner"]["pid"] == os.getpid():
        atexit.register(_down_if_mine, name, state["owner"])
    return box


def _down_if_mine(name: str, owner: dict) -> None:
    state = _net.read_state(name)
    if state is not None and state["owner"] == owner:
        down(name)


def current(name: str = DEFAULT_NAME) -> Optional[Box]:
    """The box that is up, or None."""
    state = _net.read_state(name)
    return Box(state) if state is not None else None


def down(name: str = DEFAULT_NAME) -> List[str]:
    """Removes the box that is up, or what a killed one left; what it removed."""
    with _locked():
        state = _net.read_state(name)
        if state is None:
            return []
        return _net.clean(state)


leftovers = _net.leftovers
box_dir = _net.box_dir


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="make the box; it stays up until `down`")
    u.add_argument("--hosts", type=int, default=4)
    u.add_argument("--rate", default=None, help="cap every host's link (tc units: 1gbit)")
    u.add_argument("--gpus", type=int, default=2, help="fake GPUs per host")
    u.add_argument("--no-spark", action="store_true", help="no Spark master and workers")
    u.add_argument("--subnet", default=DEFAULT_SUBNET)
    sub.add_parser("down", help="remove the box (or what a killed run left)")
    sub.add_parser("status", help="what is up")
    sub.add_parser("env", help="shell lines that point ssh and Spark at the box")
    e = sub.add_parser("exec", help="run a command on a host")
    e.add_argument("host")
    e.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.cmd == "up":
        box = up(args.hosts, rate=args.rate, spark=not args.no_spark, gpus=args.gpus,
                 subnet=args.subnet, owner=None)
        print(f"box up: {', '.join(f'{h.name} {h.addr}' for h in box.hosts)}; driver "
              f"{box.driver_addr}" + ("" if args.no_spark else f"; Spark {box.master_url}"))
        print(f"`eval $(python {sys.argv[0]} env)` points ssh at the hosts")
    elif args.cmd == "down":
        removed = down()
        print("removed: " + ", ".join(removed) if removed else "no box was up")
    elif args.cmd == "status":
        state = _net.read_state(DEFAULT_NAME)
        if state is None:
            print("no box is up")
        else:
            print(json.dumps(dict(state, owner=_describe_owner(state["owner"])), indent=1))
    else:
        box = current()
        if box is None:
            print("no box is up", file=sys.stderr)
            return 1
        if args.cmd == "env":
            print(f"export PATH={box.env()['PATH']}")
            print(f"export SPARK_HVD_BOX_MASTER={box.master_url}")
            print(f"export SPARK_HVD_BOX_DRIVER={box.driver_addr}")
        else:
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            os.execvp("ip", box.argv(args.host, command or ["sh"]))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BoxError as e:
        print(f"box: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(signal.SIGINT + 128)
