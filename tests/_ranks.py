"""Machinery shared by the multi-rank tests (tests/multiproc, tests/torch, tests/tensorflow).

* Launching N ranks: :func:`hvdrun` (through spark-hvdrun, with a hang timeout) and
  :class:`DirectJob` (a rendezvous server in this process, no launcher).
* Running ``check_*`` functions of rank modules (tests/torch, tests/tensorflow): the
  rank side (:func:`run_checks`, called by each framework's entry script after its
  ``hvd.init()``) prints one ``@@RANKTEST {json}`` line per start and per outcome; the
  pytest side (:func:`run_checks_job`) launches them, relaunches for the functions a
  failed launch did not reach, and :meth:`ChecksRun.check` turns each into a test.
* Judging one case from every rank's record (:func:`judge`): pass, fail with every
  rank's detail (plus the job's output tail when a rank did not finish) or skip.
  tests/multiproc's case jobs use it too.

Importable everywhere because tests/conftest.py puts this directory on sys.path.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Optional, Sequence

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
PYTHON = sys.executable
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
# Variables a launcher sets for its ranks: never inherit them from the test process.
for _k in list(ENV):
    if _k.startswith("SPARK_HVD_"):
        del ENV[_k]
TERM_GRACE_S = 20.0


def have_mpirun() -> bool:
    return shutil.which("mpirun") is not None


# -- processes -----------------------------------------------------------------

def hvdrun(np: int, argv: Sequence[str], *, mpi: Optional[bool] = None,
           env: Optional[dict] = None, timeout: float = 120,
           cwd: Optional[str] = None,
           launcher_args: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Runs ``spark-hvdrun [--gloo|--mpi] -np np [launcher_args] argv`` (the launcher's
    default controller when ``mpi`` is None) and returns its completed process (stdout/stderr
    as text).

    A job that outlives ``timeout`` gets SIGTERM (spark-hvdrun then stops its ranks,
    each of which runs in its own session), then SIGKILL after TERM_GRACE_S; it is
    reported with exit code -SIGKILL and a note at the end of stderr."""
    flag = [] if mpi is None else ["--mpi" if mpi else "--gloo"]
    cmd = [PYTHON, "-m", "spark_hvd.runner", *flag, "-np", str(np), *launcher_args, *argv]
    proc = subprocess.Popen(cmd, env=dict(ENV, **(env or {})), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
        err += f"\nharness: the job was killed after {timeout} s (hang)\n"
        return subprocess.CompletedProcess(cmd, -signal.SIGKILL, out, err)
    except BaseException:  # the test gave up (pytest-timeout, Ctrl-C): the job ends with it
        proc.send_signal(signal.SIGTERM)  # spark-hvdrun stops its ranks
        try:
            proc.wait(TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def output_tail(proc: subprocess.CompletedProcess, lines: int = 80) -> str:
    return "\n".join((proc.stderr.splitlines() + proc.stdout.splitlines())[-lines:])


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def poll_until(predicate, timeout_s: float, interval_s: float = 0.02) -> bool:
    """Polls ``predicate`` until it holds or ``timeout_s`` passed; returns whether it held."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True


def wait_gone(pids: Sequence[int], timeout_s: float) -> List[int]:
    """Waits (on pidfds, not polling) up to timeout_s for every pid to end; returns
    those still running."""
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(fd)
    return [p for p in pids if running(p)]


def rank_lines(text: str, rank: int) -> List[str]:
    """Lines the launcher prefixed with ``[rank] ``, without the prefix."""
    prefix = f"[{rank}] "
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


class DirectJob:
    """Ranks started without spark-hvdrun (a rendezvous server in this process), so a
    test sees how the survivors of a failure behave when no launcher tears them down."""

    def __init__(self, np: int, argv: Sequence[str], env: Optional[dict] = None,
                 start_timeout_s: float = 30.0) -> None:
        from spark_hvd._job import env as renv
        from spark_hvd.runner.rendezvous import RendezvousServer
        from spark_hvd._job.topology import assign

        self.server = RendezvousServer(host="127.0.0.1")
        self.server.start()
        self.procs: List[subprocess.Popen] = []
        self.logs: List[tempfile.TemporaryFile] = []
        for topo in assign(["localhost"] * np):
            rank_env = dict(ENV, **(env or {}))
            rank_env.update(renv.rank_env(topo, "127.0.0.1", self.server.port, self.server.secret,
                                          self.server.run_id, renv.CONTROLLER_GLOO,
                                          start_timeout_s))
            log = tempfile.TemporaryFile()
            self.logs.append(log)
            self.procs.append(subprocess.Popen(list(argv), env=rank_env, stdout=log,
                                               stderr=subprocess.STDOUT))

    @property
    def pids(self) -> List[int]:
        return [p.pid for p in self.procs]

    def wait(self, timeout_s: float, ranks: Optional[Sequence[int]] = None
             ) -> List[Optional[int]]:
        """Exit codes per rank (None for a rank still running after timeout_s, or not
        in ``ranks`` and not yet ended)."""
        deadline = time.monotonic() + timeout_s
        codes: List[Optional[int]] = []
        for r, p in enumerate(self.procs):
            if ranks is not None and r not in ranks:
                codes.append(p.poll())
                continue
            try:
                codes.append(p.wait(max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def output(self, rank: int) -> str:
        log = self.logs[rank]
        log.seek(0)
        return log.read().decode(errors="replace")

    def outputs(self, tail: int = 2000) -> str:
        """Every rank's last `tail` characters of output, for an assertion's message."""
        return "\n".join(f"--- rank {r} ---\n{self.output(r)[-tail:]}"
                         for r in range(len(self.procs)))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in self.logs:
            log.close()
        self.server.stop()


@contextlib.contextmanager
def script_job(np: int, text: str, workdir, env: dict, timeout_s: float):
    """Writes `text` to workdir/job.py, runs it on `np` ranks as a DirectJob (its argv[1] is
    workdir, where it writes its results) and waits up to `timeout_s`; yields the exit codes
    and every rank's output tail, then stops what is left."""
    script = os.path.join(str(workdir), "job.py")
    with open(script, "w") as f:
        f.write(text)
    job = DirectJob(np, [PYTHON, script, str(workdir)], env=env)
    try:
        codes = job.wait(timeout_s)
        yield codes, job.outputs()
    finally:
        job.close()


# -- judging one case from every rank's record -------------------------------------

PASS, SKIP, FAIL, MISSING, RUNNING = "pass", "skip", "fail", "missing", "running"


def judge(what: str, outcome: Dict[int, dict], tail: Callable[[], str]) -> None:
    """Fails or skips the calling test as ``outcome`` (rank -> record with ``status``
    and ``detail``; rank -1: the launch as a whole) says; returns if every rank passed.

    A rank that did not finish the case adds ``tail()`` (the job's output) to the
    failure; a skip must be the same on every rank."""
    import pytest

    bad = {r: o for r, o in outcome.items() if o["status"] not in (PASS, SKIP)}
    if bad:
        lines = []
        for r, o in sorted(bad.items()):
            who = "[launch]" if r < 0 else f"[rank {r}]"
            if o["status"] == MISSING:
                lines.append(f"{who} no result: the rank ended before this case")
            elif o["status"] == RUNNING:
                lines.append(f"{who} started the case but never finished it")
            else:
                lines.append(f"{who} {o['status']}:\n{o.get('detail', '')}")
        msg = "\n".join(lines)
        if any(o["status"] in (MISSING, RUNNING) for o in bad.values()):
            msg += "\n" + tail()
        pytest.fail(f"{what}:\n{msg}", pytrace=False)
    skips = {o.get("detail", "") for o in outcome.values() if o["status"] == SKIP}
    if skips:
        if len(skips) != 1 or any(o["status"] != SKIP for o in outcome.values()):
            pytest.fail(f"{what}: some ranks skipped, some ran: {outcome}", pytrace=False)
        pytest.skip(skips.pop())


# -- check_* functions of rank modules: the rank side ------------------------------

MARK = "@@RANKTEST "


def functions(path: str) -> List[str]:
    """Names of the check_* functions of a rank module, in file order (parsed, not
    imported: the framework is imported by the ranks only)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    return [n.name for n in tree.body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("check_")]


def specs(base_dir: str, *module_files: str) -> List[str]:
    """``FILE::FN`` for every check_* function of the rank modules (paths relative to
    base_dir), in order."""
    return [f"{m}::{fn}" for m in module_files for fn in functions(os.path.join(base_dir, m))]


def _emit(**rec) -> None:
    sys.stdout.write(MARK + json.dumps(rec, default=repr) + "\n")
    sys.stdout.flush()


def run_checks(base_dir: str, spec_texts: Sequence[str], rank: int, *,
               before_each: Callable[[], None] = lambda: None,
               fatal: Callable[[BaseException], bool] = lambda exc: True) -> None:
    """Runs each ``FILE::FN`` (FILE relative to base_dir) on this rank, printing a
    start line and an outcome line (``pass`` with the function's JSON-able return value
    as ``result``, ``skip`` for an exception class named ``Skip``, ``fail``).

    After a failure that ``fatal`` says may leave the ranks out of step (a peer blocked
    in a collective this rank will never join), the rank exits at once (status 1) and
    the launcher ends the others."""
    modules = {}
    for spec_text in spec_texts:
        file, _, fn = spec_text.partition("::")
        if file not in modules:
            spec = importlib.util.spec_from_file_location(os.path.splitext(file)[0],
                                                          os.path.join(base_dir, file))
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            modules[file] = module
        _emit(event="start", fn=spec_text, rank=rank)
        t0 = time.monotonic()
        before_each()
        try:
            result = getattr(modules[file], fn)()
        except Exception as exc:  # noqa: BLE001 - reported to the harness
            skip = type(exc).__name__ == "Skip"
            _emit(event=SKIP if skip else FAIL, fn=spec_text, rank=rank,
                  detail=str(exc) if skip else traceback.format_exc(),
                  seconds=time.monotonic() - t0)
            if not skip and fatal(exc):
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)
            continue
        _emit(event=PASS, fn=spec_text, rank=rank, seconds=time.monotonic() - t0,
              result=result)


# -- check_* functions of rank modules: the pytest side ----------------------------

class ChecksRun:
    """Every rank's outcome of each ``FILE::FN`` spec of one or more launches."""

    def __init__(self, np: int) -> None:
        self.np = np
        self.records: Dict[str, Dict[int, dict]] = {}
        self.not_run: Dict[str, str] = {}  # spec -> why (with the output tail)
        self.launches = 0
        self.wall_s = 0.0

    def add_output(self, stdout: str) -> Dict[str, set]:
        """Records the outcome lines of one launch; returns the ranks each spec started on."""
        started: Dict[str, set] = {}
        for line in stdout.splitlines():
            _, sep, payload = line.partition(MARK)
            if not sep:
                continue
            rec = json.loads(payload)
            if rec["event"] == "start":
                started.setdefault(rec["fn"], set()).add(rec["rank"])
            else:
                self.records.setdefault(rec["fn"], {})[rec["rank"]] = dict(
                    rec, status=rec["event"])
        return started

    def finished(self, spec: str) -> bool:
        recs = self.records.get(spec, {})
        return any(r["status"] == FAIL for r in recs.values()) or len(recs) >= self.np

    def check(self, spec: str) -> Optional[dict]:
        """Fails or skips the calling test as the ranks reported ``spec``; returns rank
        0's record (with the function's ``result``) when every rank passed."""
        recs = self.records.get(spec, {})
        outcome = {r: recs.get(r, {"status": MISSING}) for r in range(self.np)}
        if -1 in recs:
            outcome[-1] = recs[-1]
        judge(f"{spec} at np={self.np}", outcome,
              lambda: self.not_run.get(spec, ""))
        return recs.get(0)


def run_checks_job(entry_argv: Sequence[str], todo: Sequence[str], np: int, *,
                   timeout: float = 240, env: Optional[dict] = None) -> ChecksRun:
    """Runs ``FILE::FN`` specs in ``np`` ranks (``entry_argv + specs`` under spark-hvdrun),
    relaunching for the specs an ended launch did not reach, so one failure does not hide
    the rest. A launch that ended without any rank reporting a failure (a crash, a hang)
    is blamed on the first spec without a full result."""
    run = ChecksRun(np)
    pending = list(todo)
    t0 = time.monotonic()
    while pending:
        run.launches += 1
        proc = hvdrun(np, [*entry_argv, *pending], env=env, timeout=timeout, cwd=ROOT)
        started = run.add_output(proc.stdout)
        done = [s for s in pending if run.finished(s)]
        tail = output_tail(proc)
        if proc.returncode == 0:
            for s in pending:
                if s not in done:
                    run.not_run[s] = f"no result reported although the launch succeeded:\n{tail}"
            break
        # The launch ended early: a rank that reported a failure ended it; otherwise
        # (a crash or hang without a report) blame the first spec without a full result.
        reported = any(r["status"] == FAIL for s in pending
                       for r in run.records.get(s, {}).values())
        culprit = next((s for s in pending if s not in done), None)
        if culprit is not None and not reported:
            why = "timed out" if proc.returncode == -signal.SIGKILL else \
                f"the launch exited with {proc.returncode}"
            ranks = sorted(started.get(culprit, ()))
            run.records.setdefault(culprit, {})[-1] = {
                "status": FAIL,
                "detail": f"{why} while running it (started on ranks {ranks}); "
                          f"output tail:\n{tail}"}
            done.append(culprit)
        remaining = [s for s in pending if s not in done]
        if len(remaining) == len(pending):  # no progress: give up on the rest
            for s in remaining:
                run.not_run[s] = f"launch failed without progress:\n{tail}"
            break
        pending = remaining
    run.wall_s = time.monotonic() - t0
    return run


def open_sockets() -> int:
    """This process's open sockets (a descriptor closed while they are counted is none)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n
