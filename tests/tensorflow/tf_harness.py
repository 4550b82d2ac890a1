"""tests/tensorflow's rank modules, run in N ranks by the shared machinery (tests/_ranks.py).

A rank module (``rank_*.py``) defines ``check_*`` functions. ``run_module`` launches one
job of N ranks that imports TensorFlow once per rank and runs every check in order
(``tf_rank_entry.py``); the pytest side turns each check into its own test (pass, fail
with every rank's traceback, or skip) with ``run.check(f"{module}::{fn}")``.

A check issues the same collectives in the same order on every rank and asserts at
the end: an AssertionError leaves the ranks in step, so the next checks still run; any
other error ends the rank (its peers may be blocked in a collective it will never
join), and the launch is resumed after it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from typing import List, Tuple

import pytest

import _ranks

HERE = os.path.dirname(os.path.abspath(__file__))
ENTRY = os.path.join(HERE, "tf_rank_entry.py")
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}

# Checked without importing TensorFlow here: only the ranks import it.
needs_tensorflow = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None,
    reason="tensorflow/keras not installed")


def functions(module: str) -> List[str]:
    """The module's check_* functions in file order (parsed, not imported: no TF here)."""
    return _ranks.functions(os.path.join(HERE, module))


@functools.lru_cache(maxsize=None)
def run_module(module: str, np: int, timeout: float = 240,
               also: Tuple[str, ...] = ()) -> _ranks.ChecksRun:
    """Launches the module's job once per (module, np, also) in this pytest session; the
    modules in ``also`` run in the same launch, after it."""
    specs = [spec for m in (module, *also) for spec in _ranks.specs(HERE, m)]
    return _ranks.run_checks_job([sys.executable, ENTRY], specs, np, timeout=timeout,
                                 env=TF_ENV)
