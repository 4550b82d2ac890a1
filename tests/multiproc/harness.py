"""Multi-process test harness: launch ranks, run many cases per launch, report per case.

Launching a job costs about a second, so the op matrix does not launch one job
per test. Instead a *case module* (``cases_*.py``) registers many small cases
in a :class:`Registry`; one job per (module, rank count, launcher mode) runs
``case_worker.py``, which executes every case on every rank and appends one
JSON line per case and rank to ``<outdir>/rank<r>.jsonl``. The pytest side
(:class:`CaseRun`, cached per session in conftest.py) launches that job once and
turns each case into its own test item: pass, fail (with every rank's
traceback) or skip (reported across the process boundary).

A case that hangs is caught by a per-case watchdog on each rank: it records
the case as failed with the stack of the stuck thread and ends the rank, so
the cases that completed before it still report.

Cases get a :class:`Ctx` (rank, size, output dir) and must issue the same
collectives in the same order on every rank; expectations are computed from
rank and size so one case holds at 1, 2 and 3 ranks. Cases use explicit,
case-unique tensor names, so a case that fails half-way on one rank does not
pair its leftovers with the next case's tensors.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from _ranks import PYTHON, hvdrun, judge

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "case_worker.py")

PRE_INIT, MAIN, POST_SHUTDOWN = "pre_init", "main", "post_shutdown"
DEFAULT_CASE_TIMEOUT_S = 30.0
HANG_EXIT_CODE = 70


# -- cases ------------------------------------------------------------------------

class Skip(Exception):
    """Raised by a case that does not apply here (e.g. needs 2+ ranks)."""


class CaseTimeout(AssertionError):
    """An op a case waited on did not complete in time (a hang)."""


@dataclass
class Case:
    name: str
    fn: Callable
    phase: str = MAIN
    timeout_s: float = DEFAULT_CASE_TIMEOUT_S


class Registry:
    """The ordered cases of one case module."""

    def __init__(self) -> None:
        self.cases: Dict[str, Case] = {}

    def add(self, name: str, fn: Callable, phase: str = MAIN,
            timeout_s: float = DEFAULT_CASE_TIMEOUT_S) -> None:
        if name in self.cases:
            raise ValueError(f"duplicate case {name}")
        self.cases[name] = Case(name, fn, phase, timeout_s)

    def case(self, name: str, phase: str = MAIN, timeout_s: float = DEFAULT_CASE_TIMEOUT_S):
        def deco(fn):
            self.add(name, fn, phase, timeout_s)
            return fn
        return deco

    def names(self, pattern: Optional[str] = None) -> List[str]:
        return [n for n in self.cases if pattern is None or re.search(pattern, n)]


@dataclass
class Ctx:
    rank: int
    size: int
    outdir: str
    case: str = ""
    leaked: list = field(default_factory=list)  # handles of hung ops, kept alive

    def skip_unless(self, cond: bool, why: str) -> None:
        if not cond:
            raise Skip(why)


def wait_for(handle, timeout_s: float, what: str, ctx: Optional[Ctx] = None):
    """synchronize(handle), but a CaseTimeout after timeout_s instead of a hang."""
    import spark_hvd as hvd

    deadline = time.monotonic() + timeout_s
    while not hvd.poll(handle):
        if time.monotonic() >= deadline:
            if ctx is not None:
                ctx.leaked.append(handle)  # its buffers must outlive the engine
            raise CaseTimeout(f"{what} did not complete within {timeout_s} s: a hang")
        time.sleep(0.002)
    return hvd.synchronize(handle)


def expect_error(exc_types, fn, *args, **kwargs) -> BaseException:
    """Calls fn and returns the exception it raised; fails if it raised nothing or
    an exception of another type."""
    try:
        value = fn(*args, **kwargs)
    except exc_types as e:
        return e
    except BaseException as e:  # noqa: BLE001 - reported as the wrong type
        raise AssertionError(f"expected {_names(exc_types)}, got {type(e).__name__}: {e}") \
            from e
    raise AssertionError(f"expected {_names(exc_types)}, got a result: {value!r}"[:500])


def _names(exc_types) -> str:
    if isinstance(exc_types, tuple):
        return " or ".join(t.__name__ for t in exc_types)
    return exc_types.__name__


# -- the worker (one per rank) ---------------------------------------------------

def _rank_from_env() -> int:
    for var in ("SPARK_HVD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 0


class _Recorder:
    def __init__(self, outdir: str, rank: int) -> None:
        self.path = os.path.join(outdir, f"rank{rank}.jsonl")
        self.lock = threading.Lock()
        self.file = open(self.path, "a")

    def write(self, **record) -> None:
        with self.lock:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()


def _stack_of(thread_id: int) -> str:
    frame = sys._current_frames().get(thread_id)
    return "".join(traceback.format_stack(frame)) if frame else "(no stack)"


def worker_main(registry: Registry, outdir: str, pattern: Optional[str]) -> int:
    """Runs the registry's cases on this rank (called by case_worker.py)."""
    import spark_hvd as hvd

    rank = _rank_from_env()
    rec = _Recorder(outdir, rank)
    names = registry.names(pattern)
    ctx = Ctx(rank=rank, size=int(os.environ.get("SPARK_HVD_SIZE", "1")), outdir=outdir)
    main_thread = threading.get_ident()

    def run(case: Case) -> None:
        ctx.case = case.name
        rec.write(case=case.name, status="running")

        def hang() -> None:
            rec.write(case=case.name, status="fail", seconds=case.timeout_s,
                      detail=f"no result after {case.timeout_s} s (hang); stack:\n"
                             + _stack_of(main_thread))
            rec.write(case="__worker__", status="aborted", detail=f"hang in {case.name}")
            os._exit(HANG_EXIT_CODE)

        timer = threading.Timer(case.timeout_s, hang)
        timer.daemon = True
        timer.start()
        t0 = time.monotonic()
        try:
            case.fn(ctx)
        except Skip as e:
            rec.write(case=case.name, status="skip", detail=str(e))
        except BaseException:  # noqa: BLE001 - every failure is reported per case
            rec.write(case=case.name, status="fail", seconds=time.monotonic() - t0,
                      detail=traceback.format_exc()[-4000:])
        else:
            rec.write(case=case.name, status="pass", seconds=time.monotonic() - t0)
        finally:
            timer.cancel()

    by_phase = {p: [registry.cases[n] for n in names if registry.cases[n].phase == p]
                for p in (PRE_INIT, MAIN, POST_SHUTDOWN)}
    for case in by_phase[PRE_INIT]:
        run(case)
    hvd.init()
    ctx.rank, ctx.size = hvd.rank(), hvd.size()
    rec.write(case="__worker__", status="initialized", rank=ctx.rank, size=ctx.size)
    for case in by_phase[MAIN]:
        run(case)
    if by_phase[POST_SHUTDOWN]:
        hvd.shutdown()
        for case in by_phase[POST_SHUTDOWN]:
            run(case)
    rec.write(case="__worker__", status="finished")
    return 0


# -- the pytest side ---------------------------------------------------------------

class CaseRun:
    """One launched job of a case module; ``check(name)`` asserts one case's outcome.

    ``{outdir}`` in an env value is replaced by the job's output directory."""

    def __init__(self, module: str, np: int, *, mpi: bool = False,
                 env: Optional[dict] = None, pattern: Optional[str] = None,
                 timeout: float = 240, launcher_args=()) -> None:
        self.module, self.np, self.mpi = module, np, mpi
        self.outdir = tempfile.mkdtemp(prefix=f"shvd-{module}-np{np}{'-mpi' if mpi else ''}-")
        argv = [PYTHON, WORKER, module, self.outdir] + ([pattern] if pattern else [])
        env = {k: v.format(outdir=self.outdir) for k, v in (env or {}).items()}
        t0 = time.monotonic()
        self.proc = hvdrun(np, argv, mpi=mpi, env=env, timeout=timeout,
                           launcher_args=launcher_args)
        self.seconds = time.monotonic() - t0
        self.results: Dict[int, Dict[str, dict]] = {}
        for r in range(np):
            self.results[r] = {}
            path = os.path.join(self.outdir, f"rank{r}.jsonl")
            if os.path.exists(path):
                with open(path) as f:
                    for line in f:
                        record = json.loads(line)
                        self.results[r][record["case"]] = record

    def tail(self) -> str:
        return (f"job: {' '.join(self.proc.args[-6:])} -> exit {self.proc.returncode} "
                f"after {self.seconds:.1f} s\n--- stderr (tail) ---\n{self.proc.stderr[-3000:]}"
                f"\n--- stdout (tail) ---\n{self.proc.stdout[-1500:]}")

    def outcome(self, name: str) -> Dict[int, dict]:
        return {r: self.results[r].get(name, {"status": "missing"}) for r in range(self.np)}

    def check(self, name: str) -> None:
        judge(f"case {name} at np={self.np}{' --mpi' if self.mpi else ''}", self.outcome(name),
              self.tail)
