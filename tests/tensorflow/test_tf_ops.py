"""Collectives on tf tensors at 1 and 2 ranks (rank checks in rank_ops.py)."""

import pytest

import tf_harness

pytestmark = tf_harness.needs_tensorflow

MODULE = "rank_ops.py"


@pytest.fixture(scope="module", params=[1, 2], ids=lambda n: f"np{n}")
def ranks(request):
    return tf_harness.run_module(MODULE, np=request.param)


@pytest.mark.parametrize("fn", tf_harness.functions(MODULE))
def test_rank_check(ranks, fn):
    ranks.check(f"{MODULE}::{fn}")
