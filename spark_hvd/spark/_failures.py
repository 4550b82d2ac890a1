"""How the driver turns the ranks' final reports into one error, root failure first.

A task's report (see :mod:`spark_hvd.spark._task`) says how its rank ended:
``record`` (the child's result or exception record), ``returncode``, ``aborted``
(the driver stopped it), ``task_error`` (the task itself failed) and ``time``.
"""

from __future__ import annotations

from typing import Callable, Deque, Dict, Iterable, List, Mapping, Optional, Tuple

from spark_hvd import _config
from spark_hvd.exceptions import (CollectiveTimeoutError, RankFailedError, SparkHvdError,
                                  format_ranks)
from spark_hvd.runner import describe_exit

PROG = "spark_hvd.spark.run"
ELASTIC_PROG = "spark_hvd.spark.run_elastic"
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


def named_lost(reports: Iterable[dict]) -> set:
    """The ranks the reports' PeerLostErrors name as lost."""
    return {r for report in reports for r in (report.get("record") or {}).get("lost_ranks", ())}


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
    roots, others = _root_first(failed, any_root=failure[0] not in ("spark", "lost"))
    order = roots + others
    if roots:
        reason = describe(failed[roots[0]])
        head = f"rank {roots[0]} failed: {reason}"
        ranks, why = roots, cause(failed[roots[0]])
    elif failure[0] == "spark":
        reason = spark_failure(failure[1])
        head = f"the Spark job failed before every rank reported: {reason}"
        ranks, why = [], "spark"
    else:
        reason = "ended without a report"
        head = f"{format_ranks(failure[1])} {reason}"
        ranks, why = list(failure[1]), "spark"
    lines = [f"{PROG}: {head}"] + _grouped(others, failed, format_ranks)
    missing = [r for r in range(size) if r not in reports]
    retried = [r for r in missing if attempts(r) > 1]
    if retried:
        lines.append(f"{format_ranks(retried)}: the Spark task was lost and Spark retried it; "
                     f"a rank cannot be resumed (the executor logs say why it was lost)")
    missing = [r for r in missing if r not in retried]
    if missing:
        lines.append(f"{format_ranks(missing)}: no report (not started, or the task was lost "
                     f"with its executor)")
    return _error(lines, order, failed, tails, "rank",
                  failure[1] if failure[0] == "spark" else None,
                  ranks=ranks, cause=why, reason=reason)


def elastic_error(head: str, reports: Mapping[int, dict], tails: Mapping[int, Deque[str]],
                  cause: Optional[BaseException] = None) -> RankFailedError:
    """The error ``run_elastic`` raises: ``head``, then how each failed worker ended
    (``reports`` and ``tails`` by worker id), root failure first; ``failures`` is keyed
    by worker id."""
    failed = {w: rep for w, rep in reports.items() if not ok(rep)}
    roots, others = _root_first(failed)
    order = roots + others
    lines = [f"{ELASTIC_PROG}: {head}"] + _grouped(order, failed, format_workers)
    return _error(lines, order, failed, tails, "worker", cause)


def format_workers(workers: Iterable[int]) -> str:
    """``[worker 3]`` or ``[workers 1,2]``."""
    ws = sorted(set(workers))
    return f"[worker{'s' if len(ws) > 1 else ''} {','.join(map(str, ws))}]"


def spark_failure(exc: BaseException) -> str:
    """A Spark job's exception in one line."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def _root_first(failed: Mapping[int, dict],
                any_root: bool = True) -> Tuple[List[int], List[int]]:
    """``(root, others)``: the root failure is the first to fail on its own account (a
    lost peer or a stop by the driver is an effect), by when the failure happened; with
    effects only, a lost peer (its message names the lost rank) rather than a stop by the
    driver, and one of those only when ``any_root`` (a failure of the Spark job or a rank
    that never reported is the root otherwise). The others follow, effects last."""
    causes = [r for r, rep in failed.items() if kind(rep) not in _EFFECTS]
    if not causes:
        causes = [r for r, rep in failed.items() if kind(rep) == "peer_lost"]
    if not causes and any_root:
        causes = list(failed)
    roots = sorted(causes, key=lambda r: failure_time(failed[r]))[:1]
    return roots, sorted((r for r in failed if r not in roots),
                         key=lambda r: (kind(failed[r]) in _EFFECTS, failure_time(failed[r]), r))


def _grouped(ids: List[int], failed: Mapping[int, dict],
             fmt: Callable[[Iterable[int]], str]) -> List[str]:
    """One line per way of failing, naming who failed that way."""
    by_text: Dict[str, List[int]] = {}
    for r in ids:
        by_text.setdefault(describe(failed[r]), []).append(r)
    return [f"{fmt(ranks)}: {text}" for text, ranks in by_text.items()]


def _error(lines: List[str], order: List[int], failed: Mapping[int, dict],
           tails: Mapping[int, Deque[str]], noun: str, chained: Optional[BaseException],
           **fields) -> RankFailedError:
    failures = {r: tail(tails.get(r, ()), failed[r]) for r in order}
    for r, text in failures.items():
        lines += [f"--- last output of {noun} {r} ---", text or "(no output)"]
    error = RankFailedError("\n".join(lines), failures, **fields)
    if chained is not None:
        error.__cause__ = chained
    return error
