"""The exception taxonomy: picklable with its fields (errors cross Spark executors),
the evidence fields, the documented base classes, and the mapping from the native
core's StatusCode enum."""

import concurrent.futures
import multiprocessing
import pickle

import cloudpickle
import pytest

import spark_hvd
from spark_hvd import exceptions as E

ALL = [E.SparkHvdError, E.InvalidArgumentError, E.TensorMismatchError, E.NotInitializedError,
       E.CollectiveTimeoutError, E.PeerLostError, E.StoreError, E.AuthenticationError,
       E.InternalError, E.RankFailedError]


def samples():
    """One instance of every class, with every field set."""
    out = [cls(f"{cls.__name__}: tensor 'grad.0' on [ranks 0,2]", ranks=[0, 2],
               tensor="grad.0") for cls in ALL if cls not in (E.PeerLostError, E.RankFailedError)]
    out.append(E.PeerLostError("rank 2 exited", ranks=[2, 5], tensor="w"))
    out.append(E.RankFailedError("ranks 1,3 failed",
                                 failures={1: "Traceback...\nValueError: x", 3: "killed"},
                                 ranks=[1], cause="function", reason="ValueError: x"))
    return out


def fields(e):
    return (type(e), e.message, str(e), e.args, e.ranks, e.tensor, getattr(e, "failures", None),
            getattr(e, "cause", None), getattr(e, "reason", None))


@pytest.mark.parametrize("exc", samples(), ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_round_trip_keeps_type_and_fields(exc, protocol):
    back = pickle.loads(pickle.dumps(exc, protocol=protocol))
    assert fields(back) == fields(exc)


@pytest.mark.parametrize("exc", samples(), ids=lambda e: type(e).__name__)
def test_cloudpickle_round_trip(exc):
    assert fields(cloudpickle.loads(cloudpickle.dumps(exc))) == fields(exc)


@pytest.mark.parametrize("cls", ALL)
def test_no_argument_construction_pickles(cls):
    e = cls()
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls and back.message == "" and str(back) == ""
    assert back.ranks == [] and back.tensor == ""
    if cls is E.RankFailedError:
        assert back.failures == {} and back.cause == "" and back.reason == ""


def test_peer_lost_ranks_are_a_list_and_not_shared():
    src = (3, 1)
    e = E.PeerLostError("lost", ranks=src)
    assert e.ranks == [3, 1] and isinstance(e.ranks, list)
    f = E.RankFailedError("x", failures={0: "a"})
    f2 = pickle.loads(pickle.dumps(f))
    f2.failures[1] = "b"
    assert f.failures == {0: "a"}


def test_constructors_keep_their_positional_arguments():
    assert E.PeerLostError("lost", [1, 2]).ranks == [1, 2]
    assert E.RankFailedError("failed", {0: "tail"}).failures == {0: "tail"}
    e = E.TensorMismatchError("shape differs", ranks=[0, 1], tensor="w")
    assert (e.message, e.ranks, e.tensor) == ("shape differs", [0, 1], "w")


def test_fields_set_after_construction_pickle_too():
    e = E.TensorMismatchError("x")
    e.tensor = "late"
    e.add_note("a note")
    back = pickle.loads(pickle.dumps(e))
    assert back.tensor == "late" and back.__notes__ == ["a note"]


def test_raised_with_a_cause_still_pickles():
    try:
        try:
            raise OSError("socket closed")
        except OSError as inner:
            raise E.PeerLostError("rank 1 lost", ranks=[1]) from inner
    except E.PeerLostError as e:
        back = pickle.loads(pickle.dumps(e))
    assert fields(back)[:6] == (E.PeerLostError, "rank 1 lost", "rank 1 lost", ("rank 1 lost",),
                                [1], "")


def _raise_in_child(kind):
    if kind == "peer":
        raise E.PeerLostError("rank 2 died", ranks=[2])
    if kind == "mismatch":
        raise E.TensorMismatchError("tensor 'w' shape differs: rank 0 has (3,), rank 1 has (4,)",
                                    ranks=[0, 1], tensor="w")
    raise E.RankFailedError("rank 0 failed", failures={0: "tail"})


@pytest.fixture(scope="module")
def pool():
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as p:
        yield p


@pytest.mark.parametrize("kind", ["peer", "mismatch", "failed"])
def test_error_raised_in_another_process_arrives_intact(pool, kind):
    """What a rank raises is what the driver re-raises (the process-pool path pickles)."""
    with pytest.raises(E.SparkHvdError) as info:
        pool.submit(_raise_in_child, kind).result(timeout=60)
    e = info.value
    if kind == "peer":
        assert type(e) is E.PeerLostError and e.ranks == [2] and str(e) == "rank 2 died"
    elif kind == "mismatch":
        assert type(e) is E.TensorMismatchError and "rank 1 has (4,)" in str(e)
        assert e.tensor == "w" and e.ranks == [0, 1]
    else:
        assert type(e) is E.RankFailedError and e.failures == {0: "tail"}


def test_standard_base_classes():
    assert issubclass(E.InvalidArgumentError, ValueError)
    assert issubclass(E.TensorMismatchError, E.InvalidArgumentError)
    assert issubclass(E.NotInitializedError, RuntimeError)
    assert issubclass(E.CollectiveTimeoutError, TimeoutError)
    assert issubclass(E.PeerLostError, ConnectionError)
    assert issubclass(E.InternalError, RuntimeError)
    assert issubclass(E.AuthenticationError, E.StoreError)
    for cls in ALL:
        assert issubclass(cls, E.SparkHvdError) and issubclass(cls, Exception)


def test_codes_are_unique_and_from_code_maps_back():
    codes = [cls.code for cls in ALL]
    assert len(set(codes)) == len(codes)
    for cls in ALL:
        e = E.from_code(cls.code, "msg")
        assert type(e) is cls and str(e) == "msg" and e.message == "msg"


# One class per failure kind of the core (csrc/common/status.h); OK is no error.
BY_STATUS = {"UNKNOWN": E.SparkHvdError, "INVALID_ARGUMENT": E.InvalidArgumentError,
             "MISMATCH": E.TensorMismatchError, "NOT_INITIALIZED": E.NotInitializedError,
             "TIMEOUT": E.CollectiveTimeoutError, "PEER_LOST": E.PeerLostError,
             "STORE_ERROR": E.StoreError, "AUTHENTICATION": E.AuthenticationError,
             "INTERNAL": E.InternalError}


def test_every_core_status_code_has_its_class():
    from spark_hvd._types import StatusCode

    assert {m.name for m in StatusCode} == set(BY_STATUS) | {"OK"}
    for member in StatusCode:
        if member.name == "OK":
            continue
        cls = BY_STATUS[member.name]
        assert cls.code == member
        e = E.from_code(member, "msg", ranks=[3], tensor="grad.1")
        assert type(e) is cls and (e.ranks, e.tensor) == ([3], "grad.1")
    assert E.RankFailedError.code not in {m.value for m in StatusCode}  # launchers' own


@pytest.mark.parametrize("code", [0, -1, 99, 12345])
def test_unknown_code_is_an_internal_error(code):
    e = E.from_code(code, "boom")
    assert type(e) is E.InternalError and str(e) == "boom"


def test_format_ranks():
    assert E.format_ranks([3]) == "[rank 3]"
    assert E.format_ranks([3, 0, 2, 2]) == "[ranks 0,2,3]"
    assert E.format_ranks(iter([1, 0])) == "[ranks 0,1]"


def test_public_names_are_the_same_classes():
    for name in ("SparkHvdError", "InvalidArgumentError", "TensorMismatchError",
                 "NotInitializedError", "CollectiveTimeoutError", "PeerLostError",
                 "InternalError"):
        assert getattr(spark_hvd, name) is getattr(E, name)
