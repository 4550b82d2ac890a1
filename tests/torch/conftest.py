"""One spark-hvdrun launch per rank count runs every rank module's functions
(rank_ops, rank_optimizer, rank_compile_amp, rank_sync_bn, rank_lightning); the test
files read their results."""

import pytest

import _ranks
import torch_harness

_RUNS = {}


def ranks_run(np: int) -> _ranks.ChecksRun:
    if np not in _RUNS:
        _RUNS[np] = torch_harness.run_specs(
            torch_harness.specs(*torch_harness.RANK_MODULES), np=np)
    return _RUNS[np]


@pytest.fixture(scope="session", params=[1, 2, 3], ids=lambda n: f"np{n}")
def ranks(request):
    return ranks_run(request.param)
