"""The estimators' Spark ML Params, generated from one table.

Every Param is a row of :data:`ESTIMATOR_PARAMS` or :data:`MODEL_PARAMS`: a
:class:`ParamSpec` with the name (Horovod's snake_case names, so code written
for ``horovod.spark`` keeps its keyword arguments), the default, a converter
that checks and normalises a value when it is set, how the value is persisted
(``json`` in the Spark ML metadata, or ``pickle`` next to it) and the doc.
:func:`declare_params` turns a table into, for each row, a class attribute
``Param`` and the ``getFooBar``/``setFooBar`` methods, the way Spark generates
its shared params, so none of them is written by hand.

    class MyEstimator(Estimator, ParamsFromTable):
        ...
    declare_params(MyEstimator, ESTIMATOR_PARAMS)

``ParamsFromTable.__init__(**kwargs)`` sets the table's defaults, then the
given keywords (an unknown keyword is an error that suggests the closest name).
"""

from __future__ import annotations

import difflib
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from pyspark.ml.param import Param, Params

from spark_hvd.exceptions import InvalidArgumentError

from .store import Store

JSON = "json"
PICKLE = "pickle"


@dataclass(frozen=True)
class ParamSpec:
    """One row of a Param table (see the module docstring)."""

    name: str
    default: Any
    convert: Callable[[str, Any], Any]
    persist: str
    doc: str


# -- converters: (param name, value) -> normalised value, or InvalidArgumentError ------------

def _any(name: str, value: Any) -> Any:
    return value


def _int_at_least(minimum: int, hint: str = "", allow_none: bool = True
                  ) -> Callable[[str, Any], Optional[int]]:
    """An integer >= ``minimum`` (or None when ``allow_none``); ``hint`` ends the error
    message."""
    def convert(name: str, value: Any) -> Optional[int]:
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
            raise InvalidArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}"
                                       + (f"; {hint}" if hint else ""))
        return int(value)
    return convert


def _bool(name: str, value: Any) -> Optional[bool]:
    if value is None or isinstance(value, bool):
        return value
    raise InvalidArgumentError(f"{name} must be True or False, got {value!r}")


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise InvalidArgumentError(f"{name} must be True or False, got {value!r}")


def _opt_bool(name: str, value: Any) -> Optional[bool]:
    if value is None or isinstance(value, bool):
        return value
    raise InvalidArgumentError(f"{name} must be True, False or None (automatic), got {value!r}")


def _str(name: str, value: Any) -> Optional[str]:
    if value is None or isinstance(value, str) and value:
        return value
    raise InvalidArgumentError(f"{name} must be a non-empty string, got {value!r}")


def _run_id(name: str, value: Any) -> Optional[str]:
    value = _str(name, value)
    if value is not None and (value in (".", "..") or any(c in value for c in "/\\\0")):
        raise InvalidArgumentError(
            f"{name}={value!r} is not usable as a directory name; use letters, digits, '-', "
            f"'_' and '.'")
    return value


def _columns(name: str, value: Any) -> Optional[List[str]]:
    if value is None:
        return None
    cols = [value] if isinstance(value, str) else value
    try:
        cols = list(cols)
    except TypeError:
        cols = [value]
    if not cols or any(not isinstance(c, str) or not c for c in cols):
        raise InvalidArgumentError(
            f"{name} must be a column name or a non-empty list of column names, got {value!r}")
    if len(set(cols)) != len(cols):
        raise InvalidArgumentError(f"{name} names a column twice: {cols}")
    return cols


def _validation(name: str, value: Any) -> Any:
    if value is None or isinstance(value, str) and value:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not 0 <= float(value) < 1:
        raise InvalidArgumentError(
            f"{name} must be a fraction in [0, 1) (e.g. 0.1 keeps 10% of the rows for "
            f"validation) or the name of a boolean/0-1 column, got {value!r}")
    return float(value)


def _store(name: str, value: Any) -> Optional[Store]:
    if value is None or isinstance(value, Store):
        return value
    if isinstance(value, str):
        return Store.create(value)
    raise InvalidArgumentError(
        f"{name} must be a Store (e.g. LocalStore('/tmp/runs')) or a path/URL, got "
        f"{type(value).__name__}")


def _shape(name: str, value: Any) -> Tuple[int, ...]:
    try:
        shape = tuple(value)
    except TypeError:
        shape = ()
        ok = False
    else:
        ok = all(isinstance(d, numbers.Integral) and not isinstance(d, bool)
                 and (d >= 1 or d == -1) for d in shape)
    if not ok or list(shape).count(-1) > 1:
        raise InvalidArgumentError(
            f"{name} must hold shapes such as [-1, 1, 8, 8] (a list of positive ints, at most "
            f"one -1), got {value!r}")
    return tuple(int(d) for d in shape)


def _shapes(name: str, value: Any) -> Optional[List[List[int]]]:
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(d, numbers.Integral) for d in value):
        value = [value]  # one shape given for one column
    if not isinstance(value, (list, tuple)) or not value:
        raise InvalidArgumentError(f"{name} must be a list of shapes, one per column, "
                                   f"got {value!r}")
    return [list(_shape(name, s)) for s in value]


def _floats(name: str, value: Any) -> Optional[List[float]]:
    if value is None:
        return None
    values = [value] if isinstance(value, numbers.Real) else value
    try:
        out = [float(v) for v in values if not isinstance(v, bool)]
    except (TypeError, ValueError):
        out = []
    if not out or len(out) != len(list(values)):
        raise InvalidArgumentError(f"{name} must be a list of numbers, got {value!r}")
    return out


def _callable(name: str, value: Any) -> Any:
    if value is None or callable(value):
        return value
    raise InvalidArgumentError(f"{name} must be callable, got {type(value).__name__}")


def _callables(name: str, value: Any) -> Any:
    """A callable, a list of callables, or (metrics) a dict name -> callable."""
    if value is None:
        return None
    if isinstance(value, dict):
        items = list(value.values())
    elif callable(value):
        return value
    else:
        try:
            items = list(value)
        except TypeError:
            items = [value]
    bad = [v for v in items if not callable(v)]
    if bad:
        raise InvalidArgumentError(
            f"{name} must be callables (e.g. torch.nn.functional.cross_entropy), got "
            f"{[type(b).__name__ for b in bad]}")
    return value if isinstance(value, dict) else list(items)


def _names_or_callables(name: str, value: Any) -> Any:
    """Keras' loss/metrics: a name, a callable, or a list/dict of them (lists nested once)."""
    if value is None or isinstance(value, str) or callable(value):
        return value
    items = list(value.values()) if isinstance(value, dict) else value
    try:
        items = list(items)
    except TypeError:
        items = [items]
    flat = [v for item in items for v in (item if isinstance(item, (list, tuple)) else [item])]
    bad = [v for v in flat if not (v is None or isinstance(v, str) or callable(v))]
    if bad:
        raise InvalidArgumentError(
            f"{name} must be names (e.g. 'accuracy'), Keras objects or functions, or a list or "
            f"dict of them, got {[type(b).__name__ for b in bad]}")
    return value if isinstance(value, dict) else list(items)


def _list_of_objects(name: str, value: Any) -> Optional[List[Any]]:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _choice(*choices: str) -> Callable[[str, Any], str]:
    def convert(name: str, value: Any) -> Optional[str]:
        if value is None or value in choices:
            return value
        raise InvalidArgumentError(f"{name} must be one of {list(choices)}, got {value!r}")
    return convert


def _compile_args(name: str, value: Any) -> Optional[Dict[str, Any]]:
    """None (eager), or the keyword arguments of ``torch.compile`` (True: none)."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return dict(value)
    raise InvalidArgumentError(
        f"{name} must be True, False or a dict of torch.compile keyword arguments "
        f"(e.g. {{'mode': 'max-autotune'}}), got {value!r}")


def _dict(name: str, value: Any) -> Optional[Dict[str, Any]]:
    if value is None or isinstance(value, dict):
        return value
    raise InvalidArgumentError(f"{name} must be a dict, got {type(value).__name__}")


def _backend(name: str, value: Any) -> Any:
    if value is None or callable(getattr(value, "num_processes", None)):
        return value
    raise InvalidArgumentError(
        f"{name} must be None or a Horovod-style backend with num_processes(), got "
        f"{type(value).__name__}; spark_hvd launches on the active SparkSession itself: set "
        f"num_proc=N (and backend_env={{...}} for the processes' environment)")


def _env(name: str, value: Any) -> Optional[Dict[str, str]]:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in value.items()):
        raise InvalidArgumentError(f"{name} must be a dict of str to str (environment "
                                   f"variables), got {value!r}")
    return dict(value)


_P = ParamSpec
_POS = _int_at_least(1)
_NONNEG = _int_at_least(0)
_RESTARTS = _int_at_least(0, "it is how many times fit restarts training from the last epoch "
                             "checkpoint after a lost rank, e.g. max_restarts=3 (0: never)",
                       allow_none=False)

# Horovod's names for params spark_hvd names otherwise (its models' column params).
PARAM_NAMES_OF_HOROVOD = {"feature_columns": "feature_cols", "label_columns": "label_cols"}

# The estimators' params.  Defaults are JSON values (Spark ML saves them as such).
ESTIMATOR_PARAMS: Tuple[ParamSpec, ...] = (
    _P("num_proc", None, _POS, JSON,
       "number of training processes (one Spark barrier task each); default: every task slot "
       "of the cluster"),
    _P("store", None, _store, PICKLE,
       "Store (or path/URL) for the materialized training data, checkpoints and logs"),
    _P("model", None, _any, PICKLE, "the torch.nn.Module to train"),
    _P("optimizer", None, _any, PICKLE,
       "a torch.optim.Optimizer built on model.parameters(), or a callable "
       "params -> Optimizer"),
    _P("loss", None, _callables, PICKLE,
       "loss function(output, label) -> scalar tensor, or a list of them, one per output/label"),
    _P("loss_constructors", None, _callables, PICKLE,
       "callables returning loss functions, called on each process (instead of loss)"),
    _P("loss_weights", None, _floats, JSON, "weights of the per-output losses (default all 1)"),
    _P("metrics", None, _callables, PICKLE,
       "metric functions(output, label) -> number, a list or a dict name -> function; averaged "
       "over all rows of all processes each epoch"),
    _P("feature_cols", None, _columns, JSON, "feature column names, the model's inputs in order"),
    _P("label_cols", None, _columns, JSON, "label column names, one per model output"),
    _P("sample_weight_col", None, _str, JSON,
       "optional column of per-row weights of the loss (the loss is then called with "
       "reduction='none')"),
    _P("validation", None, _validation, JSON,
       "fraction of rows kept for validation, or the name of a boolean/0-1 column marking them"),
    _P("batch_size", 32, _POS, JSON, "rows per training batch per process"),
    _P("val_batch_size", None, _POS, JSON, "rows per validation batch (default batch_size)"),
    _P("epochs", 1, _POS, JSON, "number of passes over the training data"),
    _P("train_steps_per_epoch", None, _POS, JSON,
       "at most this many training batches per epoch (default all)"),
    _P("validation_steps_per_epoch", None, _POS, JSON,
       "at most this many validation batches per epoch (default all)"),
    _P("shuffle", True, _bool, JSON, "shuffle the training rows every epoch"),
    _P("shuffle_buffer_size", None, _NONNEG, JSON,
       "rows mixed together when shuffling (default max(4 * batch_size, 4096))"),
    _P("random_seed", None, _NONNEG, JSON,
       "seed of the validation split, shuffling and torch (default: derived from run_id)"),
    _P("run_id", None, _run_id, JSON,
       "name of the run in the store; fitting again with the same run_id resumes from its last "
       "checkpoint (default: a new id)"),
    _P("callbacks", None, _list_of_objects, PICKLE,
       "objects with any of on_train_begin(logs), on_epoch_begin(epoch, logs), "
       "on_batch_end(step, logs), on_epoch_end(epoch, logs), on_train_end(logs); called on "
       "every process; setting logs['stop_training'] = True in on_epoch_end stops training"),
    _P("gradient_compression", None, _any, PICKLE,
       "spark_hvd.torch.Compression.none / fp16 / bf16 for the gradient allreduce"),
    _P("backward_passes_per_step", 1, _POS, JSON,
       "batches whose gradients are accumulated (averaged) before each optimizer step"),
    _P("lr_scheduler_fn", None, _callable, PICKLE,
       "callable optimizer -> torch LR scheduler, stepped once per epoch"),
    _P("torch_compile", None, _compile_args, PICKLE,
       "True, or a dict of torch.compile keyword arguments (e.g. {'mode': 'max-autotune'}): "
       "each process trains through torch.compile(model, **args); validation, checkpoints "
       "and transform use the model itself (the same weights)"),
    _P("mixed_precision", None, _choice("bf16", "fp16"), JSON,
       "'bf16' or 'fp16': forward passes and losses (training and validation) run under "
       "torch.autocast with that dtype on each process's device, the parameters keep "
       "theirs; 'fp16' also scales the loss with a torch.amp.GradScaler, which unscales the "
       "averaged gradients and skips a step with inf/NaN ones on every process"),
    _P("use_gpu", None, _opt_bool, JSON,
       "train on GPUs: True, False, or None to use them where the executors have them"),
    _P("verbose", 1, _NONNEG, JSON,
       "0 silent, 1 a progress line per epoch (and every ~10 s), 2 one per ~5% of an epoch"),
    _P("transformation_fn", None, _callable, PICKLE,
       "function pandas.DataFrame -> pandas.DataFrame applied to every training and "
       "validation batch on the workers, as Horovod's (an array column holds one numpy "
       "array per row)"),
    _P("train_reader_num_workers", None, _POS, JSON,
       "Horovod's: with reader='petastorm', Petastorm's worker count for the training data "
       "(workers_count); spark_hvd's 'arrow' reader decodes ahead in one prefetch thread"),
    _P("val_reader_num_workers", None, _POS, JSON,
       "the same for the validation data"),
    _P("inmemory_cache_all", False, _bool, JSON,
       "Horovod's: keep each process's share of the training data in memory after the "
       "first epoch and read it from there (reshuffled every epoch when shuffle)"),
    _P("backend", None, _backend, PICKLE,
       "Horovod's: a backend with num_processes() (e.g. horovod.spark's SparkBackend); only its "
       "process count is used, as num_proc when that is unset; spark_hvd launches on the "
       "active SparkSession itself"),
    _P("backend_env", None, _env, JSON,
       "Horovod's: environment variables {name: value} for the training processes"),
    _P("input_shapes", None, _shapes, JSON,
       "shape of each feature column's tensor, e.g. [[-1, 1, 8, 8]] (-1: batch dimension)"),
    _P("label_shapes", None, _shapes, JSON, "shape of each label column's tensor"),
    _P("output_cols", None, _columns, JSON,
       "prediction column names of the fitted model (default '<label>__output', or "
       "'prediction' without labels)"),
    _P("terminate_on_nan", True, _bool, JSON,
       "stop with an error naming the epoch and step as soon as the training loss is NaN or "
       "infinite (Keras: or the weights, looked at every 64 steps) (Horovod's default is "
       "False: trains on with NaN weights)"),
    _P("allow_nonfinite", False, _flag, JSON,
       "let NaN and infinite values of float feature, label and weight columns into the "
       "training data; by default the data's write fails naming the column, the value and "
       "where it is"),
    _P("partitions_per_process", None, _POS, JSON,
       "repartition the data to num_proc * this before materializing (default: keep the "
       "DataFrame's partitioning)"),
    _P("inference_batch_size", 1024, _POS, JSON, "rows per model call in TorchModel.transform"),
    _P("reader", "arrow", _choice("arrow", "petastorm"), JSON,
       "training data reader on the workers: spark_hvd's 'arrow' reader or 'petastorm'"),
    _P("max_restarts", 3, _RESTARTS, JSON,
       "how many times fit restarts training from the last epoch checkpoint when a rank is "
       "lost (its process killed or crashed, its executor lost) or a collective fails; an "
       "ordinary exception raised by the model, loss, metrics or callbacks is not retried"),
    _P("mlflow_log", True, _flag, JSON,
       "when mlflow is installed, log the fit to MLflow from the driver: params, per-epoch "
       "metrics (step = epoch index), the trained model with its signature and a "
       "'spark_hvd.run_id' tag; into the active MLflow run, else a new one (False: do not)"),
    _P("mlflow_experiment", None, _str, JSON,
       "name of the MLflow experiment of the run fit starts when no MLflow run is active "
       "(created if missing); default: MLflow's own choice (MLFLOW_EXPERIMENT_NAME, else its "
       "'Default' experiment)"),
)

# The fitted model's params.
MODEL_PARAMS: Tuple[ParamSpec, ...] = (
    _P("model", None, _any, PICKLE, "the trained torch.nn.Module"),
    _P("history", None, _dict, JSON, "per-epoch metrics of the training: {name: [values]}"),
    _P("feature_cols", None, _columns, JSON, "feature column names, the model's inputs in order"),
    _P("label_cols", None, _columns, JSON, "label column names the model was trained on"),
    _P("output_cols", None, _columns, JSON,
       "prediction column names (default '<label>__output', or 'prediction' without labels)"),
    _P("run_id", None, _run_id, JSON, "the training run's id in its store"),
    _P("input_shapes", None, _shapes, JSON, "shape of each feature column's tensor"),
    _P("feature_shapes", None, _shapes, JSON, "per-row shape of each feature column as read"),
    _P("output_shapes", None, _shapes, JSON,
       "per-row shape of each model output (from a dry run at fit time)"),
    _P("inference_batch_size", 1024, _POS, JSON, "rows per model call in transform"),
    _P("use_gpu", None, _opt_bool, JSON,
       "predict on the executor's GPU: True, False, or None to use one where there is one"),
)


def derive_table(base: Sequence[ParamSpec], replace: Sequence[ParamSpec] = (),
                 drop: Sequence[str] = (), add: Sequence[ParamSpec] = ()
                 ) -> Tuple[ParamSpec, ...]:
    """``base`` with the rows of ``replace`` (same name) swapped in, ``drop`` left out and
    ``add`` appended."""
    swaps = {spec.name: spec for spec in replace}
    unknown = (set(swaps) | set(drop)) - {spec.name for spec in base}
    if unknown:
        raise ValueError(f"no such rows to replace or drop: {sorted(unknown)}")
    rows = [swaps.get(spec.name, spec) for spec in base if spec.name not in drop]
    return tuple(rows) + tuple(add)


_CUSTOM_OBJECTS = _P("custom_objects", None, _dict, PICKLE,
                     "{name: class or function} Keras needs to load the model (custom layers, "
                     "losses, metrics), as for keras.models.load_model")

# KerasEstimator: the same table with Keras' objects; Horovod's KerasEstimator has no
# loss_constructors (Keras builds its losses from names) and schedules the learning rate
# with callbacks instead of lr_scheduler_fn.
KERAS_ESTIMATOR_PARAMS: Tuple[ParamSpec, ...] = derive_table(
    ESTIMATOR_PARAMS,
    replace=(
        _P("model", None, _any, PICKLE,
           "the keras.Model to train (Sequential or functional; compiled or not)"),
        _P("optimizer", None, _any, PICKLE,
           "a keras.optimizers.Optimizer (or its name); default: the compiled model's"),
        _P("loss", None, _names_or_callables, PICKLE,
           "as for model.compile: a name, a keras loss or function(y_true, y_pred), or a list "
           "or dict of them, one per output; default: the compiled model's"),
        _P("metrics", None, _names_or_callables, PICKLE,
           "as for model.compile (e.g. ['accuracy']); averaged over the processes each epoch; "
           "default: the compiled model's"),
        _P("sample_weight_col", None, _str, JSON,
           "optional column of per-row weights of the loss (Keras' sample_weight)"),
        _P("random_seed", None, _NONNEG, JSON,
           "seed of the validation split, shuffling and keras.utils.set_random_seed (default: "
           "derived from run_id)"),
        _P("callbacks", None, _list_of_objects, PICKLE,
           "keras.callbacks.Callback objects, run on every process after the metrics are "
           "averaged; model.stop_training set by any of them stops every process at the end "
           "of the epoch"),
        _P("gradient_compression", None, _any, PICKLE,
           "spark_hvd.tensorflow.Compression.none / fp16 / bf16 for the gradient allreduce"),
        _P("inference_batch_size", 1024, _POS, JSON,
           "rows per model call in KerasModel.transform"),
    ),
    drop=("loss_constructors", "lr_scheduler_fn", "torch_compile", "mixed_precision"),
    add=(_CUSTOM_OBJECTS,))

KERAS_MODEL_PARAMS: Tuple[ParamSpec, ...] = derive_table(
    MODEL_PARAMS,
    replace=(_P("model", None, _any, PICKLE, "the trained keras.Model"),),
    add=(_CUSTOM_OBJECTS,))


def camel(name: str) -> str:
    """``feature_cols`` -> ``FeatureCols``."""
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def _make_getter(name: str) -> Callable[[Params], Any]:
    def getter(self: Params) -> Any:
        return self.getOrDefault(getattr(self, name))
    getter.__name__ = "get" + camel(name)
    getter.__doc__ = f"The value of ``{name}``."
    getter._from_table = True
    return getter


def _make_setter(name: str) -> Callable[[Params, Any], Params]:
    def setter(self: Params, value: Any) -> Params:
        return self._set(**{name: value})
    setter.__name__ = "set" + camel(name)
    setter.__doc__ = f"Set ``{name}``; returns self."
    setter._from_table = True
    return setter


def declare_params(cls: type, table: Sequence[ParamSpec]) -> type:
    """Give ``cls`` a Param, a getter and a setter for every row of ``table``.

    A getter or setter the class already defines, or inherits from a base class that
    defines it (not one generated from a table), is kept.  Returns ``cls``.
    """
    specs = {}
    for spec in table:
        if spec.persist not in (JSON, PICKLE):
            raise ValueError(f"param {spec.name}: persist must be json or pickle")
        convert = _bind(spec)
        setattr(cls, spec.name, Param(Params._dummy(), spec.name, spec.doc,
                                      typeConverter=convert))
        for make, prefix in ((_make_getter, "get"), (_make_setter, "set")):
            method = prefix + camel(spec.name)
            existing = getattr(cls, method, None)
            if existing is None or getattr(existing, "_from_table", False):
                setattr(cls, method, make(spec.name))
        specs[spec.name] = spec
    cls._param_specs = specs
    listing = "\n".join(f"    {s.name} (default {s.default!r}): {s.doc}" for s in table)
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\n    Parameters (keyword arguments, " \
        "each with getFooBar/setFooBar)\n    ----------\n" + listing + "\n"
    return cls


def _bind(spec: ParamSpec) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        return spec.convert(spec.name, value)
    convert.__name__ = f"convert_{spec.name}"
    return convert


class ParamsFromTable(Params):
    """Params whose declarations come from a table (see :func:`declare_params`)."""

    _param_specs: Dict[str, ParamSpec] = {}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._setDefault(**{n: s.default for n, s in self._param_specs.items()})
        self.setParams(**kwargs)

    def setParams(self, **kwargs: Any) -> "ParamsFromTable":
        """Set any params by keyword; an unknown keyword is an error. Horovod's names for
        params spark_hvd names otherwise (``feature_columns`` and ``label_columns`` of its
        models) are taken too."""
        for horovod, ours in PARAM_NAMES_OF_HOROVOD.items():
            if horovod in kwargs and ours in self._param_specs:
                if ours in kwargs:
                    raise InvalidArgumentError(f"{horovod} and {ours} are one parameter; "
                                               f"give one of them")
                kwargs[ours] = kwargs.pop(horovod)
        unknown = [k for k in kwargs if k not in self._param_specs]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, list(self._param_specs), n=2)
                hints.append(f"'{k}'" + (f" (did you mean {', '.join(map(repr, close))}?)"
                                         if close else ""))
            raise InvalidArgumentError(
                f"{type(self).__name__} has no parameter {', '.join(hints)}; its parameters "
                f"are {sorted(self._param_specs)}")
        return self._set(**kwargs)

    def _values(self) -> Dict[str, Any]:
        """Every param's current value (set or default), by name."""
        return {n: self.getOrDefault(getattr(self, n)) for n in self._param_specs}

    def _split_for_persistence(self) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """The explicitly set values as (JSON-able, to be pickled)."""
        plain, objects = {}, {}
        for param, value in self._paramMap.items():
            spec = self._param_specs.get(param.name)
            if spec is None:
                continue
            (plain if spec.persist == JSON else objects)[param.name] = value
        return plain, self._encode_objects(objects)

    def _encode_objects(self, objects: Dict[str, Any]) -> Dict[str, Any]:
        """The object params as they are pickled when saving (default: as they are)."""
        return objects

    def _decode_objects(self, objects: Dict[str, Any]) -> Dict[str, Any]:
        """The inverse of :meth:`_encode_objects`, when loading."""
        return objects
