"""The param tables, parameter checks, the driver's dry run and the small pieces of the
trainer and the model: no Spark session, no Spark job."""

import io
import sys

import numpy as np

import pytest
import torch
import torch.nn.functional as F

from est_helpers import accuracy, make_keras_net, make_net
from spark_hvd.estimators import (KerasEstimator, KerasModel, LocalStore, TorchEstimator,
                                  TorchModel)
from spark_hvd.estimators import _estimator_base as eb
from spark_hvd.estimators import _model_base as mb
from spark_hvd.estimators import _predict_udf as pu
from spark_hvd.estimators import _trainer_torch as trainer
from spark_hvd.estimators import torch_estimator as te
from spark_hvd.estimators import torch_model as tm
from spark_hvd.estimators.params import (ESTIMATOR_PARAMS, KERAS_ESTIMATOR_PARAMS,
                                         KERAS_MODEL_PARAMS, MODEL_PARAMS, PICKLE, camel)
from spark_hvd.estimators.progress import EpochProgress, FitClock, bar, format_metrics
from spark_hvd.exceptions import InvalidArgumentError, RankFailedError


def _values(**kw):
    net = kw.pop("model", None) or make_net()
    args = dict(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                loss=F.cross_entropy, feature_cols=["features"], label_cols=["label"],
                store=LocalStore("/tmp/unused-store"))
    args.update(kw)
    return TorchEstimator(**args)._values()


# -- the tables and what they generate ---------------------------------------------------------

@pytest.mark.parametrize("cls,table", [(TorchEstimator, ESTIMATOR_PARAMS),
                                       (TorchModel, MODEL_PARAMS),
                                       (KerasEstimator, KERAS_ESTIMATOR_PARAMS),
                                       (KerasModel, KERAS_MODEL_PARAMS)])
def test_every_row_becomes_a_param_with_getter_and_setter(cls, table):
    obj = cls()
    assert sorted(p.name for p in obj.params) == sorted(s.name for s in table)
    for spec in table:
        param = obj.getParam(spec.name)
        assert param.doc == spec.doc and param.parent == obj.uid
        assert obj.getOrDefault(spec.name) == spec.default
        assert callable(getattr(obj, "get" + camel(spec.name)))
        assert callable(getattr(obj, "set" + camel(spec.name)))
        assert spec.name in cls.__doc__


def test_setters_convert_check_and_chain():
    est = TorchEstimator()
    assert est.setBatchSize(16).setEpochs(3) is est
    assert (est.getBatchSize(), est.getEpochs()) == (16, 3)
    est.setFeatureCols("f")
    assert est.getFeatureCols() == ["f"]
    est.setStore("/tmp/somewhere")
    assert isinstance(est.getStore(), LocalStore)
    est.setInputShapes([-1, 1, 8, 8])
    assert est.getInputShapes() == [[-1, 1, 8, 8]]
    copy = est.copy({est.epochs: 7})
    assert copy.getEpochs() == 7 and est.getEpochs() == 3 and copy.uid == est.uid
    assert "batch_size" in est.explainParams()


@pytest.mark.parametrize("kw,needle", [
    (dict(batch_size=0), "batch_size must be an integer >= 1, got 0"),
    (dict(epochs=2.5), "epochs must be an integer"),
    (dict(validation=1.5), "validation must be a fraction in [0, 1)"),
    (dict(validation=True), "validation must be a fraction"),
    (dict(feature_cols=[]), "feature_cols must be a column name"),
    (dict(label_cols=["y", "y"]), "names a column twice"),
    (dict(input_shapes=[[0, 3]]), "input_shapes must hold shapes"),
    (dict(input_shapes=[[-1, -1]]), "at most one -1"),
    (dict(store=42), "store must be a Store"),
    (dict(run_id="a/b"), "not usable as a directory name"),
    (dict(shuffle="yes"), "shuffle must be True or False"),
    (dict(reader="parquet"), "reader must be one of ['arrow', 'petastorm']"),
    (dict(metrics=["accuracy"]), "metrics must be callables"),
    (dict(batch_sise=8), "did you mean 'batch_size'"),
    (dict(max_restarts=-1), "max_restarts must be an integer >= 0, got -1; it is how many "
                            "times fit restarts training from the last epoch checkpoint"),
    (dict(max_restarts=1.5), "max_restarts must be an integer >= 0, got 1.5"),
    (dict(max_restarts="3"), "max_restarts must be an integer >= 0, got '3'"),
    (dict(max_restarts=True), "got True"),
])
def test_bad_values_are_refused_when_set(kw, needle):
    with pytest.raises(InvalidArgumentError) as err:
        TorchEstimator(**kw)
    assert needle in str(err.value)


def test_persistence_split_follows_the_table():
    net = make_net()
    est = TorchEstimator(model=net, batch_size=8, feature_cols=["f"], loss=F.mse_loss)
    plain, objects = est._split_for_persistence()
    assert plain == {"batch_size": 8, "feature_cols": ["f"]}
    assert set(objects) == {"model", "loss"}
    pickled = {s.name for s in ESTIMATOR_PARAMS if s.persist == PICKLE}
    assert {"model", "optimizer", "loss", "store", "callbacks"} <= pickled


def test_max_restarts_on_both_estimators():
    assert TorchEstimator().getMaxRestarts() == 3 and KerasEstimator().getMaxRestarts() == 3
    assert TorchEstimator().setMaxRestarts(0).getMaxRestarts() == 0
    assert KerasEstimator(max_restarts=5).getMaxRestarts() == 5
    with pytest.raises(InvalidArgumentError, match="max_restarts must be an integer >= 0"):
        KerasEstimator().setMaxRestarts(-2)


# -- parameter checks --------------------------------------------------------------------------

@pytest.mark.parametrize("change,needle", [
    (dict(model=None), "needs model"),
    (dict(optimizer=None), "needs optimizer"),
    (dict(loss=None), "needs loss"),
    (dict(store=None), "needs store"),
    (dict(label_cols=None), "needs label_cols"),
    (dict(label_cols=["a", "b"], loss=[F.mse_loss] * 3), "3 loss functions for 2 label_cols"),
    (dict(loss_weights=[1.0, 2.0]), "loss_weights has 2 value(s) for 1 loss"),
    (dict(input_shapes=[[64], [1]]), "input_shapes has 2 shape(s) for 1 column"),
    (dict(feature_cols=["label"]), "both features and labels"),
    (dict(sample_weight_col="label"), "also a feature or label column"),
    (dict(gradient_compression="fp16"), "gradient_compression must be"),
    (dict(callbacks=[object()]), "has none of the methods"),
    (dict(max_restarts=None), "max_restarts must be an integer >= 0, got None; it is how many"),
])
def test_param_checks(change, needle):
    est = TorchEstimator()
    p = _values()
    p.update(change)
    with pytest.raises(InvalidArgumentError) as err:
        est._check_params(p)
    assert needle in str(err.value)


def test_petastorm_reader_that_does_not_import_is_refused_before_any_work(monkeypatch):
    monkeypatch.setitem(sys.modules, "petastorm", None)  # as in the main env: no petastorm
    with pytest.raises(ImportError, match=r"petastorm 0\.13\.1.*make compat"):
        TorchEstimator()._check_params(_values(reader="petastorm"))


def test_optimizer_of_another_model_is_refused():
    other = make_net(1)
    p = _values(optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(InvalidArgumentError, match="not built on this model's parameters"):
        TorchEstimator()._check_params(p)
    p = _values(optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    TorchEstimator()._check_params(p)  # a factory is fine


# -- the driver's dry run ----------------------------------------------------------------------

def _zeros(width=64, label_dtype=np.int64):
    return {"features": np.zeros((2, width)), "label": np.zeros(2, label_dtype)}


def test_dry_run_gives_output_shapes():
    assert te._dry_run(_values(metrics=[accuracy]), _zeros()) == [[10]]


def test_dry_run_names_feature_shape_mismatch_and_fix():
    with pytest.raises(InvalidArgumentError) as err:
        te._dry_run(_values(), _zeros(width=10))
    msg = str(err.value)
    assert "'features' as (2, 10)" in msg and "input_shapes" in msg and "mat1" in msg


def test_dry_run_applies_input_shapes():
    conv = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 6 * 6, 10))
    p = _values(model=conv, input_shapes=[[-1, 1, 8, 8]])
    p["optimizer"] = torch.optim.SGD(conv.parameters(), lr=0.1)
    assert te._dry_run(p, _zeros()) == [[10]]


def test_dry_run_float_class_labels_suggest_a_cast():
    with pytest.raises(InvalidArgumentError) as err:
        te._dry_run(_values(), _zeros(label_dtype=np.float64))
    msg = str(err.value)
    assert "label 'label' (2,) torch.float32" in msg and "cast('long')" in msg


def test_dry_run_output_count_and_scalar_loss_and_metric():
    p = _values(label_cols=["a", "b"])
    with pytest.raises(InvalidArgumentError, match="returns 1 output.* 2 columns"):
        te._dry_run(p, {"features": np.zeros((2, 64)), "a": np.zeros(2), "b": np.zeros(2)})
    p = _values(loss=lambda o, y: F.cross_entropy(o, y, reduction="none"))
    with pytest.raises(InvalidArgumentError, match="single number"):
        te._dry_run(p, _zeros())
    p = _values(metrics={"bad": lambda o, y: o.missing})
    with pytest.raises(InvalidArgumentError, match="metric 'bad' fails"):
        te._dry_run(p, _zeros())


def test_dry_run_leaves_the_model_in_training_mode():
    net = make_net()
    te._dry_run(_values(model=net, optimizer=torch.optim.SGD(net.parameters(), 0.1)), _zeros())
    assert net.training


# -- trainer pieces ----------------------------------------------------------------------------

def test_loss_with_sample_weights_and_weights():
    out = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]])
    y = torch.tensor([0, 0, 1])
    per_row = F.cross_entropy(out, y, reduction="none")
    w = torch.tensor([1.0, 0.0, 3.0])
    spec = trainer.LossSpec.build(F.cross_entropy, 1, None, weighted_rows=True)
    assert torch.isclose(spec([out], [y], w), (per_row * w).sum() / w.sum())
    spec = trainer.LossSpec.build(torch.nn.CrossEntropyLoss(), 1, [2.0], weighted_rows=True)
    assert torch.isclose(spec([out], [y], w), 2 * (per_row * w).sum() / w.sum())
    spec = trainer.LossSpec.build([F.mse_loss], 2, [1.0, 0.5], weighted_rows=False)
    a, b = torch.ones(3, 1), torch.zeros(3, 1)
    assert torch.isclose(spec([a, a], [b, a]), torch.tensor(1.0))


def test_align_labels_and_reshape():
    out = torch.zeros(4, 1)
    assert trainer.align_labels([out], [torch.zeros(4)], False)[0].shape == (4, 1)
    assert trainer.align_labels([out], [torch.zeros(4)], True)[0].shape == (4,)
    assert trainer.align_labels([torch.zeros(4, 3)], [torch.zeros(4, dtype=torch.long)],
                                False)[0].shape == (4,)
    t = torch.zeros(2, 64)
    assert trainer.reshape_to(t, [-1, 1, 8, 8]).shape == (2, 1, 8, 8)
    assert trainer.reshape_to(t, [1, 8, 8]).shape == (2, 1, 8, 8)
    x = trainer.to_tensor(np.zeros((2, 3), np.float64), "x", torch.float32)
    assert x.dtype == torch.float32
    assert trainer.to_tensor(np.zeros(2, np.int32), "y", torch.float32).dtype == torch.int64


def test_metric_names():
    def acc(o, y):
        return 0
    names = [n for n, _ in trainer.metric_names([acc, lambda o, y: 1, acc])]
    assert names == ["acc", "metric_1", "acc_"]
    assert [n for n, _ in trainer.metric_names({"top1": acc})] == ["top1"]


def test_checkpoint_round_trip(tmp_path):
    store = LocalStore(str(tmp_path))
    assert trainer.read_checkpoint(store, "r") is None
    state = {"format": trainer.CHECKPOINT_FORMAT, "epoch": 2, "model": make_net().state_dict(),
             "history": {"loss": [1.0, 0.5]}}
    trainer._write_checkpoint(store, "r", trainer.LAST_CHECKPOINT, state)
    back = trainer.read_checkpoint(store, "r")
    assert back["epoch"] == 2 and back["history"] == {"loss": [1.0, 0.5]}
    # A checkpoint of another architecture is refused on the driver, before any job.
    with pytest.raises(InvalidArgumentError, match="different model"):
        te.compatible_checkpoint(store, "r", make_net(hidden=8))
    assert te.compatible_checkpoint(store, "r", make_net())["epoch"] == 2


# -- restarts after a lost rank (the launch is a fake: no Spark) -------------------------------

def _launch(*causes):
    """A fake training launch that fails with a RankFailedError of each of ``causes`` in turn,
    then succeeds; ``.calls`` counts the launches."""
    def launch():
        launch.calls += 1
        if launch.calls <= len(causes):
            raise RankFailedError(f"spark_hvd.spark.run: rank 1 failed: boom {launch.calls}",
                                  {1: "tail"}, ranks=[1], cause=causes[launch.calls - 1],
                                  reason=f"boom {launch.calls}")
    launch.calls = 0
    return launch


@pytest.fixture(params=["torch", "keras"])
def restartable(request, tmp_path):
    """(estimator, p) with a checkpoint of epoch 2 of run 'r' in the store: what the shared
    restart loop needs of each framework."""
    store = LocalStore(str(tmp_path))
    p = {"store": store, "epochs": 5, "max_restarts": 3, "verbose": 1, "custom_objects": None}
    if request.param == "torch":
        p["model"] = make_net()
        trainer._write_checkpoint(store, "r", trainer.LAST_CHECKPOINT, {
            "format": trainer.CHECKPOINT_FORMAT, "epoch": 2, "history": {},
            "model": p["model"].state_dict()})
        return TorchEstimator(), p
    pytest.importorskip("keras")
    from spark_hvd.estimators import _keras_io, _trainer_keras
    p["model"] = make_keras_net()
    _trainer_keras.write_checkpoint(store, "r", _trainer_keras.LAST_CHECKPOINT,
                                    _keras_io.model_to_bytes(p["model"]),
                                    {"epoch": 2, "history": {}})
    return KerasEstimator(), p


def test_a_lost_rank_or_a_failed_collective_restarts_from_the_checkpoint(restartable, capsys):
    est, p = restartable
    name = type(est).__name__
    launch = _launch("process", "collective", "spark")
    est._train(p, "r", launch)
    assert launch.calls == 4
    assert capsys.readouterr().out.splitlines() == [
        f"{name}: rank 1 lost during epoch 3/5 (boom 1); restarting from the epoch 2 "
        f"checkpoint, attempt 2/4",
        f"{name}: a collective failed on rank 1 during epoch 3/5 (boom 2); restarting from the "
        f"epoch 2 checkpoint, attempt 3/4",
        f"{name}: rank 1 lost during epoch 3/5 (boom 3); restarting from the epoch 2 "
        f"checkpoint, attempt 4/4"]


@pytest.mark.parametrize("cause", ["function", "task", ""])
def test_errors_of_the_users_code_are_not_retried(restartable, cause, capsys):
    est, p = restartable
    launch = _launch(cause)
    with pytest.raises(RankFailedError) as err:
        est._train(p, "r", launch)
    assert launch.calls == 1 and err.value.message.endswith("boom 1")
    assert capsys.readouterr().out == ""


def test_restarts_exhausted_raise_the_last_failure_with_the_fix(restartable):
    est, p = restartable
    p["max_restarts"] = 1
    launch = _launch("process", "process", "process")
    with pytest.raises(RankFailedError) as err:
        est._train(p, "r", launch)
    assert launch.calls == 2
    e = err.value
    assert (e.ranks, e.cause, e.reason, e.failures) == ([1], "process", "boom 2", {1: "tail"})
    assert e.message.startswith(
        f"{type(est).__name__}: training failed on all 2 attempts (max_restarts=1), each time "
        f"with a lost rank or a failed collective; the checkpoint of epoch 2 and the training "
        f"data are kept in the store. Raise max_restarts (e.g. max_restarts=4)")
    assert "fit again with run_id='r'" in e.message
    assert e.message.endswith("The last failure:\nspark_hvd.spark.run: rank 1 failed: boom 2")


def test_restart_lines_without_checkpoint_or_rank_and_quiet(caplog, capsys):
    spark_failed = RankFailedError("x", cause="spark", reason="SparkException: executor lost")
    assert eb.restart_line("TorchEstimator", spark_failed, 0, 4, 2, 3) == (
        "TorchEstimator: the Spark job failed during epoch 1/4 (SparkException: executor "
        "lost); restarting from the start (no checkpoint yet), attempt 2/3")
    p = {"store": LocalStore("/tmp/unused-store"), "epochs": 4, "max_restarts": 1,
         "verbose": 0, "model": make_net()}
    with caplog.at_level("WARNING", logger=eb.__name__):
        TorchEstimator()._train(p, "no-such-run", _launch("process"))
    assert capsys.readouterr().out == ""
    assert [r.getMessage() for r in caplog.records] == [
        "TorchEstimator: rank 1 lost during epoch 1/4 (boom 1); restarting from the start (no "
        "checkpoint yet), attempt 2/2"]


# -- progress ----------------------------------------------------------------------------------

def test_progress_lines():
    assert bar(0, 10, 10) == "[>.........]" and bar(10, 10, 10) == "[==========]"
    assert format_metrics({"loss": 0.5, "accuracy": 0.25, "rank": 0}) == \
        "loss 0.5000  accuracy 0.2500  rank 0"
    now = [0.0]
    out = io.StringIO()
    p = EpochProgress(1, 3, 100, verbose=1, interval_s=10, stream=out, clock=lambda: now[0])
    p.update(1, lambda: 1.0)
    now[0] = 11.0
    p.update(50, lambda: 0.75)
    now[0] = 12.0
    p.update(60, lambda: 0.5)
    p.finish({"loss": 0.25})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("epoch 2/3  [==========>") and "50/100  loss 0.7500" in lines[0]
    assert "100/100  12.0s  loss 0.2500" in lines[1]
    out = io.StringIO()
    p = EpochProgress(0, 1, 40, verbose=2, stream=out, clock=lambda: 0.0)
    for s in range(1, 41):
        p.update(s, lambda: 0.0)
    assert len(out.getvalue().splitlines()) == 19  # every 2 steps but the last


# -- TorchModel pieces -------------------------------------------------------------------------

def test_model_output_columns_and_types():
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql.types import DoubleType
    assert tm.default_output_cols(["y"]) == ["y__output"]
    assert tm.default_output_cols([], 2) == ["prediction", "prediction_1"]
    m = TorchModel(model=make_net(), feature_cols=["f"], label_cols=["y"])
    assert m.getOutputCols() == ["y__output"]
    assert m.setOutputCols(["p"]).getOutputCols() == ["p"]
    assert isinstance(pu.output_type([]), DoubleType)
    assert isinstance(pu.output_type([1]), DoubleType)
    assert isinstance(pu.output_type([10]), VectorUDT)


def test_model_arrow_outputs():
    import pyarrow as pa
    vec = pu.to_arrow(np.arange(6, dtype=np.float64).reshape(3, 2), [2], pa)
    assert vec.type.names == ["type", "size", "indices", "values"]
    assert vec.field("values").to_pylist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    scalar = pu.to_arrow(np.arange(3, dtype=np.float64).reshape(3, 1), [1], pa)
    assert scalar.to_pylist() == [0.0, 1.0, 2.0]


def test_model_cache_loads_once_per_identity():
    import cloudpickle
    blob = cloudpickle.dumps(make_net())
    mb.MODEL_CACHE.clear()
    a = tm._cached_model(blob, "k1", torch.device("cpu"))
    b = tm._cached_model(blob, "k1", torch.device("cpu"))
    c = tm._cached_model(blob, "k2", torch.device("cpu"))
    assert a is b and a is not c and not a.training
    mb.MODEL_CACHE.clear()


def test_a_model_loaded_in_a_task_freezes_the_worker_s_heap_and_a_dropped_one_is_collected(
        monkeypatch):
    """In a Spark task, each model load ends with the worker's objects frozen out of the
    cyclic GC (pyspark's daemon collects after every task); a model dropped from the cache
    that sits in a reference cycle is still collected, at the next load; outside a task
    (here, as on the driver) nothing is frozen."""
    import gc
    import weakref

    class Cyclic:
        def __init__(self):
            self.me = self

    assert gc.get_freeze_count() == 0
    cache = mb.ModelCache(size=1)
    first = weakref.ref(cache.get("a", Cyclic))
    assert gc.get_freeze_count() == 0, "the driver's heap is left alone"
    monkeypatch.setattr(mb, "in_spark_task", lambda: True)
    try:
        cache.get("b", Cyclic)  # drops "a"
        assert first() is None
        assert gc.get_freeze_count() > 1000, "torch's objects, among others"
        second = weakref.ref(cache.get("b", Cyclic))
        assert second() is not None and gc.get_freeze_count() > 1000
        cache.get("c", Cyclic)  # drops "b", frozen since its load: unfrozen and collected
        assert second() is None
    finally:
        gc.unfreeze()


def test_a_model_loaded_in_a_task_keeps_the_zips_on_sys_path_read_once(monkeypatch, tmp_path):
    """pyspark 3.5 and 4.0 call importlib.invalidate_caches() at each task's start, which
    made Python's zip importers parse their archive's directory again (pyspark.zip: 57 % of
    a worker's busy time in bench/transform.py on 4.0).  After a model load in a task, a
    zip on sys.path is read again only when it changed; outside a task nothing changes."""
    import importlib
    import sys
    import zipfile
    import zipimport

    archive = tmp_path / "mods.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("steady_zip_probe/__init__.py", "VALUE = 1\n")
        z.writestr("steady_zip_probe/sub.py", "")
    path = str(archive)
    monkeypatch.syspath_prepend(path)
    reads = []
    real_read = zipimport._read_directory
    monkeypatch.setattr(zipimport, "_read_directory", lambda a: reads.append(a) or real_read(a))
    try:
        import steady_zip_probe.sub  # the package gets an importer of its own
        assert steady_zip_probe.VALUE == 1
        package_path = steady_zip_probe.__path__[0]
        cache = mb.ModelCache(size=1)
        cache.get("driver", object)
        assert type(sys.path_importer_cache[path]) is zipimport.zipimporter, "not in a task"
        monkeypatch.setattr(mb, "in_spark_task", lambda: True)
        cache.get("task", object)
        for entry in (path, package_path):  # the archive and its package's own importer
            assert isinstance(sys.path_importer_cache[entry], mb.SteadyZipImporter), entry
        del reads[:]
        importlib.invalidate_caches()
        assert reads == [], "an unchanged archive is not read again"

        with zipfile.ZipFile(archive, "w") as z:  # changed: read again, new modules found
            z.writestr("steady_zip_probe/__init__.py", "VALUE = 2\n")
            z.writestr("steady_zip_probe/added.py", "WHAT = 'added'\n")
        importlib.invalidate_caches()
        assert path in reads
        assert importlib.import_module("steady_zip_probe.added").WHAT == "added"
    finally:
        import gc
        gc.unfreeze()
        for name in ("steady_zip_probe.added", "steady_zip_probe.sub", "steady_zip_probe"):
            sys.modules.pop(name, None)
        for entry in [k for k in sys.path_importer_cache if k.startswith(path)]:
            del sys.path_importer_cache[entry]


# -- Horovod's estimator names -------------------------------------------------------------

class _Backend:
    """Horovod's SparkBackend as far as the estimators read it."""

    def num_processes(self):
        return 3


def test_horovod_names_are_taken():
    p = _values(backend=_Backend(), backend_env={"A": "1"}, train_reader_num_workers=4,
                val_reader_num_workers=2, inmemory_cache_all=True)
    assert p["backend"].num_processes() == 3 and p["backend_env"] == {"A": "1"}
    assert (p["train_reader_num_workers"], p["val_reader_num_workers"]) == (4, 2)
    assert p["inmemory_cache_all"] is True
    model = TorchModel(feature_columns=["f"], label_columns=["y"])
    assert model.getFeatureColumns() == ["f"] == model.getFeatureCols()
    assert model.getLabelColumns() == ["y"]
    with pytest.raises(InvalidArgumentError, match="one parameter"):
        TorchModel(feature_columns=["f"], feature_cols=["g"])


@pytest.mark.parametrize("kw, needle", [
    (dict(backend=object()), "num_proc=N"),
    (dict(backend_env={"A": 1}), "dict of str to str"),
    (dict(train_reader_num_workers=0), "train_reader_num_workers"),
])
def test_horovod_names_check_their_values(kw, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        _values(**kw)


def test_transformation_fn_gets_and_returns_a_pandas_dataframe_as_horovod():
    from spark_hvd.estimators._trainer_common import apply_transformation

    batch = {"features": np.arange(12, dtype=np.float32).reshape(3, 4),
             "label": np.array([0, 1, 2])}
    seen = []

    def fn(df):
        seen.append((type(df).__name__, list(df.columns), len(df)))
        df["label"] = df["label"] * 10
        df["features"] = df["features"].map(lambda a: a * 2)
        return df

    out = apply_transformation(fn, batch)
    assert seen == [("DataFrame", ["features", "label"], 3)]
    assert np.array_equal(out["features"], batch["features"] * 2)
    assert out["features"].shape == (3, 4) and np.array_equal(out["label"], [0, 10, 20])
    with pytest.raises(TypeError, match="pandas DataFrame"):
        apply_transformation(lambda df: {"x": 1}, batch)


def test_inmemory_cache_all_reads_once_then_reshuffles_from_memory():
    from spark_hvd.estimators._trainer_common import CachedReader

    class Counting:
        reads = 0

        def __len__(self):
            return 3

        def epoch(self, epoch):
            Counting.reads += 1
            for i in range(3):
                yield {"x": np.arange(4 * i, 4 * i + (4 if i < 2 else 2))}

        def close(self):
            pass

    cached = CachedReader(Counting(), shuffle=True, seed=5)
    first = [b["x"] for b in cached.epoch(0)]
    second = [b["x"] for b in cached.epoch(1)]
    third = [b["x"] for b in cached.epoch(2)]
    assert Counting.reads == 1 and len(cached) == 3
    assert [len(b) for b in second] == [len(b) for b in first] == [4, 4, 2]
    assert sorted(np.concatenate(second)) == sorted(np.concatenate(first)) == list(range(10))
    assert not np.array_equal(np.concatenate(second), np.concatenate(third))  # a new order
    plain = CachedReader(Counting(), shuffle=False, seed=5)
    list(plain.epoch(0))
    assert np.array_equal(np.concatenate([b["x"] for b in plain.epoch(1)]), np.arange(10))


# -- bad input found by the dry run, the label check, or a rank while training ----------------

def test_a_wrong_input_shape_is_an_error_naming_the_param_torch_and_keras():
    """``input_shapes`` that cannot hold a row (the issue's [-1, 7] for 8-wide rows) is an
    InvalidArgumentError naming the param, the column and both sizes, not torch's or numpy's
    reshape error from the dry run; a full shape that would change the batch size too."""
    from spark_hvd.estimators import keras_estimator as ke
    for shape, holds in (([[-1, 7]], "holds 7"), ([[7]], "holds 7"), ([[-1, 16]], "holds 16"),
                         ([[3, -1]], "holds a multiple of 3")):
        with pytest.raises(InvalidArgumentError) as err:
            te._dry_run(_values(input_shapes=shape), _zeros(width=8))
        msg = str(err.value)
        assert msg.startswith(f"input_shapes gives column 'features' the shape {shape[0]}, "
                              f"which {holds} element(s) per row, but each row of 'features' "
                              f"has 8 (shape (8,))"), msg
    te._dry_run(_values(input_shapes=[[64]]), _zeros())  # 64 per row: fits
    keras = pytest.importorskip("keras")
    p = KerasEstimator(model=make_keras_net(), optimizer=keras.optimizers.SGD(0.1),
                       loss="sparse_categorical_crossentropy", feature_cols=["features"],
                       label_cols=["label"], label_shapes=[[-1, 2]],
                       store=LocalStore("/tmp/unused-store"))._values()
    KerasEstimator()._check_params(p)
    with pytest.raises(InvalidArgumentError, match=r"^label_shapes gives column 'label' the "
                                                   r"shape \[-1, 2\], which holds 2"):
        ke._dry_run(p, _zeros())


class _Meta:
    """A DataMeta as far as the label check reads it: each column's value range."""

    def __init__(self, **ranges):
        from spark_hvd.estimators.materialize import ColumnMeta
        self.columns = {c: ColumnMeta(c, "int64", (), "scalar", "bigint", r)
                        for c, r in ranges.items()}


def _keras_p(**kw):
    keras = pytest.importorskip("keras")
    args = dict(model=make_keras_net(), optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
                store=LocalStore("/tmp/unused-store"))
    args.update(kw)
    p = KerasEstimator(**args)._values()
    KerasEstimator()._check_params(p)
    return p


@pytest.mark.parametrize("framework", ["torch", "keras"])
def test_labels_outside_the_models_classes_are_found_before_training(framework):
    """After the write, the loss runs on the smallest and largest label value (from the
    Parquet footers): a class index the model has no output for is an InvalidArgumentError
    naming the column and its values; labels in range pass; transformation_fn skips it."""
    from spark_hvd.estimators import keras_estimator as ke
    if framework == "torch":
        est, p, dry_run = TorchEstimator(), _values(metrics=[accuracy]), te._dry_run
    else:
        est, p, dry_run = KerasEstimator(), _keras_p(), ke._dry_run
    dry_run(p, _zeros())
    est._check_label_values(p, _zeros(), _Meta(label=(0, 9)))
    est._check_label_values(p, _zeros(), _Meta(label=None))  # no statistics: no check
    for lo, hi, bad in ((0, 10, 10), (-1, 9, -1)):
        with pytest.raises(InvalidArgumentError) as err:
            est._check_label_values(p, _zeros(), _Meta(label=(lo, hi)))
        msg = str(err.value)
        assert msg.startswith(f"the label column(s) hold values the loss refuses: 'label' from "
                              f"{lo} to {hi} (over every row"), msg
        assert "per-row output shape(s) (10,)" in msg and "StringIndexer" in msg
        assert ("out of bounds" if framework == "torch" else
                f"Received a label value of {bad} which is outside the valid range of "
                f"[0, 10)") in msg, msg
        assert "function_node" not in msg and "[Op:" not in msg
    p["transformation_fn"] = lambda df: df
    est._check_label_values(p, _zeros(), _Meta(label=(0, 10)))


def test_a_rank_names_the_label_columns_when_the_loss_refuses_a_batch():
    """On a rank (labels the driver could not check: transformation_fn, no statistics) a
    loss refusing the labels is a TrainingInputError naming the columns, the batch's values,
    the outputs, the epoch and the step."""
    from spark_hvd.estimators._trainer_common import TrainingInputError
    runner = trainer._EpochRunner.__new__(trainer._EpochRunner)
    runner.c = type("C", (), {"label_cols": ["label"]})()
    runner.loss_spec = trainer.LossSpec.build(F.cross_entropy, 1, None, False)
    runner.rank = 1
    out = torch.zeros(3, 10)
    with pytest.raises(TrainingInputError) as err:
        runner._loss([out], [torch.tensor([0, 12, 3])], None, 1, 4, "training")
    assert str(err.value).startswith(
        "the loss fails on the labels of 'label' in a training batch at epoch 2, step 5 (rank "
        "1) ('label' from 0 to 12; the model's output(s) (3, 10)): IndexError: Target 12 is out "
        "of bounds."), str(err.value)
    assert float(runner._loss([out], [torch.tensor([0, 9, 3])], None, 0, 0, "training")) > 0


@pytest.mark.parametrize("buffered", [False, True])
def test_a_nonfinite_loss_stops_the_rank_naming_epoch_and_step(buffered):
    """terminate_on_nan (the default): the first NaN or infinite training loss raises,
    naming the epoch and step; buffered (what a GPU does, here on CPU tensors), the losses
    are looked at every CHECK_EVERY steps and at the epoch's end, and the error still
    names the first bad step."""
    from spark_hvd.estimators._trainer_common import LossWatch, TrainingInputError
    assert TorchEstimator().getTerminateOnNan() is True
    watch = LossWatch(True, rank=1, epochs=3, steps=100, buffered=buffered)
    for step in range(100):
        watch.step(torch.tensor(0.5, requires_grad=True), 0, step)
    watch.flush()
    with pytest.raises(TrainingInputError) as err:
        for step in range(100):
            watch.step(torch.tensor(float("nan") if step >= 39 else 0.5), 1, step)
        watch.flush()
    assert str(err.value).startswith(
        "the training loss is nan at epoch 2/3, step 40/100 (rank 1); training stopped there "
        "(terminate_on_nan=True). Fix: lower the learning rate"), str(err.value)
    assert step == (LossWatch.CHECK_EVERY - 1 if buffered else 39)  # when it was looked at
    off = LossWatch(False, rank=0, epochs=1, steps=2, buffered=buffered)
    off.step(torch.tensor(float("inf")), 0, 0)
    off.flush()


def test_weights_made_nonfinite_by_the_epochs_last_step_stop_the_rank_before_its_checkpoint():
    """A finite loss with an infinite gradient (sqrt at 0) makes the weights NaN at the
    epoch's last step, where no later loss shows it: the epoch's end names the parameter."""
    from spark_hvd.estimators._trainer_common import LossWatch, TrainingInputError
    net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    watch = LossWatch(True, rank=1, epochs=2, steps=5)
    watch.check_weights(net.named_parameters(), 0)  # finite: nothing
    loss = torch.sqrt(net(torch.zeros(1, 2)).sum() * 0)  # 0, with an infinite gradient
    watch.step(loss, 1, 4)
    loss.backward()
    optimizer.step()
    with pytest.raises(TrainingInputError) as err:
        watch.check_weights(net.named_parameters(), 1)
    assert str(err.value).startswith(
        "the model's weights are non-finite at epoch 2/2, step 5/5 (rank 1; finite at the "
        "epoch's start): '0.weight', '0.bias', '1.weight' and 1 more, though the training "
        "loss stayed finite"), err.value
    LossWatch(False, rank=0, epochs=2, steps=5).check_weights(net.named_parameters(), 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
def test_a_nonfinite_loss_on_a_gpu_is_found_without_a_sync_per_step():
    from spark_hvd.estimators._trainer_common import LossWatch, TrainingInputError
    watch = LossWatch(True, rank=0, epochs=1, steps=10)
    losses = torch.tensor([0.5] * 6 + [float("inf")] * 4, device="cuda")
    for step in range(10):
        watch.step(losses[step], 0, step)
    with pytest.raises(TrainingInputError, match="the training loss is inf at epoch 1/1, "
                                                 "step 7/10"):
        watch.flush()


def test_keras_stops_at_the_first_nonfinite_loss_naming_epoch_and_step():
    keras = pytest.importorskip("keras")  # noqa: F841
    from spark_hvd.estimators import _trainer_keras as ktrainer
    from spark_hvd.estimators._trainer_common import TrainingInputError
    config = type("C", (), {"terminate_on_nan": True, "epochs": 4})()
    coordinator = ktrainer._Coordinator(None, config, rank=0, steps=30)
    model = make_keras_net()
    model.stop_training = False  # as model.fit sets it
    coordinator.set_model(model)
    coordinator.on_epoch_begin(2)
    coordinator.on_train_batch_end(0, {"loss": 0.7})
    with pytest.raises(TrainingInputError, match=r"^the training loss is inf at epoch 3/4, "
                                                 r"step 12/30 \(rank 0\)"):
        coordinator.on_train_batch_end(11, {"loss": float("inf")})



def test_keras_stops_when_the_weights_turn_nonfinite_behind_a_finite_loss():
    """A NaN input behind a ReLU leaves Keras' loss finite and the weights NaN: the weights
    are looked at every CHECK_EVERY steps and at the epoch's end (before its checkpoint),
    and the error names the epoch, the step, the last step they were finite and the weight."""
    pytest.importorskip("keras")
    from spark_hvd.estimators import _trainer_keras as ktrainer
    from spark_hvd.estimators._trainer_common import TrainingInputError

    class OneRank:
        Max = "max"

        @staticmethod
        def allreduce(x, op, name):
            return x
    every = ktrainer._Coordinator.CHECK_EVERY
    config = type("C", (), {"terminate_on_nan": True, "epochs": 2})()
    model = make_keras_net()
    model.stop_training = False
    kernel = model.trainable_weights[0]
    for steps, bad_after, found in ((every + 36, every + 5, every + 36), (150, 40, every)):
        kernel.assign(np.zeros(kernel.shape, "float32"))
        coordinator = ktrainer._Coordinator(OneRank(), config, rank=1, steps=steps)
        coordinator.set_model(model)
        coordinator.on_epoch_begin(1)
        with pytest.raises(TrainingInputError) as err:
            for batch in range(steps):
                if batch == bad_after:
                    kernel.assign(np.full(kernel.shape, np.nan, "float32"))
                coordinator.on_train_batch_end(batch, {"loss": 0.5})
            coordinator.on_epoch_end(1)
        since = (f"finite after step {every}" if bad_after >= every
                 else "finite at the epoch's start")
        assert str(err.value).startswith(
            f"the model's weights are non-finite at epoch 2/2, step {found}/{steps} (rank 1; "
            f"{since}): '{kernel.path}', though the training loss stayed finite"), err.value
        assert "terminate_on_nan=True" in str(err.value)
    kernel.assign(np.zeros(kernel.shape, "float32"))  # finite: an epoch passes
    coordinator = ktrainer._Coordinator(OneRank(), config, rank=0, steps=10)
    coordinator.set_model(model)
    coordinator.on_epoch_begin(0)
    for batch in range(10):
        coordinator.on_train_batch_end(batch, {"loss": 0.5})
    coordinator.on_epoch_end(0)
    assert coordinator.checked == (0, 10) and not model.stop_training


def test_bad_input_a_rank_found_is_raised_as_invalid_argument(restartable):
    """A rank's TrainingInputError (NaN loss, labels refused) reaches the caller of fit as
    an InvalidArgumentError with the rank's message, not retried."""
    est, p = restartable
    text = "the training loss is nan at epoch 1/5, step 3/9 (rank 1); training stopped there"

    def launch():
        launch.calls += 1
        raise RankFailedError(f"spark_hvd.spark.run: rank 1 failed: TrainingInputError: {text}",
                              {1: "tail"}, ranks=[1], cause="function",
                              reason=f"TrainingInputError: {text}")
    launch.calls = 0
    with pytest.raises(InvalidArgumentError) as err:
        est._train(p, "r", launch)
    assert launch.calls == 1 and not isinstance(err.value, RankFailedError)
    assert str(err.value) == f"{type(est).__name__}: {text}"
    assert isinstance(err.value.__cause__, RankFailedError)


def test_fit_reports_where_its_time_went(capsys):
    now = [0.0]
    clock = FitClock(lambda: now[0])
    for phase, t in (("checks", 0.5), ("data", 2.0), ("launch", 9.0), ("checkpoints", 9.25)):
        now[0] = t
        clock.done(phase)
    clock.move("launch", "training", 5.0)
    clock.move("launch", "checkpoints", 0.5)
    now[0] = 10.0
    seconds = clock.report("TorchEstimator", verbose=1)
    assert capsys.readouterr().out == (
        "TorchEstimator.fit: 10.0 s (checks 0.5 s, data 1.5 s, launch 1.5 s, training 5.0 s, "
        "checkpoints 0.8 s)\n")
    assert seconds == {"checks": 0.5, "data": 1.5, "launch": 1.5, "training": 5.0,
                       "checkpoints": 0.75, "total": 10.0}
    clock.report("TorchEstimator", verbose=0)
    assert capsys.readouterr().out == ""


def test_a_rank_imports_no_pyspark(tmp_path):
    """What a rank unpickles and runs (a TrainConfig with its DataMeta and Store, the
    trainers) imports no pyspark: ``pyspark.ml``, which DataMeta's old module imported, took
    1-3 s of every rank's start."""
    import subprocess

    import cloudpickle

    from spark_hvd.estimators._trainer_common import TrainConfig
    from spark_hvd.estimators.materialize import ColumnMeta, DataMeta
    store = LocalStore(str(tmp_path))
    meta = DataMeta(key="k", train_path=store.join("t"), val_path=None, train_rows=4,
                    val_rows=0, columns={"x": ColumnMeta("x", "float32", (3,), "array",
                                                         "array<float>", None)},
                    feature_cols=["x"], label_cols=[], sample_weight_col=None, num_proc=2,
                    store=store)
    config = TrainConfig(
        run_id="r", store=store, meta=meta, objects=b"", feature_cols=["x"], label_cols=[],
        sample_weight_col=None, input_shapes=None, label_shapes=None, loss_weights=None,
        batch_size=2, val_batch_size=2, epochs=1, train_steps_per_epoch=None,
        validation_steps_per_epoch=None, shuffle=False, shuffle_buffer_size=None, seed=0,
        backward_passes_per_step=1, use_gpu=False, verbose=0, terminate_on_nan=True)
    code = ("import pickle, sys\n"
            "config = pickle.loads(sys.stdin.buffer.read())\n"
            "assert config.meta.columns['x'].shape == (3,)\n"
            "import spark_hvd.estimators._trainer_torch, spark_hvd.estimators._trainer_common\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pyspark'))\n")
    proc = subprocess.run([sys.executable, "-c", code], input=cloudpickle.dumps(config),
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert proc.stdout.decode().strip() == "[]", proc.stdout.decode()
