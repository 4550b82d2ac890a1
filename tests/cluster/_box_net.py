"""Making and removing the box's network: namespaces, the bridge, veths, /etc/netns files,
and the state file that lists them (box.py's up() and down() call these under its lock)."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
from typing import List, Optional, Sequence

import _box_procs as _procs
from _box_procs import BoxError

ETC_NETNS = "/etc/netns"
RUN_NETNS = "/run/netns"
DEFAULT_NAME = "box"


def box_dir(name: str) -> str:
    """Where the box ``name`` keeps its state and files."""
    return f"/run/spark_hvd_{name}"


def state_path(name: str) -> str:
    return os.path.join(box_dir(name), "state.json")


def run(*argv: str, check: bool = True, ns: Optional[str] = None) -> str:
    """A command's output (in namespace ``ns``); BoxError with its stderr when it fails."""
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise BoxError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def read_state(name: str) -> Optional[dict]:
    try:
        with open(state_path(name)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def write_state(state: dict) -> None:
    os.makedirs(state["dir"], mode=0o700, exist_ok=True)
    path = state_path(state["name"])
    with open(path + ".tmp", "w") as f:
        json.dump(state, f, indent=1)
    os.replace(path + ".tmp", path)


def tc_rate_bits(rate: str) -> int:
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise BoxError(f"rate {rate!r}: give it in tc's units, e.g. 1gbit, 100mbit")


def plan(name: str, hosts: int, subnet: str, rates: Sequence[Optional[str]],
         owner: Optional[int]) -> dict:
    """The box's names and addresses. The default box's hosts are host1..hostN, its
    master namespace boxmaster; another box ``name``'s are <name>-host1.., <name>master."""
    if not re.fullmatch(r"[a-z]{1,8}", name):
        raise BoxError(f"box name {name!r}: 1 to 8 letters a-z (it prefixes link names)")
    net = ipaddress.ip_network(subnet)
    if not 1 <= hosts <= min(200, net.num_addresses - 12):
        raise BoxError(f"hosts={hosts}: 1 to {min(200, net.num_addresses - 12)} in {subnet}")
    addr = [str(a) for a in net]
    prefix = "host" if name == DEFAULT_NAME else f"{name}-host"
    return {
        "owner": None if owner is None else {"pid": owner, "start": _procs.start_time(owner)},
        "name": name, "subnet": str(net), "bridge": f"shvd{name}0", "bridge_addr": addr[1],
        "dir": box_dir(name),
        "master": {"name": f"{name}master", "addr": addr[2], "veth": f"shvd{name}m"},
        "hosts": [{"name": f"{prefix}{i}", "addr": addr[10 + i], "veth": f"shvd{name}{i}"}
                  for i in range(1, hosts + 1)],
        "rates": list(rates), "inodes": {}, "etc_netns": [], "made_etc_netns": False,
        "made_run_netns": False, "services": {},
    }


def check_free(state: dict) -> None:
    """Refuses names or a subnet that something else on this machine uses."""
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            raise BoxError(f"the box needs `{tool}`: apt-get install iproute2 util-linux")
    names = [state["master"]["name"]] + [h["name"] for h in state["hosts"]]
    taken = sorted(set(names) & set(_procs.netns_names()))
    links = {d["ifname"] for d in json.loads(run("ip", "-j", "link", "show"))}
    ours = {state["bridge"], state["master"]["veth"]} | {h["veth"] for h in state["hosts"]}
    taken += sorted(links & ours)
    taken += [f"{ETC_NETNS}/{n}" for n in names if os.path.exists(os.path.join(ETC_NETNS, n))]
    if taken:
        raise BoxError(f"not made by this box, or by a box whose state is gone: "
                       f"{', '.join(taken)}; remove them (ip netns del / ip link del) first")
    net = ipaddress.ip_network(state["subnet"])
    for route in json.loads(run("ip", "-j", "route", "show", "table", "all")):
        dst = route.get("dst", "")
        if dst in ("default", "") or ":" in dst:
            continue
        if ipaddress.ip_network(dst, strict=False).overlaps(net):
            raise BoxError(f"the subnet {net} overlaps this machine's route to {dst}; "
                           f"give another (--subnet)")


def make(state: dict) -> None:
    """Makes the namespaces, bridge, veths and files of ``state``, recording each in its
    state file before making it."""
    bridge, prefix = state["bridge"], ipaddress.ip_network(state["subnet"]).prefixlen
    write_state(state)
    run("ip", "link", "add", bridge, "type", "bridge")
    run("sysctl", "-q", "-w", f"net.ipv6.conf.{bridge}.disable_ipv6=1")
    run("ip", "addr", "add", f"{state['bridge_addr']}/{prefix}", "dev", bridge)
    run("ip", "link", "set", bridge, "up")
    for path, key in ((ETC_NETNS, "made_etc_netns"), (RUN_NETNS, "made_run_netns")):
        if not os.path.isdir(path):  # the first box here: iproute2 makes /run/netns
            state[key] = True
            write_state(state)
    os.makedirs(ETC_NETNS, exist_ok=True)
    nodes = [state["master"], *state["hosts"]]
    hosts_file = "127.0.0.1 localhost\n" + f"{state['bridge_addr']} driver\n" + "".join(
        f"{n['addr']} {n['name']}\n" for n in nodes)
    for node in nodes:
        name = node["name"]
        state["etc_netns"].append(name)
        write_state(state)
        os.makedirs(os.path.join(ETC_NETNS, name))
        with open(os.path.join(ETC_NETNS, name, "hosts"), "w") as f:
            f.write(hosts_file)
        with open(os.path.join(ETC_NETNS, name, "resolv.conf"), "w") as f:
            f.write("# spark_hvd's cluster in a box: no DNS, the box's names are in hosts\n")
        run("ip", "netns", "add", name)
        state["inodes"][name] = os.stat(os.path.join(RUN_NETNS, name)).st_ino
        write_state(state)
        run("sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1", ns=name)
        run("sysctl", "-q", "-w", "net.ipv6.conf.default.disable_ipv6=1", ns=name)
        run("ip", "link", "add", node["veth"], "type", "veth", "peer", "name", "eth0",
             "netns", name)
        run("sysctl", "-q", "-w", f"net.ipv6.conf.{node['veth']}.disable_ipv6=1")
        run("ip", "link", "set", node["veth"], "master", bridge, "up")
        run("ip", "-n", name, "addr", "add", f"{node['addr']}/{prefix}", "dev", "eth0")
        run("ip", "-n", name, "link", "set", "lo", "up")
        run("ip", "-n", name, "link", "set", "eth0", "up")


def clean(state: dict) -> List[str]:
    """Removes everything ``state`` lists; what it removed."""
    done = []
    names = [state["master"]["name"]] + [h["name"] for h in state["hosts"]]
    live = set(_procs.netns_names())
    killed = _procs.kill_all([p for n in names if n in live for p in _procs.netns_pids(n)])
    if killed:
        done.append(f"{killed} processes")
    for name in names:
        if name in live:
            run("ip", "netns", "del", name, check=False)
            done.append(f"namespace {name}")
    links = {d["ifname"] for d in json.loads(run("ip", "-j", "link", "show"))}
    for link in [state["bridge"], state["master"]["veth"], *(h["veth"] for h in state["hosts"])]:
        if link in links:
            run("ip", "link", "del", link, check=False)
            done.append(f"link {link}")
    for name in state.get("etc_netns", []):
        path = os.path.join(ETC_NETNS, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
            done.append(path)
    if state.get("made_etc_netns") and os.path.isdir(ETC_NETNS) and not os.listdir(ETC_NETNS):
        os.rmdir(ETC_NETNS)
    if state.get("made_run_netns") and os.path.isdir(RUN_NETNS) and not os.listdir(RUN_NETNS):
        while subprocess.run(["umount", RUN_NETNS], capture_output=True).returncode == 0:
            pass  # iproute2 bind-mounts it on itself (once, or once per racing ip)
        os.rmdir(RUN_NETNS)
    if os.path.isdir(state["dir"]):
        shutil.rmtree(state["dir"])
        done.append(state["dir"])
    return done


def leftovers(state: dict) -> List[str]:
    """What of the box that ``state`` describes is still on this machine."""
    names = [state["master"]["name"]] + [h["name"] for h in state["hosts"]]
    found = [f"namespace {n}" for n in names if n in _procs.netns_names()]
    links = {d["ifname"] for d in json.loads(run("ip", "-j", "link", "show"))}
    found += [f"link {n}" for n in [state["bridge"], state["master"]["veth"],
                                    *(h["veth"] for h in state["hosts"])] if n in links]
    found += [f"{ETC_NETNS}/{n}" for n in names if os.path.exists(os.path.join(ETC_NETNS, n))]
    if os.path.exists(state["dir"]):
        found.append(state["dir"])
    inodes = set(state.get("inodes", {}).values())
    found += [f"process {pid} ({_procs.cmdline(pid)[:80]}) in the box's namespace"
              for pid in _procs.pids_in_netns(inodes)]
    return found
