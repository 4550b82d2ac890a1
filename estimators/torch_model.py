"""TorchModel: the fitted model of TorchEstimator, a pyspark.ml Model.

``transform(df)`` is the UDF of ``_model_base`` (an Arrow UDF, or a pandas UDF before pyspark
4.1; explicit output schema, feature columns only, ``inference_batch_size`` rows per model
call, the model cached per Python worker); here are its torch parts:

* the model travels cloudpickled (moved to the CPU first: executors may have no such device)
  and runs under ``torch.inference_mode``;
* Device: the GPU Spark assigned to the task (``TaskContext.resources()['gpu']``, mapped
  through CUDA_VISIBLE_DEVICES) when torch sees CUDA, else the first visible GPU, else the
  CPU; ``use_gpu=False`` forces the CPU, ``use_gpu=True`` makes a missing GPU an error.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional

import numpy as np

from ._model_base import (MODEL_CACHE, ArrowModel, Run, chunks, default_output_cols,
                          task_cpus, task_gpu_index)
from .params import MODEL_PARAMS, declare_params


class TorchModel(ArrowModel):
    """A trained torch model as a Spark ML Model (see the module docstring)."""

    def _model_bytes(self, model: Any) -> bytes:
        import cloudpickle
        from . import _trainer_torch as trainer
        return cloudpickle.dumps(trainer.on_cpu(model))

    def _float32(self, model: Any) -> bool:
        import torch
        from . import _trainer_torch as trainer
        return trainer.model_float_dtype(model) in (torch.float32, torch.float16,
                                                    torch.bfloat16)

    def _zero_run(self, model: Any, zeros: List[np.ndarray]) -> List[List[int]]:
        import torch
        from . import _trainer_torch as trainer
        features = self.getFeatureCols()
        dtype = trainer.model_float_dtype(model)
        device = next((t.device for t in model.parameters()), torch.device("cpu"))
        input_shapes = self.getOrDefault(self.input_shapes) or [None] * len(features)
        inputs = [trainer.to_tensor(z, c, dtype, input_shapes[i], device)
                  for i, (c, z) in enumerate(zip(features, zeros))]
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                outs = trainer.as_outputs(model(*inputs))
        finally:
            model.train(was_training)
        return [list(o.shape[1:]) for o in outs]

    def _predictor(self, blob: bytes, key: str) -> Callable[[], Run]:
        return functools.partial(_open_predictor, blob, key, self.getFeatureCols(),
                                 self.getOrDefault(self.input_shapes),
                                 self.getOrDefault(self.use_gpu))


declare_params(TorchModel, MODEL_PARAMS)


# -- executor side ---------------------------------------------------------------------------

def _cached_model(blob: bytes, key: str, device: Any) -> Any:
    """The model of ``blob`` on ``device``, unpickled once per Python worker."""
    def load() -> Any:
        import cloudpickle
        model = cloudpickle.loads(blob).to(device)
        model.eval()
        return model
    return MODEL_CACHE.get(("torch", key, str(device)), load)


def _task_device(use_gpu: Optional[bool]) -> Any:
    """The torch device for this task (see the module docstring)."""
    import torch
    if use_gpu is False:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if use_gpu:
            raise RuntimeError("use_gpu=True but torch sees no CUDA device on this executor; "
                               "use use_gpu=None or False")
        return torch.device("cpu")
    return torch.device("cuda", task_gpu_index() % torch.cuda.device_count())


def _open_predictor(blob: bytes, key: str, names: List[str],
                    input_shapes: Optional[List[List[int]]], use_gpu: Optional[bool]) -> Run:
    import torch
    from . import _trainer_torch as trainer

    cpus = task_cpus()
    if cpus > 0 and torch.get_num_threads() != cpus:
        torch.set_num_threads(cpus)
    device = _task_device(use_gpu)
    model = _cached_model(blob, key, device)
    dtype = trainer.model_float_dtype(model)

    def run(arrays: List[np.ndarray], batch_rows: int) -> List[np.ndarray]:
        rows = len(arrays[0])
        outs: List[np.ndarray] = []
        with torch.inference_mode():
            # The whole Arrow batch as tensors once (no copy on the CPU, one to a GPU).
            inputs = [trainer.to_tensor(a, nm, dtype, input_shapes[j] if input_shapes else None,
                                        device)
                      for j, (a, nm) in enumerate(zip(arrays, names))]
            for start, stop in chunks(rows, batch_rows):
                got = trainer.as_outputs(model(*[t[start:stop] for t in inputs]))
                if not outs:
                    outs = [np.empty((rows, o[0].numel()), np.float64) for o in got]
                for k, o in enumerate(got):  # into the batch's float64 array, converted
                    torch.from_numpy(outs[k][start:stop]).copy_(o.reshape(stop - start, -1))
        return outs
    return run


__all__ = ["TorchModel", "default_output_cols"]
