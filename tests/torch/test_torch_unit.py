"""spark_hvd.torch pieces that need no running job: checks, compression, optimizer
argument handling."""

import pickle

import pytest
import torch
from torch import nn

from spark_hvd import cuda_built as hvd_cuda_built
from spark_hvd.torch import _tensors
from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.torch._tensors import check, from_result
from spark_hvd.torch.compression import Compression
from spark_hvd.torch.optimizer import GradientsPendingError, _make_groups, _parameter_names

from rank_ops import FakeCuda  # a CPU tensor that says it is on cuda:0


def test_check_refuses_cuda_with_the_fix(monkeypatch):
    monkeypatch.setattr(_tensors, "_gpu_operations", lambda: False)
    t = torch.Tensor._make_subclass(FakeCuda, torch.ones(2))
    with pytest.raises(InvalidArgumentError) as info:
        check(t, "allreduce")
    msg = str(info.value)
    assert "cuda:0" in msg and "cuda_built() is False" in msg and "tensor.cpu()" in msg
    assert "SPARK_HVD_CUDA_LIBRARY" in msg


def test_check_takes_cuda_where_the_cuda_runtime_loads_even_without_nccl(monkeypatch):
    """NCCL missing but the CUDA runtime loading: the core stages GPU tensors through
    host memory (the staged backend), so the tensor goes to the core."""
    import spark_hvd._basics as basics
    monkeypatch.setattr(basics, "cuda_built", lambda: True)
    monkeypatch.setattr(basics, "nccl_built", lambda: False)
    _tensors._gpu_operations.cache_clear()
    try:
        t = torch.Tensor._make_subclass(FakeCuda, torch.ones(2))
        assert check(t, "allreduce").device.type == "cuda"
    finally:
        _tensors._gpu_operations.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available() or hvd_cuda_built(),
                    reason="needs a CUDA device where spark_hvd cannot load the CUDA runtime")
def test_check_refuses_real_cuda_tensor():
    with pytest.raises(InvalidArgumentError, match="cuda_built"):
        check(torch.ones(2, device="cuda"), "allreduce")


@pytest.mark.parametrize("bad, words", [
    (torch.ones(2, device="meta"), "CPU and CUDA tensors"),
    (torch.ones(2, dtype=torch.complex64), "complex64"),
    (torch.ones(2).to_sparse(), "sparse"),
    (torch.ones(2, dtype=torch.float64).numpy(), "torch.Tensor"),
])
def test_check_rejects_clearly(bad, words):
    with pytest.raises(InvalidArgumentError, match=words):
        check(bad, "allreduce")


def test_check_detaches():
    x = torch.ones(3, requires_grad=True)
    out = check(x, "allreduce")
    assert not out.requires_grad and out.data_ptr() == x.data_ptr()
    y = torch.ones(3)
    assert check(y, "allreduce") is y  # nothing to detach: no new tensor per op


def test_from_result_views_bytes_as_dtype():
    import numpy as np

    raw = torch.arange(6, dtype=torch.bfloat16).view(torch.uint8).numpy().copy()
    out = from_result((raw, [2, 3], [], 0), torch.bfloat16)
    assert torch.equal(out, torch.arange(6, dtype=torch.bfloat16).reshape(2, 3))
    empty = from_result((np.zeros(0, dtype=np.uint8), [0, 4], [], 0), torch.float32)
    assert empty.shape == (0, 4) and empty.dtype == torch.float32


@pytest.mark.parametrize("comp, wire, tol", [(Compression.fp16, torch.float16, 1e-3),
                                             (Compression.bf16, torch.bfloat16, 1e-2)])
def test_cast_compression_round_trip(comp, wire, tol):
    x = torch.randn(100, dtype=torch.float32)
    sent, ctx = comp.compress(x)
    assert sent.dtype == wire
    back = comp.decompress(sent, ctx)
    assert back.dtype == torch.float32
    assert float(((back - x).abs() / x.abs().clamp_min(1e-3)).max()) < tol
    ints = torch.arange(4)
    sent, ctx = comp.compress(ints)
    assert sent is ints and comp.decompress(sent, ctx) is ints


def test_none_compression_is_identity():
    x = torch.randn(3)
    sent, ctx = Compression.none.compress(x)
    assert sent is x and Compression.none.decompress(sent, ctx) is x


def test_parameter_names_validation():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    groups = [{"params": list(model.parameters())}]
    names = _parameter_names(groups, model.named_parameters())
    assert sorted(names.values()) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert sorted(_parameter_names(groups, None).values())[0] == "allreduce.noname.0.0"
    with pytest.raises(InvalidArgumentError, match="does not name"):
        _parameter_names(groups, list(model.named_parameters())[:2])
    with pytest.raises(InvalidArgumentError, match="unique"):
        _parameter_names(groups, [("w", p) for p in model.parameters()])
    with pytest.raises(InvalidArgumentError, match="pairs"):
        _parameter_names(groups, list(model.parameters()))


def test_make_groups():
    params = [nn.Parameter(torch.ones(1)) for _ in range(5)]
    group_of, groups = _make_groups(params, 2)
    assert [len(g) for g in groups] == [3, 2] and group_of[params[4]] == 1
    group_of, groups = _make_groups(params, [[params[0], params[3]]])
    assert groups == [[params[0], params[3]]] and params[1] not in group_of
    assert _make_groups(params, None) == ({}, [])
    with pytest.raises(InvalidArgumentError, match="more than one group"):
        _make_groups(params, [[params[0]], [params[0]]])
    with pytest.raises(InvalidArgumentError, match="not a trainable"):
        _make_groups(params, [[nn.Parameter(torch.ones(1))]])


def test_gradients_pending_error_pickles():
    err = pickle.loads(pickle.dumps(GradientsPendingError("zero_grad while in flight")))
    assert isinstance(err, RuntimeError) and "in flight" in str(err)
