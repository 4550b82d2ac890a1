"""One rank of a case job: ``python case_worker.py MODULE OUTDIR [PATTERN]``.

Imports the case module (``cases_*.py`` next to this file) and runs its cases
that match PATTERN (a regex; all by default), writing OUTDIR/rank<r>.jsonl.
"""

import importlib
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # the case modules, and tests/_ranks.py

import harness  # noqa: E402

if __name__ == "__main__":
    module = importlib.import_module(sys.argv[1])
    sys.exit(harness.worker_main(module.CASES, sys.argv[2],
                                 sys.argv[3] if len(sys.argv) > 3 else None))
