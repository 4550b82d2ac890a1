"""tests/torch's rank modules, run in N ranks by the shared machinery (tests/_ranks.py).

A rank module (``rank_*.py`` here, not collected by pytest) defines functions
``check_<what>()``; each runs on every rank after ``hvd.init()`` (rank_entry.py) and
raises to fail (an exception class named ``Skip`` skips it, with its message). One
launch runs many functions (``FILE::FN`` specs, in order), which keeps the per-launch
cost (interpreter, torch import, rendezvous: seconds on a loaded 2-core box) off each
test. Any failure ends the rank; the launch is then resumed after it.

    run = run_specs(specs("rank_ops.py"), np=2)
    run.check("rank_ops.py::check_allreduce_every_dtype_op_shape")
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

import _ranks

HERE = os.path.dirname(os.path.abspath(__file__))
ENTRY = os.path.join(HERE, "rank_entry.py")
LAUNCH_TIMEOUT_S = 240
RANK_MODULES = ["rank_ops.py", "rank_optimizer.py", "rank_compile_amp.py", "rank_sync_bn.py",
                "rank_lightning.py"]


def specs(*module_files: str) -> List[str]:
    return _ranks.specs(HERE, *module_files)


def run_specs(todo: List[str], np: int, timeout: float = LAUNCH_TIMEOUT_S,
              env: Optional[dict] = None) -> _ranks.ChecksRun:
    """Runs ``FILE::FN`` specs in ``np`` ranks (relaunching after a failure)."""
    env = dict({"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}, **(env or {}))
    return _ranks.run_checks_job([sys.executable, ENTRY], todo, np, timeout=timeout, env=env)
