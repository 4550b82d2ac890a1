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
import box_fit  # noqa: E402
from _box_spark import session_on, wait_executors  # noqa: E402

HOSTS = 4
GPUS = 2


@pytest.fixture(scope="session")
def box():
    reason = box_mod.namespaces_refused()
    if reason:
        pytest.skip(reason)

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
    session = session_on(box, "spark_hvd-tests-box")
    wait_executors(session, box, box.names)
    yield session
    session.stop()


@pytest.fixture(scope="session")
def digits(spark, box):
    """(train, test) DataFrames of scikit-learn's digits, a partition per host."""
    return box_fit.digits_frames(spark, len(box.hosts))


@pytest.fixture(scope="session")
def reference_fit(digits, tmp_path_factory):
    """An undisturbed TorchEstimator fit on 2 ranks: its test accuracy through transform
    and run here, where its ranks ran ({start epoch: {rank: host}}), and its store (a
    later fit of the same data there reuses the Parquet files)."""
    train, test = digits
    d = tmp_path_factory.mktemp("reference_fit")
    (d / "marks").mkdir()
    model = box_fit.estimator(str(d / "store"), str(d / "marks"), num_proc=box_fit.RANKS).fit(train)
    return {"transform_accuracy": box_fit.accuracy_of(model, test),
            "accuracy": box_fit.local_accuracy(model), "store": str(d / "store"),
            "launches": box_fit.launches(str(d / "marks"))}
