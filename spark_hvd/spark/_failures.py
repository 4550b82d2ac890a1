"""How the driver turns the ranks' final reports into one error, root failure first.

A task's report (see :mod:`spark_hvd.spark._task`) says how its rank ended:
``record`` (the child's result or exception record), ``returncode``, ``aborted``
(the driver stopped it), ``task_error`` (the task itself failed) and ``time``.
"""

from __future__ import annotations

from typing import Callable, Deque, Dict, List, Mapping

from spark_hvd import _config
from spark_hvd.exceptions import (CollectiveTimeoutError, RankFailedError, SparkHvdError,
                                  format_ranks)
from spark_hvd.runner._procs import describe_exit

PROG = "spark_hvd.spark.run"
_EFFECTS = ("peer_lost", "stopped")


def ok(report: dict) -> bool:
    """Whether the rank returned a value."""
    record = report.get("record")
    return bool(record and record.get("ok")) and not report.get("task_error")


def kind(report: dict) -> str:
    """``raised``, ``task``, ``exited``: causes; ``peer_lost``, ``stopped``: effects."""
    if report.get("task_error"):
        return "task"
    record = report.get("record")
    if record and not record.get("ok"):
        return "peer_lost" if record.get("peer_lost") else "raised"
    if report.get("aborted"):
        return "stopped"
    return "exited"


def failure_time(report: dict) -> float:
    """When the rank failed: its exception, else when its task saw it end."""
    record = report.get("record") or {}
    return record.get("time") or report.get("time") or float("inf")


def describe(report: dict) -> str:
    """One line on how a failed rank ended."""
    how = kind(report)
    record = report.get("record") or {}
    if how == "task":
        return f"its Spark task failed: {report['task_error'].strip().splitlines()[-1]}"
    if how in ("raised", "peer_lost"):
        return f"{record.get('type')}: {record.get('message')}"
    if how == "stopped":
        return "stopped by the driver after the failure above"
    returncode = report.get("returncode")
    if returncode is None:
        return "ended without a report"
    return f"its process {describe_exit(returncode)} without a Python exception"


def cause(report: dict) -> str:
    """What kind of failure a rank's report is (see RankFailedError.cause)."""
    how = kind(report)
    if how == "raised":
        return "collective" if (report.get("record") or {}).get("collective") else "function"
    return {"peer_lost": "collective", "exited": "process", "task": "task"}.get(how, "spark")


def tail(lines: List[str], report: dict) -> str:
    """The rank's last output lines, plus its traceback when the output lacks it."""
    lines = list(lines)
    extra = report.get("task_error") or (report.get("record") or {}).get("traceback")
    if extra and (not lines or extra.strip().splitlines()[-1] not in lines[-3:]):
        lines += extra.rstrip("\n").splitlines()
    return "\n".join(lines)


def job_error(failure: tuple, reports: Mapping[int, dict], size: int,
              tails: Mapping[int, Deque[str]], attempts: Callable[[int], int],
              start_timeout_s: float) -> SparkHvdError:
    """The one error ``run`` raises.

    ``failure`` is what ended the wait: ``("rank", r)``, ``("spark", exception)``,
    ``("start_timeout", missing ranks)`` or ``("lost", missing ranks)``; ``reports``
    the reports received, ``tails`` each rank's last output lines, ``attempts(r)`` how
    many times Spark started rank r's task.
    """
    if failure[0] == "start_timeout":  # ranks stopped after it are not news
        return CollectiveTimeoutError(
            f"{PROG}: {format_ranks(failure[1])} did not start within {start_timeout_s:g} s: "
            f"the cluster may be busy or short of task slots (each rank needs one at the same "
            f"time); raise start_timeout (or {_config.START_TIMEOUT_S_ENV_VAR}) or lower num_proc")
    failed = {r: rep for r, rep in reports.items() if not ok(rep)}
    # The root failure: the first rank to fail on its own account (a lost peer or a
    # stop by the driver is an effect), by when the failure happened.  With effects only,
    # a lost peer (its message names the lost rank) rather than a stop by the driver, which
    # follows a failure of the Spark job or a rank that never reported.
    causes = [r for r, rep in failed.items() if kind(rep) not in _EFFECTS]
    if not causes:
        causes = [r for r, rep in failed.items() if kind(rep) == "peer_lost"]
    if not causes and failure[0] not in ("spark", "lost"):
        causes = list(failed)
    roots = sorted(causes, key=lambda r: failure_time(failed[r]))[:1]
    others = sorted((r for r in failed if r not in roots),
                    key=lambda r: (kind(failed[r]) in _EFFECTS, failure_time(failed[r]), r))
    if roots:
        reason = describe(failed[roots[0]])
        head = f"rank {roots[0]} failed: {reason}"
        ranks, why = roots, cause(failed[roots[0]])
    elif failure[0] == "spark":
        first = (str(failure[1]).strip().splitlines() or [""])[0]
        reason = f"{type(failure[1]).__name__}: {first}"
        head = f"the Spark job failed before every rank reported: {reason}"
        ranks, why = [], "spark"
    else:
        reason = "ended without a report"
        head = f"{format_ranks(failure[1])} {reason}"
        ranks, why = list(failure[1]), "spark"
    lines = [f"{PROG}: {head}"]
    by_text: Dict[str, List[int]] = {}
    for r in others:
        by_text.setdefault(describe(failed[r]), []).append(r)
    lines += [f"{format_ranks(ranks)}: {text}" for text, ranks in by_text.items()]
    missing = [r for r in range(size) if r not in reports]
    retried = [r for r in missing if attempts(r) > 1]
    if retried:
        lines.append(f"{format_ranks(retried)}: the Spark task was lost and Spark retried it; "
                     f"a rank cannot be resumed (the executor logs say why it was lost)")
    missing = [r for r in missing if r not in retried]
    if missing:
        lines.append(f"{format_ranks(missing)}: no report (not started, or the task was lost "
                     f"with its executor)")
    failures = {r: tail(tails.get(r, ()), failed[r]) for r in roots + others}
    for r, text in failures.items():
        lines += [f"--- last output of rank {r} ---", text or "(no output)"]
    error = RankFailedError("\n".join(lines), failures, ranks=ranks, cause=why, reason=reason)
    if failure[0] == "spark":
        error.__cause__ = failure[1]
    return error
