"""DistributedOptimizer with a torch.compile'd model and under autocast with a GradScaler
(rank_compile_amp.py), at 1-3 ranks."""

import pytest

import torch_harness


@pytest.mark.parametrize("spec", torch_harness.specs("rank_compile_amp.py"))
def test_torch_compile_amp(ranks, spec):
    ranks.check(spec)
