"""Runs a module of rank checks under spark-hvdrun and reports each check per rank.

A rank module (``rank_*.py``) defines ``check_*`` functions. ``run_module`` launches one
job of N ranks that imports TensorFlow once per rank and runs every check in order
(``tf_rank_entry.py``); each rank prints one ``@@TFTEST {json}`` line per outcome. The
pytest side turns each check into its own test (pass, fail with every rank's
traceback, or skip).

A check issues the same collectives in the same order on every rank and asserts at
the end: an AssertionError leaves the ranks in step, so the next checks still run; any
other error ends the rank (its peers may be blocked in a collective it will never
join), and the checks after it are reported as not reached.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
from typing import Dict, List

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
ENTRY = os.path.join(HERE, "tf_rank_entry.py")
MARK = "@@TFTEST "
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), TF_CPP_MIN_LOG_LEVEL="2")
for _k in list(ENV):
    if _k.startswith("SPARK_HVD_"):  # set by the launcher for its ranks, never inherited
        del ENV[_k]


# Checked without importing TensorFlow here: only the ranks import it.
needs_tensorflow = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None,
    reason="tensorflow/keras not installed")


def functions(module: str) -> List[str]:
    """The module's check_* functions in file order (parsed, not imported: no TF here)."""
    with open(os.path.join(HERE, module)) as f:
        tree = ast.parse(f.read())
    return [n.name for n in tree.body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("check_")]


def hvdrun(np: int, argv: List[str], timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "spark_hvd.runner", "-np", str(np), *argv]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\ntf_harness: the job was killed after {timeout} s (hang)\n"
        return subprocess.CompletedProcess(cmd, -signal.SIGKILL, out, err)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class ModuleRun:
    """Outcomes of one launched job: ``records[fn][rank] -> record``."""

    def __init__(self, module: str, np: int, proc: subprocess.CompletedProcess) -> None:
        self.module, self.np, self.proc = module, np, proc
        self.records: Dict[str, Dict[int, dict]] = {}
        for line in proc.stdout.splitlines():
            head, sep, rest = line.partition("] ")
            if not sep or not rest.startswith(MARK):
                continue
            rec = json.loads(rest[len(MARK):])
            if rec["event"] != "start":
                self.records.setdefault(rec["fn"], {})[rec["rank"]] = rec

    def tail(self, lines: int = 40) -> str:
        text = (self.proc.stdout + "\n" + self.proc.stderr).splitlines()
        return "\n".join(text[-lines:])

    def check(self, fn: str) -> dict:
        """Fails or skips the calling test as the ranks reported ``fn``; returns rank 0's
        record (with its ``result``) when every rank passed."""
        recs = self.records.get(fn, {})
        missing = [r for r in range(self.np) if r not in recs]
        if missing:
            pytest.fail(f"{fn} not reached on ranks {missing} (exit {self.proc.returncode}); "
                        f"output tail:\n{self.tail()}", pytrace=False)
        failed = {r: rec for r, rec in recs.items() if rec["event"] == "fail"}
        if failed:
            pytest.fail("\n".join(f"[rank {r}] {rec['error']}" for r, rec in sorted(
                failed.items())), pytrace=False)
        skipped = [rec for rec in recs.values() if rec["event"] == "skip"]
        if skipped:
            pytest.skip(skipped[0]["reason"])
        return recs[0]


@functools.lru_cache(maxsize=None)
def run_module(module: str, np: int, timeout: float = 240) -> ModuleRun:
    """Launches the module's job once per (module, np) in this pytest session."""
    return ModuleRun(module, np, hvdrun(np, [sys.executable, ENTRY,
                                             os.path.join(HERE, module)], timeout))
