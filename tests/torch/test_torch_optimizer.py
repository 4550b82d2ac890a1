"""DistributedOptimizer and broadcast_* against single-process training (rank_optimizer.py)."""

import pytest

import torch_harness


@pytest.mark.parametrize("spec", torch_harness.specs("rank_optimizer.py"))
def test_torch_optimizer(ranks, spec):
    ranks.check(spec)
