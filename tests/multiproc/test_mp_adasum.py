"""op=Adasum in the core (cases_adasum.py) at 1, 2, 3 (refused: not a power of two) and 4
ranks on the TCP mesh, and at 2 ranks on Gloo's pairs and under --mpi."""

import pytest

import cases_adasum
from _ranks import have_mpirun

NAMES = cases_adasum.CASES.names()


@pytest.mark.parametrize("np", [1, 2, 3, 4])
@pytest.mark.parametrize("case", NAMES)
def test_case(case_runs, case, np):
    case_runs.get("cases_adasum", np).check(case)


@pytest.mark.parametrize("case", NAMES)
def test_case_gloo_data_plane(case_runs, case):
    case_runs.get("cases_adasum", 2, env={"SPARK_HVD_CPU_OPERATIONS": "gloo"}).check(case)


@pytest.mark.skipif(not have_mpirun(), reason="mpirun not on PATH (apt-get install openmpi-bin)")
@pytest.mark.parametrize("case", NAMES)
def test_case_mpi(case_runs, case):
    case_runs.get("cases_adasum", 2, mpi=True).check(case)
