"""The cluster in a box (box.py) as pytest fixtures.

``box``: one 4-host box for the session (sshd on every host, a Spark standalone Master
and a Worker per host with 2 fake GPUs), removed at the end, and checked gone. ``spark``:
a SparkSession whose driver runs in this process (the root namespace, at the bridge's
address) on that cluster, with one executor per host. The tests skip only where the
kernel refuses namespaces (box.namespaces_refused says why); anything else that keeps
the box from starting is a failure.
"""

import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import box as box_mod  # noqa: E402

HOSTS = 4
GPUS = 2


def needs_namespaces() -> None:
    reason = box_mod.namespaces_refused()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def box():
    needs_namespaces()

    def interrupted(signum, frame):  # a CI timeout's SIGTERM still runs the finalizers
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupted)
    t0 = time.monotonic()
    b = box_mod.up(hosts=HOSTS, spark=True, gpus=GPUS)
    print(f"\nbox up in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    try:
        yield b
    finally:
        box_mod.down()
        signal.signal(signal.SIGTERM, previous)
    left = box_mod.leftovers(b.state)
    assert not left, f"the box's down() left: {left}"


@pytest.fixture(scope="session")
def spark(box):
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = box.driver_addr
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("spark_hvd-tests-box")
    for key, value in box.spark_conf().items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    wait_executors(session, box, box.names)
    yield session
    session.stop()


def executor_hosts(session, box) -> list:
    """The hosts (box names) with a live executor of ``session``."""
    by_addr = {h.addr: h.name for h in box.hosts}
    status = session.sparkContext._jsc.sc().getExecutorMemoryStatus()
    addrs = [status.keys().toList().apply(i).split(":")[0] for i in range(status.size())]
    return sorted(by_addr[a] for a in addrs if a in by_addr)


def wait_executors(session, box, hosts, timeout_s: float = 120) -> None:
    """Until ``session`` has an executor on each of ``hosts``."""
    deadline = time.monotonic() + timeout_s
    while not set(hosts) <= set(executor_hosts(session, box)):
        if time.monotonic() > deadline:
            pytest.fail(f"executors on {executor_hosts(session, box)} after {timeout_s:.0f} s; "
                        f"wanted {sorted(hosts)}")
        time.sleep(0.2)
