"""fit's MLflow record (``_mlflow``, driven through ``_log_to_mlflow`` with a hand-made
fitted model) and rank 0's TensorBoard event file (``_tensorboard``): no Spark."""

import logging
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from est_helpers import accuracy, make_net, tensorboard_scalars
from spark_hvd.estimators import LocalStore, Store, TorchEstimator, TorchModel
from spark_hvd.estimators import _mlflow
from spark_hvd.estimators import _tensorboard as tb
from spark_hvd.exceptions import InvalidArgumentError

ZEROS = {"features": np.zeros((2, 64)), "label": np.zeros(2, np.int64)}
HISTORY = {"loss": [2.0, 1.0, 0.5], "accuracy": [0.2, 0.6, 0.8], "val_loss": [2.1, 1.2, 0.7]}


def _estimator(**kw):
    net = make_net()
    args = dict(model=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.01),
                loss=F.cross_entropy, metrics=[accuracy], feature_cols=["features"],
                label_cols=["label"], store=LocalStore("/tmp/unused-store"), epochs=3)
    args.update(kw)
    return TorchEstimator(**args)


def _log(est, history=HISTORY, run_id="r1"):
    """What fit does after training, for a model trained to ``history``."""
    p = est._values()
    est._check_params(p)
    fitted = TorchModel(model=p["model"].eval(), history=history, feature_cols=["features"],
                        label_cols=["label"], run_id=run_id, output_shapes=[[10]])
    return est._log_to_mlflow(p, fitted, ZEROS)


# -- params ------------------------------------------------------------------------------------

def test_mlflow_params_are_checked():
    est = TorchEstimator()
    assert est.getMlflowLog() is True and est.getMlflowExperiment() is None
    assert est.setMlflowExperiment("exp").getMlflowExperiment() == "exp"
    for bad, needle in ((dict(mlflow_log="yes"), "mlflow_log must be True or False"),
                        (dict(mlflow_experiment=""), "mlflow_experiment must be a non-empty")):
        with pytest.raises(InvalidArgumentError, match=needle):
            TorchEstimator(**bad)
    est = _estimator(mlflow_log=None)  # Spark ML sets None unchecked: fit's checks catch it
    with pytest.raises(InvalidArgumentError, match="mlflow_log must be True or False"):
        est._check_params(est._values())


def test_params_as_text():
    est = _estimator(store=LocalStore("/tmp/some-store"), batch_size=16, validation=0.1,
                     backend_env={"AWS_SECRET_ACCESS_KEY": "s3cr3t", "OMP_NUM_THREADS": "2"})
    texts = _mlflow.param_texts(est._values(), list(est._param_specs))
    assert "mlflow_log" not in texts and "mlflow_experiment" not in texts
    assert texts["batch_size"] == "16" and texts["validation"] == "0.1"
    assert texts["optimizer"] == "Adam(lr=0.01)" and texts["loss"] == "cross_entropy"
    assert texts["metrics"] == "[accuracy]" and texts["model"] == "Sequential"
    assert texts["feature_cols"] == "['features']" and texts["store"] == "file:///tmp/some-store"
    assert texts["run_id"] == "None"
    assert texts["backend_env"] == "['AWS_SECRET_ACCESS_KEY', 'OMP_NUM_THREADS']"  # no values
    assert _mlflow.describe(list(range(1000))).endswith("...")
    assert len(_mlflow.describe(list(range(1000)))) == _mlflow.MAX_PARAM_CHARS
    # A param left unset that fit filled in (Keras' compiled optimizer) is logged as used.
    keras_config = {"class_name": "SGD", "config": {"learning_rate": 0.1, "momentum": 0.0}}
    assert _mlflow.param_texts({"optimizer": None, "_optimizer": keras_config},
                               ["optimizer"]) == {"optimizer": "SGD(learning_rate=0.1)"}


# -- MLflow ------------------------------------------------------------------------------------

def test_preload_imports_the_flavor_and_opens_the_store_once_in_the_background(
        mlflow_tracking_uri, monkeypatch):
    """What the first logging of a process would wait for (imports, the store, MLflow's
    map of distributions) is done by one background thread per flavor, started by fit."""
    pytest.importorskip("mlflow")
    monkeypatch.setattr(_mlflow, "_preloaded", {})
    monkeypatch.delitem(sys.modules, "mlflow.pytorch", raising=False)
    _mlflow.preload("mlflow.pytorch")
    thread = _mlflow._preloaded["mlflow.pytorch"]
    thread.join(120)
    assert not thread.is_alive() and "mlflow.pytorch" in sys.modules
    from mlflow.utils import requirements_utils
    assert requirements_utils._MODULES_TO_PACKAGES is not None
    _mlflow.preload("mlflow.pytorch")  # imported now: nothing more
    assert _mlflow._preloaded["mlflow.pytorch"] is thread


@pytest.fixture
def mlflow(mlflow_tracking_uri):
    mlflow = pytest.importorskip("mlflow")
    assert mlflow.get_tracking_uri() == mlflow_tracking_uri
    yield mlflow
    while mlflow.active_run() is not None:
        mlflow.end_run()


def _steps(client, run_id, key):
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def test_a_new_run_in_the_experiment_with_params_metrics_tag_and_model(mlflow, monkeypatch):
    """...and the model's pip requirements written from what the driver has loaded
    (``_mlflow.requirements``): MLflow's own inference, which loads the model in a
    subprocess (7-12 s a fit), is never called."""
    from mlflow.utils import environment, requirements_utils
    inferred = []

    def infer(*args, **kwargs):
        inferred.append(args)
        raise AssertionError("MLflow inferred the requirements")
    for module in (environment, requirements_utils):  # the one called, where it is bound
        monkeypatch.setattr(module, "_infer_requirements", infer)
    est = _estimator(mlflow_experiment="tracking-unit")
    mlflow_run_id = _log(est)
    assert inferred == []
    expected = _mlflow.requirements("mlflow.pytorch", est.getModel().modules())
    assert [r.split("==")[0] for r in expected] == ["torch", "cloudpickle"]
    written = mlflow.artifacts.download_artifacts(
        f"runs:/{mlflow_run_id}/{_mlflow.MODEL_NAME}/requirements.txt")
    with open(written) as f:
        lines = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    assert [ln for ln in lines if not ln.startswith("mlflow")] == expected, lines
    client = mlflow.MlflowClient()
    run = client.get_run(mlflow_run_id)
    assert run.info.status == "FINISHED" and mlflow.active_run() is None
    assert client.get_experiment(run.info.experiment_id).name == "tracking-unit"
    assert run.data.tags[_mlflow.TAG_RUN_ID] == "r1"
    assert run.data.tags[_mlflow.TAG_ESTIMATOR] == "TorchEstimator"
    assert run.data.params["optimizer"] == "Adam(lr=0.01)" and run.data.params["epochs"] == "3"
    for key, values in HISTORY.items():
        assert _steps(client, mlflow_run_id, key) == dict(enumerate(values))
    model = mlflow.pyfunc.load_model(f"runs:/{mlflow_run_id}/{_mlflow.MODEL_NAME}")
    inputs = model.metadata.get_input_schema().inputs
    assert [(i.type, i.shape) for i in inputs] == [(np.dtype("float32"), (-1, 64))]
    x = np.random.default_rng(0).random((5, 64), dtype=np.float32)
    with torch.no_grad():
        expected = est.getModel()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(model.predict(x), expected, rtol=1e-6, atol=1e-6)


def test_the_active_run_is_reused_and_a_resumed_fit_adds_only_its_epochs(mlflow, monkeypatch):
    # The model's logging is the previous test's (the model's save costs a second here).
    monkeypatch.setattr(TorchEstimator, "_log_mlflow_model", lambda *args: None)
    client = mlflow.MlflowClient()
    with mlflow.start_run() as active:
        assert _log(_estimator(epochs=2), {k: v[:2] for k, v in HISTORY.items()}) == \
            active.info.run_id
        assert _log(_estimator(epochs=3)) == active.info.run_id
        assert mlflow.active_run().info.run_id == active.info.run_id  # left open
    history = client.get_metric_history(active.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == list(enumerate(HISTORY["loss"]))
    # MLflow refuses to change a param: the first fit's value stays.
    assert client.get_run(active.info.run_id).data.params["epochs"] == "2"


def test_mlflow_log_false_logs_nothing(mlflow):
    def runs():
        return [r.info.run_id for r in
                mlflow.search_runs(search_all_experiments=True, output_format="list")]
    before = runs()
    assert _log(_estimator(mlflow_log=False)) is None
    assert runs() == before and mlflow.active_run() is None


def test_a_failure_to_log_is_a_warning_naming_the_fix(mlflow, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "no-such-scheme://nowhere")
    with caplog.at_level(logging.WARNING, logger=_mlflow.__name__):
        assert _log(_estimator()) is None
    text = caplog.text
    assert "training is done and the model is in the store (run 'r1')" in text
    assert "no-such-scheme://nowhere" in text and "mlflow_log=False" in text


def test_without_mlflow_an_experiment_warns(monkeypatch, caplog):
    monkeypatch.setattr(_mlflow, "import_mlflow", lambda: None)
    with caplog.at_level(logging.WARNING, logger=_mlflow.__name__):
        assert _log(_estimator()) is None
        assert caplog.text == ""
        assert _log(_estimator(mlflow_experiment="exp")) is None
    assert "mlflow_experiment='exp' is set but mlflow does not import" in caplog.text


# -- TensorBoard -------------------------------------------------------------------------------

def _local_copy(store, directory, to):
    """The files of ``directory`` in ``store``, copied into the local directory ``to``."""
    to.mkdir(exist_ok=True)
    for name in store.listdir(directory):
        (to / name).write_bytes(store.read_bytes(f"{directory}/{name}"))
    return sorted(os.listdir(to))


@pytest.mark.parametrize("url", ["local", "memory://tb-events"])
def test_event_file_one_scalar_per_epoch(tmp_path, url):
    """Appended on a local store, rewritten whole on an object store (fsspec's memory)."""
    pytest.importorskip("tensorboard")
    store = LocalStore(str(tmp_path / "store")) if url == "local" else Store.create(url)
    assert store.object_store == (url != "local")
    events = tb.open_events(store, "r1", verbose=1)
    for epoch in range(3):
        events.add_epoch(epoch, {k: v[epoch] for k, v in HISTORY.items()})
        # Whole after each epoch: what a running tensorboard reads.
        names = _local_copy(store, store.get_logs_path("r1"), tmp_path / f"copy{epoch}")
        scalars = tensorboard_scalars(str(tmp_path / f"copy{epoch}"))
        assert {k: [s for s, _ in v] for k, v in scalars.items()} == \
            {k: list(range(epoch + 1)) for k in HISTORY}
    for key, values in HISTORY.items():
        np.testing.assert_allclose([v for _, v in scalars[key]], values, rtol=1e-6)
    assert names == [os.path.basename(events.path)]
    assert names[0].startswith(tb.EVENT_FILE_PREFIX + ".")


def test_records_are_framed_as_tensorboards_own_writer_frames_them():
    """The TFRecord framing, bit for bit TensorBoard's RecordWriter's (which rank 0 does not
    import: it pulls in tensorboard.summary and boto3)."""
    import io
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer.record_writer import RecordWriter
    for data in (b"", b"x", bytes(range(256)) * 3):
        buf = io.BytesIO()
        RecordWriter(buf).write(data)
        assert tb.record(data) == buf.getvalue()


def test_without_tensorboard_one_line_and_no_file(tmp_path, monkeypatch, capsys):
    for name in ["tensorboard"] + [m for m in sys.modules if m.startswith("tensorboard.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    store = LocalStore(str(tmp_path / "store"))
    assert tb.open_events(store, "r1", verbose=1) is None
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no TensorBoard event file for run 'r1'" in out
    assert "pip install tensorboard" in out and not os.path.exists(store.prefix)
