"""The exception taxonomy shared by the native core and the Python layers.

Every error that crosses a process boundary (a rank's child process, a Spark
executor, the driver) is one of these, and each survives pickling with its
fields, so what a rank raised is what the driver re-raises.

The native core reports a failure as ``(code, message)``; :func:`from_code`
turns it into the matching class.  The codes mirror ``csrc/common/status.h``.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence


class SparkHvdError(Exception):
    """Base class of every error raised by spark_hvd."""

    code = 1

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self):
        return (type(self), (self.message,))

    def __str__(self) -> str:
        return self.message


class InvalidArgumentError(SparkHvdError, ValueError):
    """Bad input: a wrong dtype, a shape that does not fit, an unknown op..."""

    code = 2


class TensorMismatchError(InvalidArgumentError):
    """The same tensor name was submitted with different properties on two ranks."""

    code = 3


class NotInitializedError(SparkHvdError, RuntimeError):
    """An operation needs ``init()`` first (or ran after ``shutdown()``)."""

    code = 4


class CollectiveTimeoutError(SparkHvdError, TimeoutError):
    """A collective, a rendezvous lookup or a launch did not finish in time."""

    code = 5


class PeerLostError(SparkHvdError, ConnectionError):
    """A peer rank died or its connection broke; ``ranks`` names the lost ones when known."""

    code = 6

    def __init__(self, message: str = "", ranks: Optional[Sequence[int]] = None) -> None:
        super().__init__(message)
        self.ranks = list(ranks) if ranks else []

    def __reduce__(self):
        return (type(self), (self.message, self.ranks))


class StoreError(SparkHvdError):
    """The rendezvous store refused or failed a request."""

    code = 7


class AuthenticationError(StoreError):
    """A rendezvous request was not signed with the job's secret."""

    code = 8


class InternalError(SparkHvdError, RuntimeError):
    """An internal invariant failed: a bug in spark_hvd; please report it."""

    code = 9


class RankFailedError(SparkHvdError):
    """One or more ranks of a distributed job failed.

    ``failures`` maps rank -> tail of that rank's output (traceback included).
    """

    code = 10

    def __init__(self, message: str = "", failures: Optional[dict] = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})

    def __reduce__(self):
        return (type(self), (self.message, self.failures))


_BY_CODE = {cls.code: cls for cls in (
    SparkHvdError, InvalidArgumentError, TensorMismatchError, NotInitializedError,
    CollectiveTimeoutError, PeerLostError, StoreError, AuthenticationError, InternalError,
    RankFailedError)}


def from_code(code: int, message: str) -> SparkHvdError:
    """The exception for a native status code (unknown codes give InternalError)."""
    return _BY_CODE.get(code, InternalError)(message)


def format_ranks(ranks: Iterable[int]) -> str:
    """``[rank 3]`` or ``[ranks 0,2,3]``: how messages name a group of ranks."""
    rs = sorted(set(ranks))
    if len(rs) == 1:
        return f"[rank {rs[0]}]"
    return "[ranks " + ",".join(str(r) for r in rs) + "]"
