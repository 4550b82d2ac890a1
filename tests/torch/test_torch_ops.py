"""Collectives on torch tensors, every dtype and op, at 1, 2 and 3 ranks (rank_ops.py)."""

import pytest

import torch_harness


@pytest.mark.parametrize("spec", torch_harness.specs("rank_ops.py"))
def test_torch_op(ranks, spec):
    ranks.check(spec)
