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


def test_transform_runs_on_the_gpu_spark_gave_the_task(gpus, monkeypatch):
    """TorchModel.transform's device: the task's GPU (its index among the visible ones,
    modulo what torch sees), the CPU with use_gpu=False."""
    from spark_hvd.estimators import torch_model
    monkeypatch.setattr(torch_model, "task_gpu_index", lambda: 3)
    assert torch_model._task_device(None) == torch.device("cuda", 1)
    assert torch_model._task_device(True) == torch.device("cuda", 1)
    assert torch_model._task_device(False) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert torch_model._task_device(None) == torch.device("cpu")
    with pytest.raises(RuntimeError, match="use_gpu=True but torch sees no CUDA device"):
        torch_model._task_device(True)


@pytest.mark.parametrize("visible, address, index", [
    ("3,5", "5", 1), ("3, 5", "3", 0), ("", "2", 2), ("0,1", "7", 7)])
def test_task_gpu_index_is_the_address_among_the_visible_devices(monkeypatch, visible,
                                                                 address, index):
    pyspark = pytest.importorskip("pyspark")
    from spark_hvd.estimators._model_base import task_gpu_index
    task = types.SimpleNamespace(
        resources=lambda: {"gpu": types.SimpleNamespace(addresses=[address])})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(pyspark.TaskContext, "get", staticmethod(lambda: task))
    assert task_gpu_index() == index
    monkeypatch.setattr(pyspark.TaskContext, "get", staticmethod(lambda: None))
    assert task_gpu_index() == 0  # outside a task
