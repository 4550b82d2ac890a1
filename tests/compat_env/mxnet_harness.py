"""tests/compat_env's rank functions (``rank_*.py``, not collected by pytest) run in N ranks
by the shared machinery (tests/_ranks.py): one spark-hvdrun launch runs many of them."""

from __future__ import annotations

import os
import sys
from typing import List, Optional

import _ranks

HERE = os.path.dirname(os.path.abspath(__file__))
ENTRY = os.path.join(HERE, "rank_entry.py")
LAUNCH_TIMEOUT_S = 240


def specs(*module_files: str) -> List[str]:
    return _ranks.specs(HERE, *module_files)


def run_specs(todo: List[str], np: int, timeout: float = LAUNCH_TIMEOUT_S,
              env: Optional[dict] = None) -> _ranks.ChecksRun:
    env = dict({"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1"}, **(env or {}))
    return _ranks.run_checks_job([sys.executable, ENTRY], todo, np, timeout=timeout, env=env)
