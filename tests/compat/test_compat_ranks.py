"""Horovod behaviours that need peers, run under spark-hvdrun: rank_compat.py and
rank_compat_optimizer.py (torch) at 2 and 3 ranks through tests/torch's rank entry,
rank_compat_tf.py at 3 ranks through tests/tensorflow's."""

import os
import sys

import pytest

import _ranks

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
# The entries resolve a spec's file against their own directory; an absolute path stays.
ENTRIES = {"torch": os.path.join(TESTS, "torch", "rank_entry.py"),
           "tensorflow": os.path.join(TESTS, "tensorflow", "tf_rank_entry.py")}
MODULES = {"torch": ("rank_compat.py", "rank_compat_optimizer.py"),
           "tensorflow": ("rank_compat_tf.py",)}
SPECS = {fw: _ranks.specs(HERE, *(os.path.join(HERE, m) for m in ms))
         for fw, ms in MODULES.items()}
_RUNS = {}


def _run(framework: str, np: int) -> _ranks.ChecksRun:
    pytest.importorskip(framework)
    if (framework, np) not in _RUNS:
        _RUNS[framework, np] = _ranks.run_checks_job(
            [sys.executable, ENTRIES[framework]], SPECS[framework], np,
            env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    return _RUNS[framework, np]


def _fn(spec: str) -> str:
    return spec.rpartition("::")[2]


@pytest.mark.parametrize("np", [2, 3], ids=lambda n: f"np{n}")
@pytest.mark.parametrize("spec", SPECS["torch"], ids=_fn)
def test_torch(spec, np):
    _run("torch", np).check(spec)


@pytest.mark.parametrize("np", [2, 3], ids=lambda n: f"np{n}")
@pytest.mark.parametrize("spec", SPECS["tensorflow"], ids=_fn)
def test_tensorflow(spec, np):
    _run("tensorflow", np).check(spec)
