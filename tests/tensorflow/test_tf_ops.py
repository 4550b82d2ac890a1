"""Collectives on tf tensors at 1 and 2 ranks (rank checks in rank_ops.py), and the host
functions they fall back to at 2 ranks (rank_host.py, SPARK_HVD_TF_KERNELS=host)."""

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


HOST = "rank_host.py"


@pytest.mark.parametrize("fn", tf_harness.functions(HOST))
def test_host_functions(fn):
    tf_harness.run_module(HOST, np=2, env=(("SPARK_HVD_TF_KERNELS", "host"),)).check(
        f"{HOST}::{fn}")
