"""The box itself: hosts as namespaces with their own names and nothing routed out, ssh
between them, a capped link, and nothing left after down(), also when the run that made
the box was killed. These tests make small boxes of their own (name ``tbox``, subnet
10.213.78.0/24), so they run beside the session's box."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import box as box_mod


def needs_namespaces() -> None:
    reason = box_mod.namespaces_refused()
    if reason:
        pytest.skip(reason)

NAME, SUBNET = "tbox", "10.213.78.0/24"

INSIDE = """
    import errno, json, socket, subprocess
    out = {"hostname": socket.gethostname(),
           "resolves": socket.gethostbyname(socket.gethostname())}
    for addr in ("192.0.2.1", "1.1.1.1"):
        s = socket.socket()
        try:
            s.connect((addr, 80))
            out[addr] = "connected"
        except OSError as e:
            out[addr] = errno.errorcode.get(e.errno, str(e))
        s.close()
    out["routes"] = json.loads(subprocess.check_output(["ip", "-j", "route", "show",
                                                        "table", "all"]))
    out["addrs"] = sorted(f"{d['ifname']} {a['local']}" for d in json.loads(
        subprocess.check_output(["ip", "-j", "addr"])) for a in d["addr_info"])
    print(json.dumps(out))
"""


@pytest.fixture
def small_box():
    needs_namespaces()
    b = box_mod.up(hosts=3, rates=[None, None, "20mbit"], name=NAME, subnet=SUBNET)
    yield b
    box_mod.down(NAME)


def test_hosts_are_namespaces_named_as_hosts_with_no_route_out(small_box):
    b = small_box
    for h in b.hosts:
        proc = b.exec(h.name, [sys.executable, "-c", textwrap.dedent(INSIDE)])
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout)
        assert got["hostname"] == h.name and got["resolves"] == h.addr, got
        assert got["192.0.2.1"] == got["1.1.1.1"] == "ENETUNREACH", got
        assert not [r for r in got["routes"] if r.get("dst") == "default"], got["routes"]
        assert got["addrs"] == sorted(["lo 127.0.0.1", f"eth0 {h.addr}"]), got["addrs"]
    bridge = json.loads(subprocess.check_output(["ip", "-j", "addr", "show", b.state["bridge"]]))
    assert [a["local"] for a in bridge[0]["addr_info"]] == [b.driver_addr]


def test_ssh_reaches_every_host_by_name_from_the_driver_and_from_a_host(small_box):
    b = small_box
    env = b.env()
    for h in b.hosts:
        proc = subprocess.run(["ssh", h.name, 'hostname; echo "$SSH_CONNECTION"'], env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        name, conn = proc.stdout.splitlines()
        assert name == h.name and conn.split()[0::2] == [b.driver_addr, h.addr], proc.stdout
    first, last = b.hosts[0], b.hosts[-1]
    proc = b.exec(first.name, ["ssh", last.name, 'hostname; echo "$SSH_CONNECTION"'], env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:2] == [last.name, first.addr], proc.stdout


SERVE = """
    import socket, sys
    s = socket.create_server((sys.argv[1], 0))
    print(s.getsockname()[1], flush=True)
    c, _ = s.accept()
    c.sendall(b"x" * int(sys.argv[2]))
    c.close()
"""


def test_a_capped_link_carries_no_more_than_its_rate(small_box):
    """tc's tbf on both ends of the third host's veth: 2.5 MB at 20 Mbit/s take at least
    1 s however fast the machine is (a lower bound; load only adds time)."""
    b = small_box
    slow = b.hosts[2]
    for dev, ns in ((slow.veth, None), ("eth0", slow.name)):
        qdisc = subprocess.check_output(
            (["ip", "netns", "exec", ns] if ns else []) + ["tc", "qdisc", "show", "dev", dev],
            text=True)
        assert "tbf" in qdisc and "rate 20Mbit" in qdisc, (dev, qdisc)
    nbytes = 2_500_000
    server = b.popen(slow.name, [sys.executable, "-c", textwrap.dedent(SERVE), slow.addr,
                                 str(nbytes)], stdout=subprocess.PIPE, text=True)
    port = int(server.stdout.readline())
    t0 = time.monotonic()
    import socket
    with socket.create_connection((slow.addr, port), timeout=60) as c:
        got = 0
        while chunk := c.recv(1 << 16):
            got += len(chunk)
    elapsed = time.monotonic() - t0
    server.wait(30)
    assert got == nbytes
    assert elapsed >= 0.9, f"{nbytes} bytes through a 20 Mbit/s link in {elapsed:.2f} s"


HOLDER = """
    import sys, subprocess, time
    sys.path.insert(0, sys.argv[1])
    import box
    b = box.up(hosts=2, name=sys.argv[2], subnet=sys.argv[3])
    p = b.popen(b.hosts[0].name, ["sleep", "600"], start_new_session=True)
    deadline = time.monotonic() + 30  # in the host's namespace once `ip netns exec` is done
    while p.pid not in b.pids(b.hosts[0].name) and time.monotonic() < deadline:
        time.sleep(0.01)
    print("READY", flush=True)
    time.sleep(600)
"""


def test_nothing_is_left_after_down_even_when_the_owner_was_killed(tmp_path):
    """A process makes a box (namespaces, bridge, sshds, a process on a host) and is
    SIGKILLed: its box stays (no finalizer ran), a second up() is refused while the owner
    lives and cleans the leftovers once it is dead; down() then leaves nothing: no
    namespace, link, /etc/netns entry, file or process of either box."""
    needs_namespaces()
    try:
        holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER),
                                   os.path.dirname(box_mod.__file__), NAME, SUBNET],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "READY", holder.stderr.read()
            with pytest.raises(box_mod.BoxBusy, match=f"held by pid {holder.pid}"):
                box_mod.up(hosts=1, name=NAME, subnet=SUBNET)
        finally:
            holder.send_signal(signal.SIGKILL)
            holder.wait(30)
        old = box_mod.current(NAME).state
        left = box_mod.leftovers(old)
        assert any(x.startswith("process") and "sshd" in x for x in left), left
        assert any("sleep 600" in x for x in left), left
        b = box_mod.up(hosts=1, name=NAME, subnet=SUBNET, sshd=False)
        assert b.names == [f"{NAME}-host1"]
        assert not [x for x in box_mod.leftovers(old) if x.startswith("process")]
        removed = box_mod.down(NAME)
        assert f"namespace {NAME}-host1" in removed, removed
        assert box_mod.leftovers(old) == [] and box_mod.leftovers(b.state) == []
        assert box_mod.down(NAME) == []
    finally:  # a failure above must not leave a box up for the tests after it
        box_mod.down(NAME)
