"""The exception taxonomy shared by the native core and the Python layers.

Every error that crosses a process boundary (a rank's child process, a Spark
executor, the driver) is one of these, and each survives pickling with its
fields, so what a rank raised is what the driver re-raises.

An error carries its evidence as fields as well as in its message:

- ``ranks``: the ranks the failure is about, when known (PeerLostError: the lost
  or departed ones; CollectiveTimeoutError from the stall check: the ranks that
  never submitted the tensor; TensorMismatchError: the two that disagree);
- ``tensor``: the name of the op that failed ("" when the failure is not one op's).

The native core reports a failure as a Status (csrc/common/status.h) and the binding
calls :func:`from_code` with its ``spark_hvd._core.StatusCode``, message and evidence.
Each class's ``code`` is the value of that enum member (the rendezvous protocol
sends the same values); this module does not import the core, so launchers can
use it without loading the native library, and tests/unit/test_exceptions.py checks
the mapping against the enum.

Horovod compatibility: Horovod raises ``HorovodInternalError`` (a RuntimeError) when
a collective fails, tensor mismatches included, and ``ValueError`` when used before
``init()``; code written for it catches those. So the failures of a collective
(TensorMismatchError, CollectiveTimeoutError, PeerLostError, InternalError) are also
HorovodInternalError, InvalidArgumentError is a RuntimeError as well as a ValueError
(Horovod's core refuses a bad root rank or process set with a RuntimeError), and
NotInitializedError is a ValueError as well as a RuntimeError. HostsUpdatedInterrupt is
Horovod's elastic-mode interrupt: an elastic state's ``commit()`` raises it on every rank
when the job's membership changes (spark_hvd/elastic.py).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence


class SparkHvdError(Exception):
    """Base class of every error raised by spark_hvd."""

    code = 1  # StatusCode.UNKNOWN

    def __init__(self, message: str = "", *, ranks: Optional[Sequence[int]] = None,
                 tensor: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.ranks = list(ranks) if ranks else []
        self.tensor = tensor

    def __reduce__(self):
        # The message rebuilds the exception (args, str); the state restores every
        # field, those of subclasses included.
        return (type(self), (self.message,), dict(self.__dict__))

    def __str__(self) -> str:
        return self.message


class HorovodInternalError(SparkHvdError, RuntimeError):
    """A collective failed (Horovod's name for it): the base of the errors an op's
    ``synchronize`` raises when the op, not its arguments on this rank, went wrong."""


class HostsUpdatedInterrupt(SparkHvdError, RuntimeError):
    """Horovod's elastic-mode interrupt: the job's membership changed (workers wait to
    join or are to leave). ``State.commit()`` / ``check_host_updates()`` raise it on every
    rank at once in an elastic job (``spark_hvd.elastic``); ``skip_sync`` as in Horovod
    (True when the change only removed workers)."""

    def __init__(self, skip_sync: bool = False, message: str = "", *,
                 ranks: Optional[Sequence[int]] = None, tensor: str = "") -> None:
        super().__init__(message, ranks=ranks, tensor=tensor)
        self.skip_sync = skip_sync

    def __reduce__(self):
        return (type(self), (self.skip_sync, self.message), dict(self.__dict__))


class InvalidArgumentError(SparkHvdError, ValueError, RuntimeError):
    """Bad input: a wrong dtype, a shape that does not fit, an unknown op..."""

    code = 2


class TensorMismatchError(InvalidArgumentError, HorovodInternalError):
    """The same tensor name was submitted with different properties on two ranks."""

    code = 3


class NotInitializedError(SparkHvdError, RuntimeError, ValueError):
    """An operation needs ``init()`` first (or ran after ``shutdown()``)."""

    code = 4


class CollectiveTimeoutError(HorovodInternalError, TimeoutError):
    """A collective, a rendezvous lookup or a launch did not finish in time."""

    code = 5


class PeerLostError(HorovodInternalError, ConnectionError):
    """A peer rank died or its connection broke; ``ranks`` names the lost ones when known."""

    code = 6

    def __init__(self, message: str = "", ranks: Optional[Sequence[int]] = None, *,
                 tensor: str = "") -> None:
        super().__init__(message, ranks=ranks, tensor=tensor)


class StoreError(SparkHvdError):
    """The rendezvous store refused or failed a request."""

    code = 7


class AuthenticationError(StoreError):
    """A rendezvous request was not signed with the job's secret."""

    code = 8


class InternalError(HorovodInternalError):
    """An internal invariant failed: a bug in spark_hvd; please report it."""

    code = 9


class RankFailedError(SparkHvdError):
    """One or more ranks of a distributed job failed.

    ``failures`` maps rank -> tail of that rank's output (traceback included);
    ``ranks`` is the rank of the root failure (the ranks that never reported, when
    none did); ``reason`` is one line on the root failure; ``cause`` says what kind
    of failure it was, for callers deciding whether running the job again can help:

    - ``function``: the function raised an exception of its own (running it again
      raises it again);
    - ``collective``: a collective failed (a HorovodInternalError other than a tensor
      mismatch: a lost peer, a timeout);
    - ``process``: the rank's process ended without a Python exception (killed by a
      signal, out of memory, crashed);
    - ``task``: the rank's Spark task failed around the function (its set-up, or the
      return value could not be read);
    - ``spark``: the Spark job failed or ranks never reported (an executor lost);
    - ``""``: not told.
    """

    code = 10  # not a core status: raised by the launchers

    def __init__(self, message: str = "", failures: Optional[dict] = None, *,
                 ranks: Optional[Sequence[int]] = None, tensor: str = "", cause: str = "",
                 reason: str = "") -> None:
        super().__init__(message, ranks=ranks, tensor=tensor)
        self.failures = dict(failures or {})
        self.cause = cause
        self.reason = reason


_BY_CODE = {cls.code: cls for cls in (
    SparkHvdError, InvalidArgumentError, TensorMismatchError, NotInitializedError,
    CollectiveTimeoutError, PeerLostError, StoreError, AuthenticationError, InternalError,
    RankFailedError)}


def from_code(code: int, message: str, *, ranks: Optional[Sequence[int]] = None,
              tensor: str = "") -> SparkHvdError:
    """The exception for a status code (a ``_core.StatusCode`` member or its value),
    with its evidence; unknown codes give InternalError."""
    return _BY_CODE.get(int(code), InternalError)(message, ranks=ranks, tensor=tensor)


def format_ranks(ranks: Iterable[int]) -> str:
    """``[rank 3]`` or ``[ranks 0,2,3]``: how messages name a group of ranks."""
    rs = sorted(set(ranks))
    if len(rs) == 1:
        return f"[rank {rs[0]}]"
    return "[ranks " + ",".join(str(r) for r in rs) + "]"
