"""Collectives on tf tensors at 1 and 2 ranks (rank checks in rank_ops.py), and the host
functions they fall back to, at 2 ranks in the same launch (rank_host.py)."""

import pytest

import tf_harness

pytestmark = tf_harness.needs_tensorflow

MODULE = "rank_ops.py"
HOST = "rank_host.py"


def _run(np: int):
    return tf_harness.run_module(MODULE, np=np, also=(HOST,) if np == 2 else ())


@pytest.fixture(scope="module", params=[1, 2], ids=lambda n: f"np{n}")
def ranks(request):
    return _run(request.param)


@pytest.mark.parametrize("fn", tf_harness.functions(MODULE))
def test_rank_check(ranks, fn):
    ranks.check(f"{MODULE}::{fn}")


@pytest.mark.parametrize("fn", tf_harness.functions(HOST))
def test_host_functions(fn):
    _run(2).check(f"{HOST}::{fn}")
