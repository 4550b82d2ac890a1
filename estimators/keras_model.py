"""KerasModel: the fitted model of KerasEstimator, a pyspark.ml Model.

``transform(df)`` is the UDF of ``_model_base`` (an Arrow UDF, or a pandas UDF before pyspark
4.1; explicit output schema, feature columns only, ``inference_batch_size`` rows per
``predict_on_batch``, the model cached per Python worker); here are its Keras parts:

* the model travels as the bytes of a ``.keras`` file, loaded on the executor with
  ``custom_objects`` (cloudpickled);
* TensorFlow's threads follow ``spark.task.cpus`` when the worker's TensorFlow has not
  started yet; the model runs on the GPU Spark assigned to the task when TensorFlow sees
  GPUs (``use_gpu=False``: the CPU; ``use_gpu=True``: a missing GPU is an error);
* ``getModel()`` is the keras.Model; Pipeline persistence stores it as ``.keras`` bytes with
  its compile arguments (see ``_keras_io``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional

import numpy as np

from . import _keras_io as keras_io
from ._model_base import MODEL_CACHE, ArrowModel, Run, chunks, task_cpus, task_gpu_index
from .params import KERAS_MODEL_PARAMS, declare_params


class KerasModel(keras_io.KerasParamsMixin, ArrowModel):
    """A trained Keras model as a Spark ML Model (see the module docstring)."""

    def _model_bytes(self, model: Any) -> bytes:
        return keras_io.model_to_bytes(model)

    def _float32(self, model: Any) -> bool:
        from . import _trainer_keras as trainer
        return trainer.model_float_dtype(model) == np.float32

    def _zero_run(self, model: Any, zeros: List[np.ndarray]) -> List[List[int]]:
        from . import _trainer_keras as trainer
        shapes = self.getOrDefault(self.input_shapes)
        dtype = trainer.model_float_dtype(model)
        x = [trainer.to_array(z, dtype, shapes[i] if shapes else None)
             for i, z in enumerate(zeros)]
        outs = trainer.as_outputs(model(x[0] if len(x) == 1 else x, training=False))
        return [list(o.shape[1:]) for o in outs]

    def _predictor(self, blob: bytes, key: str) -> Callable[[], Run]:
        import cloudpickle
        custom = self.getOrDefault(self.custom_objects)
        return functools.partial(_open_predictor, blob, key,
                                 cloudpickle.dumps(custom) if custom else None,
                                 self.getOrDefault(self.input_shapes),
                                 self.getOrDefault(self.use_gpu))


declare_params(KerasModel, KERAS_MODEL_PARAMS)


# -- executor side ---------------------------------------------------------------------------

def _task_device(tf: Any, use_gpu: Optional[bool]) -> str:
    """The TensorFlow device for this task (see the module docstring)."""
    if use_gpu is False:
        return "/CPU:0"
    gpus = tf.config.list_logical_devices("GPU")
    if not gpus:
        if use_gpu:
            raise RuntimeError("use_gpu=True but TensorFlow sees no GPU on this executor; "
                               "use use_gpu=None or False")
        return "/CPU:0"
    return gpus[task_gpu_index() % len(gpus)].name


def _open_predictor(blob: bytes, key: str, custom_blob: Optional[bytes],
                    input_shapes: Optional[List[List[int]]], use_gpu: Optional[bool]) -> Run:
    import tensorflow as tf

    from . import _trainer_keras as trainer

    cpus = task_cpus()
    if cpus > 0:
        try:
            tf.config.threading.set_intra_op_parallelism_threads(cpus)
            tf.config.threading.set_inter_op_parallelism_threads(cpus)
        except RuntimeError:  # this worker's TensorFlow runtime is already up
            pass
    device = _task_device(tf, use_gpu)

    def load() -> Any:
        import cloudpickle
        custom = cloudpickle.loads(custom_blob) if custom_blob else None
        with tf.device(device):
            return keras_io.model_from_bytes(blob, custom)
    model = MODEL_CACHE.get(("keras", key, device), load)
    dtype = trainer.model_float_dtype(model)

    def run(arrays: List[np.ndarray], batch_rows: int) -> List[np.ndarray]:
        rows = len(arrays[0])
        x = [trainer.to_array(a, dtype, input_shapes[j] if input_shapes else None)
             for j, a in enumerate(arrays)]
        outs: List[np.ndarray] = []
        with tf.device(device):
            for start, stop in chunks(rows, batch_rows):
                part = [a[start:stop] for a in x]
                got = trainer.as_outputs(model.predict_on_batch(part[0] if len(part) == 1
                                                                else part))
                if not outs:
                    outs = [np.empty((rows, int(np.prod(np.shape(o)[1:]))), np.float64)
                            for o in got]
                for k, o in enumerate(got):
                    outs[k][start:stop] = np.asarray(o).reshape(stop - start, -1)
        return outs
    return run


__all__ = ["KerasModel"]
