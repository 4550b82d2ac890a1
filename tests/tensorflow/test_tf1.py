"""TensorFlow 1 graph mode (tf.compat.v1): DistributedOptimizer on v1 optimizers,
broadcast_global_variables and BroadcastGlobalVariablesHook under MonitoredTrainingSession
(rank checks in rank_tf1.py). Every check holds at any rank count; the default run uses
2 ranks (SPARK_HVD_TF_TEST_NP=1,2,3 runs more)."""

import os

import pytest

import tf_harness

pytestmark = tf_harness.needs_tensorflow

MODULE = "rank_tf1.py"
RANKS = [int(n) for n in os.environ.get("SPARK_HVD_TF_TEST_NP", "2").split(",")]


@pytest.fixture(scope="module", params=RANKS, ids=lambda n: f"np{n}")
def ranks(request):
    return tf_harness.run_module(MODULE, np=request.param)


@pytest.mark.parametrize("fn", tf_harness.functions(MODULE))
def test_rank_check(ranks, fn):
    ranks.check(f"{MODULE}::{fn}")
