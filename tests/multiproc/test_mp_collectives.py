"""The op matrix (cases_collectives.py) on 1, 2 and 3 ranks on the default backend (shm:
every rank is on this host; at 3 ranks with slots of 40000 bytes, so that most ops take
several rounds), its ops (not the other cases) at 4, on tcp at 3, on tcp and shm at 6
(the log-depth algorithms), under ``--mpi`` on 2, and on Gloo's pairs and algorithms
(SPARK_HVD_CPU_OPERATIONS=gloo) on 3.

One job per rank count and backend runs every case; each case is its own test item here.
"""

import pytest

import cases_collectives
from _ranks import have_mpirun

NAMES = cases_collectives.CASES.names()
# Under --mpi and the gloo data plane: the op matrix proper (every op x every dtype, join,
# fusion, cache).
MPI_PATTERN = r"^(allreduce|allgather|broadcast|alltoall|reducescatter|grouped_allreduce|join|" \
              r"barrier|fusion|cache|process_set|topology)"
MPI_NAMES = cases_collectives.CASES.names(MPI_PATTERN)
# On tcp, and on shm at 4 ranks: the same and the reduction order (tcp's bits are shm's,
# checked by both).
OPS_PATTERN = MPI_PATTERN[:-1] + "|order)"
OPS_NAMES = cases_collectives.CASES.names(OPS_PATTERN)


@pytest.mark.parametrize("np", [1, 2, 3])
@pytest.mark.parametrize("case", NAMES)
def test_case(case_runs, case, np):
    env = {"SPARK_HVD_SHM_SLOT_BYTES": "40000"} if np == 3 else None
    case_runs.get("cases_collectives", np, env=env).check(case)


@pytest.mark.parametrize("case", OPS_NAMES)
def test_case_4_ranks(case_runs, case):
    case_runs.get("cases_collectives", 4, pattern=OPS_PATTERN).check(case)


@pytest.mark.parametrize("case", OPS_NAMES)
def test_case_tcp(case_runs, case):
    case_runs.get("cases_collectives", 3, env={"SPARK_HVD_CPU_OPERATIONS": "tcp"},
                  pattern=OPS_PATTERN).check(case)


# Above host_reduce.h's kDirectMaxRanks (4) every collective but alltoall takes log2(n)
# rounds (recursive doubling, Bruck's allgather, a binomial broadcast) and small
# allreduces reduce in the pairwise order; 6 ranks: a power of two (4) and 2 folded in.
@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("case", OPS_NAMES)
def test_case_log_depth(case_runs, case, backend):
    case_runs.get("cases_collectives", 6, env={"SPARK_HVD_CPU_OPERATIONS": backend},
                  pattern=OPS_PATTERN).check(case)


# Above 8 ranks, allreduces whose ring steps would be small run recursive halving and
# doubling in the pairwise order (tcp) and shm reduces in that order too; 9 ranks: 8 and 1
# folded in. The allreduce and order cases only (a 9-rank job of every case is long).
HALVING_PATTERN = r"^(allreduce|order|reducescatter)"


@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("case", cases_collectives.CASES.names(HALVING_PATTERN))
def test_case_halving(case_runs, case, backend):
    case_runs.get("cases_collectives", 9, env={"SPARK_HVD_CPU_OPERATIONS": backend},
                  pattern=HALVING_PATTERN).check(case)


@pytest.mark.skipif(not have_mpirun(), reason="mpirun not on PATH (apt-get install openmpi-bin)")
@pytest.mark.parametrize("case", MPI_NAMES)
def test_case_mpi(case_runs, case):
    case_runs.get("cases_collectives", 2, mpi=True, pattern=MPI_PATTERN).check(case)


@pytest.mark.parametrize("case", MPI_NAMES)
def test_case_gloo_data_plane(case_runs, case):
    case_runs.get("cases_collectives", 3, env={"SPARK_HVD_CPU_OPERATIONS": "gloo"},
                  pattern=MPI_PATTERN).check(case)
