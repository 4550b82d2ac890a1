"""Where TorchEstimator's trainer puts the model (estimators/_trainer_torch._pick_device):
the task's GPU when torch sees one and spark_hvd can allreduce there (NCCL, or staged
through host memory where only the CUDA runtime loads), else the CPU; use_gpu=True where
that cannot work is a clear error naming the fix."""

import types

import pytest
import torch

from spark_hvd.estimators._trainer_torch import _pick_device


def _hvd(nccl: bool, cuda: bool, local_rank: int = 1):
    return types.SimpleNamespace(nccl_built=lambda: nccl, cuda_built=lambda: cuda,
                                 local_rank=lambda: local_rank)


@pytest.fixture
def gpus(monkeypatch):
    """torch sees 2 GPUs (this torch is a CPU build)."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_no_gpu_means_cpu_unless_asked():
    assert _pick_device(None, _hvd(True, True)) == torch.device("cpu")
    assert _pick_device(False, _hvd(True, True)) == torch.device("cpu")
    with pytest.raises(RuntimeError, match="sees no CUDA device"):
        _pick_device(True, _hvd(True, True))


@pytest.mark.parametrize("nccl, cuda", [(True, True), (False, True)])
def test_gpu_of_the_local_rank_with_nccl_or_staging(gpus, nccl, cuda):
    assert _pick_device(None, _hvd(nccl, cuda, local_rank=3)) == torch.device("cuda", 1)
    assert gpus == [torch.device("cuda", 1)]


def test_gpu_without_any_way_to_allreduce_there(gpus):
    assert _pick_device(None, _hvd(False, False)) == torch.device("cpu")
    with pytest.raises(RuntimeError, match="SPARK_HVD_NCCL_LIBRARY"):
        _pick_device(True, _hvd(False, False))
