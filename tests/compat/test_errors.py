"""Horovod's exception contract, checked without a job: collective failures are
HorovodInternalError (a RuntimeError), a bad argument the core refuses is a
RuntimeError, use before init() a ValueError; the Horovod names are exported where
Horovod code imports them from; spark_hvd's own taxonomy stays as it was."""

import pickle

import pytest

import spark_hvd
from spark_hvd import exceptions as E

COLLECTIVE_FAILURES = [E.TensorMismatchError, E.CollectiveTimeoutError, E.PeerLostError,
                       E.InternalError]


@pytest.mark.parametrize("cls", COLLECTIVE_FAILURES)
def test_collective_failures_are_horovod_internal_errors(cls):
    assert issubclass(cls, E.HorovodInternalError) and issubclass(cls, RuntimeError)
    with pytest.raises(RuntimeError):
        raise cls("failed", ranks=[0, 1], tensor="w")


def test_spark_hvd_bases_are_kept():
    assert issubclass(E.HorovodInternalError, E.SparkHvdError)
    assert issubclass(E.TensorMismatchError, E.InvalidArgumentError)
    assert issubclass(E.InvalidArgumentError, ValueError)
    assert issubclass(E.CollectiveTimeoutError, TimeoutError)
    assert issubclass(E.PeerLostError, ConnectionError)


def test_invalid_argument_is_value_error_and_runtime_error():
    # Horovod: Python-side checks raise ValueError, the core's refusals (a bad root
    # rank, an unknown process set) RuntimeError; spark_hvd has one class for both.
    for base in (ValueError, RuntimeError):
        with pytest.raises(base):
            raise E.InvalidArgumentError("bad")
    assert not issubclass(E.InvalidArgumentError, E.HorovodInternalError)


def test_not_initialized_is_value_error_as_in_horovod():
    assert issubclass(E.NotInitializedError, ValueError)
    assert issubclass(E.NotInitializedError, RuntimeError)


def test_hosts_updated_interrupt_takes_skip_sync_and_pickles():
    assert issubclass(E.HostsUpdatedInterrupt, RuntimeError)
    e = E.HostsUpdatedInterrupt(True)
    assert e.skip_sync is True and e.message == ""
    back = pickle.loads(pickle.dumps(E.HostsUpdatedInterrupt(True, "hosts changed")))
    assert type(back) is E.HostsUpdatedInterrupt
    assert (back.skip_sync, str(back)) == (True, "hosts changed")
    assert E.HostsUpdatedInterrupt().skip_sync is False


def test_horovod_internal_error_pickles():
    back = pickle.loads(pickle.dumps(E.HorovodInternalError("x", ranks=[1], tensor="t")))
    assert type(back) is E.HorovodInternalError and (back.ranks, back.tensor) == ([1], "t")


@pytest.mark.parametrize("module", ["spark_hvd", "spark_hvd.torch", "spark_hvd.tensorflow"])
def test_horovod_names_are_exported(module):
    mod = pytest.importorskip(module)
    for name in ("HorovodInternalError", "HostsUpdatedInterrupt"):
        assert getattr(mod, name) is getattr(E, name)
        assert name in mod.__all__


@pytest.mark.parametrize("module", ["spark_hvd.common.exceptions", "spark_hvd.torch.mpi_ops"])
def test_horovod_names_are_where_horovod_keeps_them(module):
    """horovod.common.exceptions and horovod.torch.mpi_ops have them too."""
    mod = pytest.importorskip(module)
    for name in ("HorovodInternalError", "HostsUpdatedInterrupt"):
        assert getattr(mod, name) is getattr(E, name)


def test_a_broadcast_root_outside_the_set_names_the_set():
    ps = spark_hvd.ProcessSet([2, 1])
    assert ps._set_rank_of(2) == 1 and ps._set_rank_of(1) == 0
    with pytest.raises(E.InvalidArgumentError) as info:
        ps._set_rank_of(0)
    msg = str(info.value)
    assert "root_rank 0" in msg and "[1, 2]" in msg and "global rank" in msg
    assert spark_hvd.global_process_set._set_rank_of(5) == 5
