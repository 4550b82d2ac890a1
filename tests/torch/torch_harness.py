"""Runs functions of "rank modules" in N ranks through spark-hvdrun and collects results.

A rank module (``rank_*.py`` here, not collected by pytest) defines functions
``check_<what>()``; each runs on every rank after ``hvd.init()`` and raises to
fail (an exception class named ``Skip`` skips it, with its message). One launch
runs many functions (``FILE::FN`` specs, in order), which keeps the per-launch
cost (interpreter, torch import, rendezvous: seconds on a loaded 2-core box) off
each test. A rank that fails prints its traceback and exits, the launcher ends
the other ranks, and the harness relaunches for the functions that did not run
yet, so one failure does not hide the others. A launch that hangs is stopped
(SIGTERM: spark-hvdrun stops its ranks) and the running function blamed.

    run = run_specs(specs("rank_ops.py"), np=2)
    run.check("rank_ops.py::check_allreduce_every_dtype_op_shape")
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
ENTRY = os.path.join(HERE, "rank_entry.py")
MARK = "@@HVDTEST "
LAUNCH_TIMEOUT_S = 240
RANK_MODULES = ["rank_ops.py", "rank_optimizer.py", "rank_sync_bn.py"]


def functions(module_file: str) -> List[str]:
    """Names of the check_* functions of a rank module, in file order (no import)."""
    with open(os.path.join(HERE, module_file)) as f:
        tree = ast.parse(f.read())
    return [n.name for n in tree.body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("check_")]


def specs(*module_files: str) -> List[str]:
    return [f"{m}::{fn}" for m in module_files for fn in functions(m)]


class Outcome:
    def __init__(self) -> None:
        self.ranks_ok: set = set()
        self.skips: Dict[int, str] = {}
        self.failures: Dict[int, str] = {}
        self.seconds = 0.0


class RankRun:
    def __init__(self, np: int) -> None:
        self.np = np
        self.outcomes: Dict[str, Outcome] = {}
        self.not_run: Dict[str, str] = {}
        self.launches = 0
        self.wall_s = 0.0

    def check(self, spec: str) -> None:
        import pytest

        if spec in self.not_run:
            raise AssertionError(f"{spec} did not run ({self.np} ranks): {self.not_run[spec]}")
        o = self.outcomes[spec]
        if o.failures:
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(o.failures.items()))
            raise AssertionError(f"{spec} failed on ranks {sorted(o.failures)} of {self.np} "
                                 f"(-1: the launch as a whole):\n{text}")
        if o.skips:
            pytest.skip(f"{spec} ({self.np} ranks): {next(iter(o.skips.values()))}")
        if len(o.ranks_ok) != self.np:
            raise AssertionError(f"{spec}: only ranks {sorted(o.ranks_ok)} of {self.np} reported")


def _launch(np: int, todo: List[str], timeout: float, env_extra: Optional[dict]):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    if env_extra:
        env.update(env_extra)
    cmd = [sys.executable, "-m", "spark_hvd.runner", "-np", str(np), sys.executable, ENTRY,
           *todo]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM lets spark-hvdrun stop every rank (each runs in its own session,
        # so a SIGKILLed launcher would leave them running).
        timed_out = True
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    return (None if timed_out else proc.returncode), out.decode(errors="replace"), \
        err.decode(errors="replace"), timed_out


def _record(run: RankRun, out: str) -> Dict[str, set]:
    started: Dict[str, set] = {}
    for line in out.splitlines():
        _, sep, payload = line.partition(MARK)
        if not sep:
            continue
        rec = json.loads(payload)
        spec, rank = rec["fn"], rec["rank"]
        if rec["event"] == "start":
            started.setdefault(spec, set()).add(rank)
            continue
        o = run.outcomes.setdefault(spec, Outcome())
        o.seconds = max(o.seconds, rec.get("seconds", 0.0))
        if rec["event"] == "ok":
            o.ranks_ok.add(rank)
        elif rec["event"] == "skip":
            o.skips[rank] = rec["detail"]
        else:
            o.failures[rank] = rec["detail"]
    return started


def run_specs(todo: List[str], np: int, timeout: float = LAUNCH_TIMEOUT_S,
              env: Optional[dict] = None) -> RankRun:
    """Runs ``FILE::FN`` specs in ``np`` ranks (relaunching after a failure)."""
    run = RankRun(np)
    pending = list(todo)
    t0 = time.monotonic()
    while pending:
        run.launches += 1
        rc, out, err, timed_out = _launch(np, pending, timeout, env)
        started = _record(run, out)

        def finished(spec):
            o = run.outcomes.get(spec)
            return o is not None and (o.failures or len(o.ranks_ok) + len(o.skips) == np)

        done = [s for s in pending if finished(s)]
        if rc == 0 and not timed_out:
            for s in pending:
                if s not in done:
                    run.not_run[s] = "no result reported although the launch succeeded"
            break
        # The launch ended early: blame the first function without a full result.
        tail = "\n".join((err.splitlines() + out.splitlines())[-80:])
        culprit = next((s for s in pending if s not in done), None)
        if culprit is not None:
            why = "timed out" if timed_out else f"the launch exited with {rc}"
            run.outcomes.setdefault(culprit, Outcome()).failures[-1] = (
                f"{why} while running it (started on ranks "
                f"{sorted(started.get(culprit, ()))}); output tail:\n{tail}")
            done.append(culprit)
        remaining = [s for s in pending if s not in done]
        if len(remaining) == len(pending):  # no progress: give up on the rest
            for s in remaining:
                run.not_run[s] = f"launch failed without progress:\n{tail}"
            break
        pending = remaining
    run.wall_s = time.monotonic() - t0
    return run
