"""The check every reader runs each epoch: the rows it delivered against the row counts in
its shard's Parquet footers. A reader must never lose rows silently (petastorm 0.13.1's
thread pool can end an iteration early; a file can change under a reader), so a shortfall
is a RowsMissingError naming the files, the rows expected and the rows received."""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Iterator, Sequence

import numpy as np

from ..exceptions import SparkHvdError

Batch = Dict[str, np.ndarray]


class RowsMissingError(SparkHvdError, RuntimeError):
    """A reader delivered fewer rows of an epoch than its shard's Parquet footers hold."""


def rows_of(batch: Batch) -> int:
    return len(next(iter(batch.values()))) if batch else 0


def files_text(files: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(f"'{f}'" for f in files[:limit])
    return shown + (f" and {len(files) - limit} more" if len(files) > limit else "")


def missing(what: str, rank: int, epoch: int, got: int, expected: int,
            files: Sequence[str], detail: str = "") -> RowsMissingError:
    """The error for an epoch's shortfall; its ``files`` are the shard's files."""
    exc = RowsMissingError(
        f"{what} on rank {rank} delivered {got} of the {expected} rows of epoch {epoch} that "
        f"the Parquet footers of its shard announce ({files_text(files)}){detail}. No row may "
        f"be lost silently: check that the files are not being rewritten while training reads "
        f"them, or use reader='arrow' if this comes from petastorm.")
    exc.files = list(files)
    return exc


def checked(batches: Iterable[Batch], *, expected_rows: int, expected_batches: int,
            what: str, rank: int, epoch: int, files: Sequence[str],
            stopped: Callable[[], bool] = lambda: False) -> Iterator[Batch]:
    """``batches`` unchanged, raising RowsMissingError when their rows fall short of
    ``expected_rows``: before the last planned batch is handed out (so a loop that takes
    exactly ``expected_batches`` batches still sees the error), or when they end early
    (unless ``stopped()``: the reader was closed during the epoch)."""
    got_rows = got_batches = 0
    source = iter(batches)
    try:
        for batch in source:
            got_rows += rows_of(batch)
            got_batches += 1
            if got_batches == expected_batches and got_rows != expected_rows:
                raise missing(what, rank, epoch, got_rows, expected_rows, files)
            yield batch
    except RowsMissingError as exc:
        if getattr(exc, "files", None):  # already names the shard's files
            raise
        raise missing(what, rank, epoch, got_rows, expected_rows, files,
                      f": {exc}") from None
    finally:  # a loop that stops early stops the reading now (its prefetch thread too)
        close = getattr(source, "close", None)
        if close is not None:
            close()
    if got_rows != expected_rows and not stopped():
        raise missing(what, rank, epoch, got_rows, expected_rows, files,
                      f" in {got_batches} of {expected_batches} batches")
