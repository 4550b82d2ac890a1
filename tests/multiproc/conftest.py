"""Fixtures of tests/multiproc: one launched job per (case module, ranks, mode, env)."""

import shutil

import pytest

from harness import CaseRun


class _Runs:
    def __init__(self) -> None:
        self._runs = {}

    def get(self, module: str, np: int, *, mpi: bool = False, env=None, pattern=None,
            timeout: float = 240) -> CaseRun:
        key = (module, np, mpi, tuple(sorted((env or {}).items())), pattern)
        if key not in self._runs:
            self._runs[key] = CaseRun(module, np, mpi=mpi, env=env, pattern=pattern,
                                      timeout=timeout)
        return self._runs[key]

    def cleanup(self) -> None:
        for run in self._runs.values():
            shutil.rmtree(run.outdir, ignore_errors=True)


@pytest.fixture(scope="session")
def case_runs():
    """Launches each case job the first time a test asks for it, then reuses its results."""
    runs = _Runs()
    yield runs
    runs.cleanup()
