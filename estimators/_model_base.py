"""What TorchModel and KerasModel share: the Spark ML side of ``transform``.

``transform(df)`` appends one column per model output and runs the model on the executors:

* The output schema is explicit: the input's fields plus, per output, ``double`` when a row's
  output is a single number and a (dense) ``Vector`` otherwise.  The per-row output shapes
  are known from the dry run at fit time (``output_shapes``), or from running the model on
  zero rows here on the driver: no Spark job is needed to find the schema.
* The model runs in a UDF on the feature columns only (Vectors turned into arrays in the
  JVM, a dense Vector's values taken as they are stored and packed as one binary per row
  where the session allows: ``_predict_udf.VectorColumns``): the other columns never leave
  the JVM, and Arrow hands the feature arrays to numpy without a per-row Python loop.
  Which UDF is what the session offers (``_predict_udf.py``): a scalar-iterator Arrow UDF
  (``arrow_udf``, pyspark >= 4.1), else a scalar-iterator pandas UDF over the same Arrow
  batches (pyspark 3.5 and 4.0); the same batches, the same model calls, the same values.
  (Handing the Vector column itself to the UDF, as Spark's struct of type, size, indices
  and values, and making the array in numpy was measured 6x slower in bench/transform.py,
  pyspark 4.3.)  Not ``mapInPandas``:
  it must ship every column to Python and back, and cannot pass a Vector column through at
  all (pyspark 4.3: the UDT serializer gets dicts back and fails); ``mapInArrow`` passes
  Vectors but, shipping every column both ways, was measured 3x slower than
  ``predict_batch_udf`` here, where the Arrow UDF is faster (see bench/transform.py).
* Each Arrow batch (``spark.sql.execution.arrow.maxRecordsPerBatch`` rows) becomes the
  framework's input once (Arrow -> numpy -> tensor without a copy on the CPU), is cut into
  ``inference_batch_size`` rows per model call, and each call's outputs are written into
  one float64 array of the batch, converted on the way: no per-call conversion, no
  concatenation.
* The model travels as bytes with the function (pyspark broadcasts a function over 1 MiB by
  itself) and is loaded once per Python worker and device: :data:`MODEL_CACHE`, keyed by the
  sha256 of the bytes (Spark reuses Python workers, so later tasks and later transforms of
  the same model find it there).  Once a model is loaded in a task, what the worker holds
  is frozen out of the cyclic GC (:func:`freeze_worker_heap`): pyspark's daemon runs a
  full ``gc.collect()`` after every task, which otherwise walks the framework's objects
  each time; and the zips on its ``sys.path`` keep their directories across tasks
  (:func:`steady_zip_imports`: pyspark 3.5 and 4.0 have each task's start re-read them).

A framework's model class provides ``_model_bytes`` (the model as bytes), ``_float32``
(feed Vectors as float32), ``_zero_run`` (output shapes of a zero batch, for a model without
``output_shapes``) and ``_predictor`` (a picklable ``open() -> run(arrays, batch_rows) ->
outputs``: the model on one Arrow batch, ``batch_rows`` rows per call).
"""

from __future__ import annotations

import gc
import hashlib
import os
import sys
import threading
import zipimport
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from pyspark.ml import Model
from pyspark.ml.util import MLReadable, MLWritable

from spark_hvd.exceptions import InvalidArgumentError

from . import _predict_udf
from ._predict_udf import Run
from .params import ParamsFromTable
from .persistence import TableParamsReader, TableParamsWriter

_CACHE_SIZE = 4


def chunks(rows: int, batch_rows: int) -> Iterator[Tuple[int, int]]:
    """``(start, stop)`` of each model call on ``rows`` rows."""
    for start in range(0, rows, batch_rows):
        yield start, min(rows, start + batch_rows)


def default_output_cols(label_cols: Sequence[str], n_outputs: int = 1) -> List[str]:
    """``<label>__output`` per label column; ``prediction`` (``prediction_1``...) without."""
    if label_cols:
        return [f"{c}__output" for c in label_cols]
    return ["prediction"] + [f"prediction_{i}" for i in range(1, n_outputs)]


class ArrowModel(ParamsFromTable, Model, MLWritable, MLReadable):
    """A trained model as a Spark ML Model (see the module docstring)."""

    #: Where the ``fit`` that returned this model spent its time: seconds by phase
    #: (``checks``, ``data``, ``launch``, ``training``, ``checkpoints``, ``MLflow``) and
    #: ``total``; None for a model not returned by ``fit`` (loaded, or made by hand).
    fit_seconds: Optional[Dict[str, float]] = None

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    # Horovod's names.
    def getFeatureColumns(self) -> List[str]:
        return self.getFeatureCols()

    def getLabelColumns(self) -> Optional[List[str]]:
        return self.getLabelCols()

    def getOutputCols(self) -> List[str]:
        """The prediction column names (the default ones when ``output_cols`` is unset)."""
        cols = self.getOrDefault(self.output_cols)
        if cols:
            return list(cols)
        shapes = self.getOrDefault(self.output_shapes)
        return default_output_cols(self.getLabelCols() or [], len(shapes) if shapes else 1)

    # -- persistence -----------------------------------------------------------------------
    def write(self) -> TableParamsWriter:
        return TableParamsWriter(self)

    @classmethod
    def read(cls) -> TableParamsReader:
        return TableParamsReader(cls)

    # -- framework hooks -------------------------------------------------------------------
    def _model_bytes(self, model: Any) -> bytes:
        raise NotImplementedError

    def _float32(self, model: Any) -> bool:
        raise NotImplementedError

    def _zero_run(self, model: Any, zeros: List[np.ndarray]) -> List[List[int]]:
        raise NotImplementedError

    def _predictor(self, blob: bytes, key: str) -> Callable[[], Run]:
        raise NotImplementedError

    # -- transform -------------------------------------------------------------------------
    def _transform(self, dataset: Any) -> Any:
        return self._transform_with(dataset)

    def _transform_with(self, dataset: Any, udf_kind: Optional[str] = None) -> Any:
        """``transform`` through the UDF of ``udf_kind`` (``arrow`` or ``pandas``, see
        ``_predict_udf.py``); by default the one this pyspark offers."""
        name = type(self).__name__
        model = self.getModel()
        if model is None:
            raise InvalidArgumentError(f"this {name} has no model: set model=...")
        features = self.getFeatureCols()
        if not features:
            raise InvalidArgumentError(f"this {name} has no feature_cols")
        fields = {f.name: f.dataType for f in dataset.schema.fields}
        missing = [c for c in features if c not in fields]
        if missing:
            from ._validate import _suggest
            raise InvalidArgumentError(
                "feature column(s) " + ", ".join(f"'{c}'{_suggest(c, list(fields))}"
                                                 for c in missing)
                + f" not in the DataFrame; its columns are {list(fields)}")
        output_shapes = self.getOrDefault(self.output_shapes) or self._infer_output_shapes(
            dataset, model)
        out_cols = self.getOutputCols()
        if len(out_cols) != len(output_shapes):
            raise InvalidArgumentError(
                f"output_cols {out_cols} has {len(out_cols)} name(s) but the model returns "
                f"{len(output_shapes)} output(s)")
        clash = [c for c in out_cols if c in fields]
        if clash:
            raise InvalidArgumentError(
                f"output column(s) {clash} already exist in the DataFrame; set output_cols to "
                f"other names (model.setOutputCols([...])) or drop them first")

        dtype = "float32" if self._float32(model) else "float64"
        vectors = _predict_udf.VectorColumns(dataset)
        # Vectors go as their values' bytes where the session can pack them, else as arrays.
        inputs, packed = zip(*[vectors.model_input(_col(c), dtype) if _is_vector(fields[c])
                               else (_col(c), None) for c in features])
        # Vectors never give nulls (vector_to_array fails on a null Vector in the JVM).
        schema = {f.name: f for f in dataset.schema.fields}
        checked = [None if _is_vector(fields[c]) else schema[c] for c in features]
        blob = self._model_bytes(model)
        return _predict_udf.add_predictions(
            dataset, list(inputs), checked, self._predictor(blob, hashlib.sha256(blob).hexdigest()),
            features, output_shapes, out_cols, self.getInferenceBatchSize(),
            where=f" ({name}.transform)", kind=udf_kind, vectors=vectors,
            packed=list(packed))

    def _infer_output_shapes(self, dataset: Any, model: Any) -> List[List[int]]:
        """Output shapes from a dry run on zero rows (no Spark job): needs feature shapes."""
        shapes = self.getOrDefault(self.feature_shapes)
        features = self.getFeatureCols()
        if shapes is None:
            shapes = []
            for c in features:
                dt = dataset.schema[c].dataType
                size = _vector_size(dataset.schema[c])
                if _is_vector(dt) and size is not None:
                    shapes.append([size])
                elif not _is_vector(dt) and not hasattr(dt, "elementType"):
                    shapes.append([])
                else:
                    raise InvalidArgumentError(
                        f"cannot tell the per-row shape of feature column '{c}' without "
                        f"reading data: set feature_shapes=[[...], ...] (e.g. [[64]]) or "
                        f"output_shapes on this {type(self).__name__}")
        return self._zero_run(model, [np.zeros([2] + list(s), np.float64) for s in shapes])


# -- helpers -------------------------------------------------------------------------------

def _col(name: str) -> Any:
    from pyspark.sql import functions as F
    return F.col("`" + name.replace("`", "``") + "`")


def _is_vector(dt: Any) -> bool:
    return type(dt).__name__ == "VectorUDT"


def _vector_size(field: Any) -> Optional[int]:
    """The size VectorAssembler records in the column's ``ml_attr`` metadata, if any."""
    attr = (field.metadata or {}).get("ml_attr", {})
    n = attr.get("num_attrs")
    return int(n) if isinstance(n, int) else None


def in_spark_task() -> bool:
    from pyspark import TaskContext
    return TaskContext.get() is not None


def freeze_worker_heap() -> None:
    """In a Spark task's Python worker, after a model is loaded: collect, then
    ``gc.freeze()`` every object left, so that the full ``gc.collect()`` pyspark's daemon
    runs after each task of a reused worker walks only what later tasks make.  Measured
    (2026-12-06, this machine): 0.09 s per collection with torch imported (220,000 tracked
    objects), 0.18 s with TensorFlow and Keras (420,000), against 0.02 s with pyspark and
    pandas alone; in bench/transform.py's profile on pyspark 3.5 it was more of a worker's
    time than the whole UDF.  Frozen objects are still freed by reference counting; one
    left in a reference cycle would stay, so the freeze is undone before each collection
    here (a model dropped from the cache since is collected then).  Nothing outside a task
    (the driver) is frozen."""
    if not in_spark_task():
        return
    gc.unfreeze()
    gc.collect()
    gc.freeze()


class SteadyZipImporter(zipimport.zipimporter):
    """Python's importer of a zip on ``sys.path``, except that ``invalidate_caches()`` reads
    the archive's directory again only when the file changed (its size, mtime or inode)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._seen = _file_stamp(self.archive)

    def invalidate_caches(self) -> None:
        stamp = _file_stamp(self.archive)
        if stamp is None or stamp != self._seen:
            self._seen = stamp
            super().invalidate_caches()


def _file_stamp(path: str) -> Optional[Tuple[int, int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def steady_zip_imports() -> None:
    """In a Spark task's Python worker: each zip on ``sys.path`` (pyspark.zip, py4j's) gets
    a :class:`SteadyZipImporter`.  pyspark 3.5 and 4.0 call ``importlib.invalidate_caches()``
    at the start of every task, and Python's zip importer answers it by parsing the
    archive's whole directory again (pyspark.zip: 2.4-4 MB): in bench/transform.py's
    profile on pyspark 4.0 (2026-12-06) that was 57 % of a Python worker's busy time, ~0.05 s
    per task.  pyspark >= 4.1 invalidates only when a task adds to ``sys.path``."""
    if not in_spark_task():
        return
    for path, finder in list(sys.path_importer_cache.items()):
        if type(finder) is zipimport.zipimporter:
            try:
                sys.path_importer_cache[path] = SteadyZipImporter(path)
            except zipimport.ZipImportError:
                pass


def settle_worker() -> None:
    """What a task's Python worker is given after a model load: :func:`freeze_worker_heap`
    and :func:`steady_zip_imports`."""
    freeze_worker_heap()
    steady_zip_imports()


class ModelCache:
    """Models loaded in this Python worker, least recently used dropped beyond ``size``;
    ``after_load`` runs after each load (:func:`settle_worker`)."""

    def __init__(self, size: int = _CACHE_SIZE,
                 after_load: Callable[[], None] = settle_worker) -> None:
        self.size = size
        self.models: "OrderedDict[Any, Any]" = OrderedDict()
        self.lock = threading.Lock()
        self.after_load = after_load

    def get(self, key: Any, load: Callable[[], Any]) -> Any:
        with self.lock:
            model = self.models.get(key)
            if model is not None:
                self.models.move_to_end(key)
                return model
        model = load()
        with self.lock:
            self.models[key] = model
            while len(self.models) > self.size:
                self.models.popitem(last=False)
        self.after_load()
        return model

    def clear(self) -> None:
        with self.lock:
            self.models.clear()


MODEL_CACHE = ModelCache()


def task_gpu_index() -> int:
    """The index (among the visible devices) of the GPU Spark assigned to this task, else 0."""
    try:
        from pyspark import TaskContext
        ctx = TaskContext.get()
        gpus = ctx.resources().get("gpu") if ctx is not None else None
        if gpus is not None and gpus.addresses:
            address = gpus.addresses[0]
            visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
                       if v.strip()]
            return visible.index(address) if address in visible else int(address)
    except (ValueError, AttributeError):
        pass
    return 0


def task_cpus() -> int:
    """``spark.task.cpus`` of this task (0 outside a task)."""
    try:
        from pyspark import TaskContext
        ctx = TaskContext.get()
        return int(ctx.cpus()) if ctx is not None else 0
    except Exception:
        return 0
