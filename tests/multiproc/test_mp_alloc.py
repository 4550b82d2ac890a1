"""No heap allocation per op in steady state on the engine's thread (cases_alloc.py), on
2 ranks over tcp and over shm (this host's default for a job on one host)."""

import pytest

import cases_alloc

NAMES = cases_alloc.CASES.names()


@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("case", NAMES)
def test_case(case_runs, case, backend):
    case_runs.get("cases_alloc", 2, env={"SPARK_HVD_CPU_OPERATIONS": backend}).check(case)
