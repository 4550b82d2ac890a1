"""fit's MLflow record, made on the driver from what training left in the Store.

When ``mlflow_log`` is True (the default) and ``mlflow`` imports, ``fit`` logs, once training
is done (:func:`log_fit`):

1. The run: the active one (``mlflow.active_run()``), which fit leaves open; else a new run
   in ``mlflow_experiment`` (created when missing; unset: MLflow's own choice,
   ``MLFLOW_EXPERIMENT_NAME``/``_ID`` or its ``Default`` experiment), ended when the logging
   is done (``mlflow.last_active_run()`` finds it afterwards).
2. Params: every param of the estimator as text (objects by class or function name, an
   optimizer with its learning rate, a Store by its URL, ``backend_env`` by its variables'
   names only; for a param left unset that fit filled in, such as Keras' optimizer, loss and
   metrics from the compiled model, what fit used).  A param the run already has is left as it
   is: MLflow refuses to change one, and a run reused by several fits keeps the first fit's values.
3. Metrics: the history of the run's last checkpoint, one value per epoch with ``step`` the
   epoch index (0 = the first epoch, as in the TensorBoard events); the epochs the MLflow
   run already has (a resumed fit logging into the same run) are not logged again.
4. Tags: :data:`TAG_RUN_ID` (the Store's run), :data:`TAG_STORE` and :data:`TAG_ESTIMATOR`.
5. The trained model, named :data:`MODEL_NAME`, in the estimator's flavor
   (``_log_mlflow_model``: ``mlflow.pytorch``, ``mlflow.keras``), with a signature made from
   the dry run's zero batch: the tensor the model takes (one per feature column, floats in
   the model's dtype, ``input_shapes`` applied, ``transformation_fn`` not) and its outputs,
   and pip requirements written from what this process has loaded (:func:`requirements`:
   the framework's distributions and those the model's classes come from, at their
   installed versions).  Left to itself MLflow infers them by loading the model in a
   subprocess, which took 7-12 s of every fit.

Cost: a warm fit pays a few tracking calls and the model's save (~0.1-0.5 s on a local
store).  The first fit of a process also imports mlflow and the flavor (seconds): ``fit``
starts that import in a background thread (:func:`preload`) before its checks, so it
overlaps the fit's own work.

Nothing of this runs on the executors: rank 0 writes the history with each checkpoint, and
the driver reads the last checkpoint back (``_trained_model``), so only the driver needs
MLflow's tracking URI and credentials.

A failure while logging (no tracking server, no permission, MLflow's default ``sqlite:``
store without SQLAlchemy...) is a warning naming the fix, not an error: training is done,
and the model is in the Store and is returned.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import numbers
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

TAG_RUN_ID = "spark_hvd.run_id"
TAG_STORE = "spark_hvd.store"
TAG_ESTIMATOR = "spark_hvd.estimator"
MODEL_NAME = "model"
MAX_PARAM_CHARS = 500  # MLflow takes up to 6000; a longer text is cut with "..."
# The params that say how to log are not logged.
NOT_LOGGED = ("mlflow_log", "mlflow_experiment")
# Params whose values may be secrets (credentials in environment variables): only their
# names are logged.
NAMES_ONLY = ("backend_env",)

# log_model(signature) logs the model into the active run, its signature being
# signature(inputs, outputs) (numpy arrays, see :func:`signature`).
LogModel = Callable[[Callable[[Sequence[Any], Sequence[Any]], Any]], None]


# Each flavor's frameworks: their distributions are always in the requirements.
FLAVOR_FRAMEWORKS = {"mlflow.pytorch": ("torch", "cloudpickle"),
                     "mlflow.keras": ("keras", "tensorflow")}
# Distribution names a module is installed under besides its own (the first found is used).
DISTRIBUTION_ALIASES = {"tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-intel",
                                       "tensorflow-macos")}

_preloaded: Dict[str, threading.Thread] = {}
_preload_lock = threading.Lock()


def preload(flavor: str) -> None:
    """Do in a background thread, once per process, when mlflow is installed, what the first
    logging of a process would otherwise wait for at the end of the fit (measured 8 s on an
    idle machine, 14 s under load): import mlflow and the ``flavor`` module
    (``mlflow.pytorch``...), open the tracking store (for a database URI that imports
    SQLAlchemy's store and checks the schema), and build MLflow's map of installed
    distributions, which it reads (about a second) to check the requirements of the first
    model it logs."""
    with _preload_lock:
        if flavor in _preloaded or flavor in sys.modules:
            return
        if importlib.util.find_spec("mlflow") is None:
            return
        thread = threading.Thread(target=_preload, args=(flavor,), daemon=True,
                                  name=f"spark_hvd-preload-{flavor}")
        _preloaded[flavor] = thread
    thread.start()


def _preload(flavor: str) -> None:
    try:  # any failure: the logging does it again and says what failed
        importlib.import_module(flavor)
        import mlflow
        mlflow.MlflowClient().search_experiments(max_results=1)  # the store, opened
        from mlflow.utils import requirements_utils
        build_map = getattr(requirements_utils, "_init_packages_to_modules_map", None)
        if build_map is not None:  # MLflow's own, private: skipped if it goes away
            build_map()
    except Exception as exc:
        logger.debug("preloading %s failed: %s", flavor, exc)


def requirements(flavor: str, objects: Iterable[Any]) -> List[str]:
    """The pip requirements of a model logged in ``flavor``: the flavor's frameworks
    (:data:`FLAVOR_FRAMEWORKS`) and the top-level packages the classes of ``objects`` (the
    model's modules or layers) and their base classes come from, each as ``name==version`` of
    the distribution installed here (a local label such as ``+cpu`` dropped); packages that are not
    installed distributions (``__main__``, a notebook, the standard library) are left out."""
    modules = list(FLAVOR_FRAMEWORKS.get(flavor, ()))
    for cls in dict.fromkeys(c for obj in objects for c in type(obj).__mro__):
        top = cls.__module__.split(".")[0]
        if top not in modules and top not in ("__main__", "builtins") and \
                top not in getattr(sys, "stdlib_module_names", ()):
            modules.append(top)
    out: List[str] = []
    for module in modules:
        found = _distribution(module)
        if found is not None and f"{found[0]}=={found[1]}" not in out:
            out.append(f"{found[0]}=={found[1]}")
    return out


@functools.lru_cache(maxsize=None)
def _distribution(module: str) -> Optional[Tuple[str, str]]:
    """(distribution name, version without local label) of the installed distribution
    providing top-level module ``module``, or None."""
    for name in DISTRIBUTION_ALIASES.get(module, (module,)):
        try:
            return name, importlib.metadata.version(name).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    names = _packages_distributions().get(module)
    if not names:
        return None
    try:
        return names[0], importlib.metadata.version(names[0]).split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def _packages_distributions() -> Mapping[str, List[str]]:
    """importlib's module -> distributions map (reads every installed distribution: about
    a second, so only when a module is not its own distribution's name, once a process)."""
    return importlib.metadata.packages_distributions()


def import_mlflow() -> Any:
    """The ``mlflow`` module, or None when it does not import."""
    try:
        import mlflow
    except ImportError:
        return None
    return mlflow


def log_fit(estimator: str, p: Mapping[str, Any], param_names: Sequence[str], run_id: str,
            history: Mapping[str, Sequence[float]], feature_cols: Sequence[str],
            output_cols: Sequence[str], log_model: LogModel) -> Optional[str]:
    """Log a fit (see the module docstring; the caller checked ``mlflow_log``); the MLflow
    run's id, or None when nothing was logged.

    ``p`` holds the param values (and what fit added, ``_optimizer``...), ``param_names``
    the params to log, ``run_id`` the Store's run and ``history`` its per-epoch metrics.
    """
    mlflow = import_mlflow()
    if mlflow is None:
        if p["mlflow_experiment"]:
            logger.warning(
                "%s: mlflow_experiment=%r is set but mlflow does not import, so nothing was "
                "logged to MLflow; pip install mlflow-skinny (or mlflow), or set "
                "mlflow_log=False", estimator, p["mlflow_experiment"])
        return None
    try:
        return _log(mlflow, estimator, p, param_names, run_id, history,
                    lambda: log_model(lambda x, y: signature(feature_cols, x, output_cols, y)))
    except Exception as exc:
        logger.debug("logging to MLflow failed", exc_info=True)
        logger.warning(
            "%s: training is done and the model is in the store (run '%s'), but logging it "
            "to MLflow failed (tracking URI %r): %s: %s. Point MLflow at a tracking server or "
            "a store it can open (MLFLOW_TRACKING_URI or mlflow.set_tracking_uri; a local "
            "'sqlite:' store needs sqlalchemy and alembic next to mlflow-skinny), or set "
            "mlflow_log=False", estimator, run_id, _tracking_uri(mlflow),
            type(exc).__name__, exc)
        return None


def _tracking_uri(mlflow: Any) -> Optional[str]:
    try:
        return mlflow.get_tracking_uri()
    except Exception:  # pragma: no cover - only for the message
        return None


def _log(mlflow: Any, estimator: str, p: Mapping[str, Any], param_names: Sequence[str],
         run_id: str, history: Mapping[str, Sequence[float]],
         log_model: Callable[[], None]) -> str:
    client = mlflow.MlflowClient()
    active = mlflow.active_run()
    experiment = p["mlflow_experiment"]
    if active is not None:
        if experiment and _experiment_name(client, active.info.experiment_id) != experiment:
            logger.warning(
                "%s: logging to the active MLflow run %s, which is not in "
                "mlflow_experiment=%r (end it first to log to a new run there)", estimator,
                active.info.run_id, experiment)
        _log_into(client, active.info.run_id, estimator, p, param_names, run_id, history)
        log_model()
        return active.info.run_id
    experiment_id = None
    if experiment:
        found = client.get_experiment_by_name(experiment)
        experiment_id = (found.experiment_id if found is not None
                         else client.create_experiment(experiment))
    with mlflow.start_run(experiment_id=experiment_id) as run:
        _log_into(client, run.info.run_id, estimator, p, param_names, run_id, history)
        log_model()
    return run.info.run_id


def _experiment_name(client: Any, experiment_id: str) -> Optional[str]:
    try:
        return client.get_experiment(experiment_id).name
    except Exception:  # pragma: no cover - only for the warning
        return None


def _log_into(client: Any, mlflow_run_id: str, estimator: str, p: Mapping[str, Any],
              param_names: Sequence[str], run_id: str,
              history: Mapping[str, Sequence[float]]) -> None:
    """Params, metrics and tags into the MLflow run, in one batch."""
    from mlflow.entities import Metric, Param, RunTag

    have = client.get_run(mlflow_run_id).data.params
    texts = param_texts(p, param_names)
    kept = sorted(k for k, v in texts.items() if k in have and have[k] != v)
    if kept:
        logger.info("%s: MLflow run %s already has the params %s with other values; kept "
                    "them", estimator, mlflow_run_id, kept)
    key = "loss" if "loss" in history else next(iter(history), None)
    logged = ({m.step for m in client.get_metric_history(mlflow_run_id, key)}
              if key is not None else set())
    now = int(time.time() * 1000)
    metrics = [Metric(key, float(value), now, step) for key, values in history.items()
               for step, value in enumerate(values) if step not in logged]
    store = p["store"]
    tags = [RunTag(TAG_RUN_ID, run_id), RunTag(TAG_ESTIMATOR, estimator),
            RunTag(TAG_STORE, str(getattr(store, "url", store)))]
    client.log_batch(mlflow_run_id, metrics=metrics, tags=tags,
                     params=[Param(k, v) for k, v in texts.items() if k not in have])


def signature(feature_cols: Sequence[str], inputs: Sequence[Any],
              output_cols: Sequence[str], outputs: Sequence[Any]) -> Any:
    """The MLflow signature of a model taking ``inputs`` and giving ``outputs`` (numpy
    arrays, batch first): one tensor each, or for several, tensors named by column."""
    from mlflow.models import infer_signature

    x = inputs[0] if len(inputs) == 1 else dict(zip(feature_cols, inputs))
    y = outputs[0] if len(outputs) == 1 else dict(zip(output_cols, outputs))
    return infer_signature(x, y)


# -- params as text ------------------------------------------------------------------------------

def param_texts(p: Mapping[str, Any], names: Sequence[str]) -> Dict[str, str]:
    """``{name: text}`` of the params to log (see the module docstring)."""
    out = {}
    for name in names:
        if name in NOT_LOGGED:
            continue
        value = p.get(name)
        if value is None and p.get("_" + name) is not None:
            value = p["_" + name]  # what fit used for a param left unset
        if name in NAMES_ONLY and isinstance(value, dict):
            value = sorted(value)
        out[name] = describe(value)
    return out


def describe(value: Any) -> str:
    """A param value as a short text: plain values as they are, objects by name."""
    text = _describe(value)
    return text if len(text) <= MAX_PARAM_CHARS else text[:MAX_PARAM_CHARS - 3] + "..."


def _describe(value: Any) -> str:
    if value is None or isinstance(value, (bool, str)):
        return str(value)
    if isinstance(value, numbers.Real):
        return f"{value:.6g}" if isinstance(value, float) else str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(repr(v) if isinstance(v, str) else _describe(v)
                               for v in value) + "]"
    if isinstance(value, dict):
        if isinstance(value.get("class_name"), str) and isinstance(value.get("config"), dict):
            # A Keras object's config (the optimizer of a compiled model).
            return _named(value["class_name"], "learning_rate",
                          value["config"].get("learning_rate"))
        return "{" + ", ".join(f"{k}: {_describe(v)}" for k, v in value.items()) + "}"
    url = getattr(value, "url", None)
    if isinstance(url, str):  # a Store
        return url
    name = getattr(value, "__name__", None)  # a function or a class
    if isinstance(name, str):
        return name
    return _named(type(value).__name__, *_learning_rate(value))


def _named(name: str, key: str = "", value: Any = None) -> str:
    return f"{name}({key}={_describe(value)})" if value is not None else name


def _learning_rate(obj: Any) -> List[Any]:
    """``[key, value]`` of an optimizer's learning rate (torch's ``lr``, Keras'
    ``learning_rate``), else ``[]``."""
    defaults = getattr(obj, "defaults", None)
    if isinstance(defaults, dict) and "lr" in defaults:  # torch.optim.Optimizer
        return ["lr", defaults["lr"]]
    if hasattr(obj, "apply_gradients") and callable(getattr(obj, "get_config", None)):
        try:  # a keras.optimizers.Optimizer
            return ["learning_rate", obj.get_config().get("learning_rate")]
        except Exception:
            return []
    return []
