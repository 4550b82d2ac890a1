"""spark_hvd.mxnet at 1, 2 and 3 ranks: the op matrix against the numpy path, MXNet's
engine order, zero-copy, errors, broadcast_parameters, DistributedTrainer and
DistributedOptimizer (rank_mxnet.py; one launch per rank count)."""

import pytest

import mxnet_harness


@pytest.mark.parametrize("spec", mxnet_harness.specs("rank_mxnet.py"))
def test_mxnet(mx_ranks, spec):
    mx_ranks.check(spec)
