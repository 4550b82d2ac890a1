"""A Spark driver on the box's cluster: the session, and where its executors are."""

import os
import sys
import time


def session_on(box, app_name: str):
    """A SparkSession whose driver runs in this process (the root namespace, at the
    bridge's address) on the box's standalone cluster (Box.spark_conf)."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = box.driver_addr
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    for key, value in box.spark_conf().items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session


def executor_hosts(session, box) -> list:
    """The hosts (box names) with a live executor of ``session``."""
    by_addr = {h.addr: h.name for h in box.hosts}
    status = session.sparkContext._jsc.sc().getExecutorMemoryStatus()
    addrs = [status.keys().toList().apply(i).split(":")[0] for i in range(status.size())]
    return sorted(by_addr[a] for a in addrs if a in by_addr)


def wait_executors(session, box, hosts, timeout_s: float = 120) -> None:
    """Until ``session`` has an executor on each of ``hosts`` (TimeoutError after
    ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while not set(hosts) <= set(executor_hosts(session, box)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"executors on {executor_hosts(session, box)} after "
                               f"{timeout_s:.0f} s; wanted {sorted(hosts)}")
        time.sleep(0.2)
