"""SyncBatchNorm equals BatchNorm on the concatenated batch (rank_sync_bn.py)."""

import pytest

import torch_harness


@pytest.mark.parametrize("spec", torch_harness.specs("rank_sync_bn.py"))
def test_torch_sync_batch_norm(ranks, spec):
    ranks.check(spec)
