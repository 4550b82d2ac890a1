"""The rank side of TorchEstimator (``_trainer_torch.train``) as 2 real ranks started by
spark-hvdrun, without Spark: Parquet written by pyarrow, a hand-made DataMeta."""

import json
import os
import re
import subprocess
import sys

import cloudpickle
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from est_helpers import accuracy, make_net
from spark_hvd.estimators import LocalStore, TorchEstimator
from spark_hvd.estimators import _trainer_torch as trainer
from spark_hvd.estimators.materialize import ColumnMeta, DataMeta
from spark_hvd.exceptions import InvalidArgumentError

cloudpickle.register_pickle_by_value(sys.modules[__name__])

RUN = """
import importlib, pickle, sys
train = importlib.import_module(sys.argv[1]).train
print("result", train(pickle.load(open(sys.argv[2], "rb"))), flush=True)
"""


class StopAfter:
    """Records every call on every rank; asks to stop after ``epochs`` epochs."""

    def __init__(self, epochs, out_dir):
        self.epochs, self.out_dir = epochs, out_dir

    def on_epoch_end(self, epoch, logs):
        with open(os.path.join(self.out_dir, f"rank{logs['rank']}_epoch{epoch}"), "w") as f:
            json.dump({k: v for k, v in logs.items() if k != "stop_training"}, f)
        if epoch + 1 >= self.epochs and logs["rank"] == 1:  # one rank is enough to stop all
            logs["stop_training"] = True


def _write(path, x, y, w):
    os.makedirs(path)
    n = len(y)
    feats = pa.ListArray.from_arrays(pa.array(np.arange(0, (n + 1) * 64, 64, dtype=np.int32)),
                                     pa.array(x.reshape(-1)))
    pq.write_table(pa.table({"features": feats, "label": pa.array(y, pa.int64()),
                             "w": pa.array(w)}), os.path.join(path, "part-0.parquet"),
                   row_group_size=128)


def _digits_data(tmp_path):
    """Digits in Parquet as materialize would leave them (1500 training rows, the rest for
    validation, weight 2 on odd labels) with their DataMeta; (x, y, w, store, meta)."""
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    x = x / 16.0
    w = np.where(y % 2 == 0, 1.0, 2.0)
    store = LocalStore(str(tmp_path / "store"))
    _write(str(tmp_path / "data" / "train"), x[:1500], y[:1500], w[:1500])
    _write(str(tmp_path / "data" / "val"), x[1500:], y[1500:], w[1500:])
    meta = DataMeta(
        key="k", train_path=str(tmp_path / "data" / "train"),
        val_path=str(tmp_path / "data" / "val"), train_rows=1500, val_rows=len(y) - 1500,
        columns={"features": ColumnMeta("features", "float64", (64,), "vector", "vector"),
                 "label": ColumnMeta("label", "int64", (), "scalar", "bigint"),
                 "w": ColumnMeta("w", "float64", (), "scalar", "double")},
        feature_cols=["features"], label_cols=["label"], sample_weight_col="w", num_proc=2,
        store=store)
    return x, y, w, store, meta


class SeesDataFrames:
    """A Horovod-style transformation_fn: gets and returns a pandas DataFrame (unchanged),
    and leaves a mark for each rank that saw one."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def __call__(self, df):
        import pandas as pd

        assert isinstance(df, pd.DataFrame), type(df)
        assert df["features"].map(len).eq(64).all()
        open(os.path.join(self.out_dir, f"df_pid{os.getpid()}"), "w").close()
        return df


def _train_two_ranks(module, tmp_path, run_id, store, meta, objects, timeout, env=None,
                     extra=None):
    """``module.train`` on 2 ranks through spark-hvdrun: batches of 32, weights "w",
    backward_passes_per_step=2, terminate_on_nan, up to 5 epochs; the finished process."""
    config = trainer.TrainConfig(
        run_id=run_id, store=store, meta=meta, objects=cloudpickle.dumps(objects),
        feature_cols=["features"], label_cols=["label"], sample_weight_col="w",
        input_shapes=None, label_shapes=None, loss_weights=None, batch_size=32,
        val_batch_size=100, epochs=5, train_steps_per_epoch=None,
        validation_steps_per_epoch=None, shuffle=True, shuffle_buffer_size=None, seed=3,
        backward_passes_per_step=2, use_gpu=False, verbose=1, terminate_on_nan=True,
        extra=extra or {})
    cfg = tmp_path / "config.pkl"
    cfg.write_bytes(cloudpickle.dumps(config))
    return subprocess.run([sys.executable, "-m", "spark_hvd.runner", "-np", "2",
                           sys.executable, "-c", RUN, module, str(cfg)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _sgd_objects(net, calls, **more):
    """The user's objects of a TorchEstimator run of ``net``: SGD, cross-entropy, accuracy
    and a callback stopping after 2 epochs (recording in ``calls``); ``more`` adds to them."""
    return dict(dict(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.5),
                     loss=torch.nn.CrossEntropyLoss(), loss_constructors=None,
                     metrics={"acc": accuracy}, callbacks=[StopAfter(2, str(calls))],
                     transformation_fn=None, gradient_compression=None,
                     lr_scheduler_fn=None), **more)


def test_two_ranks_weights_accumulation_scheduler_callbacks_and_checkpoints(tmp_path):
    x, y, w, store, meta = _digits_data(tmp_path)
    calls = tmp_path / "calls"
    calls.mkdir()
    objects = _sgd_objects(
        make_net(), calls, transformation_fn=SeesDataFrames(str(calls)),
        gradient_compression=__import__("spark_hvd.torch", fromlist=["x"]).Compression.fp16,
        lr_scheduler_fn=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
    # inmemory_cache_all: the second epoch comes from memory, with the same batches
    proc = _train_two_ranks("spark_hvd.estimators._trainer_torch", tmp_path, "ranks", store,
                            meta, objects, timeout=240, extra={"inmemory_cache_all": True})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out

    # 24 batches per rank per epoch: 24 steps, 12 optimizer steps of 2 backward passes.
    assert "[0] epoch 1/5  [====================] 24/24" in out
    assert "a callback stopped training after epoch 2" in out and "epoch 3/5" not in out
    # Rank 0 also says how long it trained and wrote checkpoints (fit's time breakdown).
    assert "[0] result {'rank': 0, 'epochs': 2, 'start_epoch': 0, 'seconds': {'training': " \
        in out
    assert sorted(c for c in os.listdir(calls) if c.startswith("rank")) == \
        ["rank0_epoch0", "rank0_epoch1", "rank1_epoch0", "rank1_epoch1"]
    assert len([c for c in os.listdir(calls) if c.startswith("df_pid")]) == 2  # both ranks
    # Every rank saw the same (allreduced) epoch metrics.
    logs = [json.loads((calls / f"rank{r}_epoch1").read_text()) for r in (0, 1)]
    assert {k: v for k, v in logs[0].items() if k != "rank"} == \
        {k: v for k, v in logs[1].items() if k != "rank"}
    assert set(logs[0]) == {"loss", "acc", "val_loss", "val_acc", "rank"}

    state = trainer.read_checkpoint(store, "ranks")
    assert state["epoch"] == 2 and state["monitor"] == "val_loss"
    assert state["scheduler"]["last_epoch"] == 2
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.125)
    assert state["history"]["loss"][1] < state["history"]["loss"][0]
    best = trainer.read_checkpoint(store, "ranks", trainer.BEST_CHECKPOINT)
    assert best["best_epoch"] == int(np.argmin(state["history"]["val_loss"])) + 1
    history = json.loads(open(os.path.join(store.get_logs_path("ranks"),
                                           "history.json")).read())
    assert history == {"epochs": 2, "history": state["history"]}
    # The epoch's validation metrics are over every validation row once, across both ranks:
    # they match the checkpoint's weights evaluated here on the whole validation set.
    model = make_net()
    model.load_state_dict(state["model"])
    with torch.no_grad():
        out = model(torch.tensor(x[1500:], dtype=torch.float32))
    target = torch.tensor(y[1500:])
    assert float((out.argmax(1) == target).float().mean()) == \
        pytest.approx(state["history"]["val_acc"][-1], abs=1e-6)
    per_row = F.cross_entropy(out, target, reduction="none").double()
    weights = torch.tensor(w[1500:])
    # The loss is the weighted mean of per-row losses on each batch, averaged by rows.
    assert state["history"]["val_loss"][-1] == pytest.approx(
        float((per_row * weights).sum() / weights.sum()), rel=0.05)
    assert state["history"]["val_acc"][-1] > 0.3  # learned something (chance: 0.1)



class Float16Outputs(torch.nn.Module):
    """``make_net()`` whose forward fails unless it runs under autocast(float16)."""

    def __init__(self):
        super().__init__()
        self.net = make_net()

    def forward(self, x):
        out = self.net(x)
        if out.dtype != torch.float16:
            raise AssertionError(f"the forward pass ran in {out.dtype}, not under autocast")
        return out


class CompiledGraphs:
    """Writes how many graphs torch.compile made in this rank's process."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_end(self, logs):
        from torch._dynamo.utils import counters
        with open(os.path.join(self.out_dir, f"graphs{logs['rank']}"), "w") as f:
            f.write(str(counters["stats"]["unique_graphs"]))


def test_two_ranks_compiled_model_under_fp16_autocast_with_a_loss_scale(tmp_path):
    """TorchEstimator's torch_compile and mixed_precision='fp16' on the rank side: each rank
    trains through torch.compile (aot_eager: inductor's C++ build would add ~15 s per rank
    here; the optimizer sees the same hooks either way, tests/torch/rank_compile_amp.py)
    under autocast(float16) with a GradScaler, 2 backward passes per step."""
    x, y, w, store, meta = _digits_data(tmp_path)
    calls = tmp_path / "calls"
    calls.mkdir()
    # The objects as TorchEstimator hands them to its ranks, with the two params.
    objects = _sgd_objects(Float16Outputs(), calls)
    objects["callbacks"].append(CompiledGraphs(str(calls)))
    est = TorchEstimator(**{k: v for k, v in objects.items() if v is not None},
                         torch_compile={"backend": "aot_eager"}, mixed_precision="fp16")
    objects = cloudpickle.loads(est._objects(est._values()))
    assert (objects["torch_compile"], objects["mixed_precision"]) == \
        ({"backend": "aot_eager"}, "fp16")
    assert TorchEstimator(torch_compile=True).getTorchCompile() == {}
    for bad, needle in ((dict(torch_compile="yes"), "dict of torch.compile keyword"),
                        (dict(mixed_precision="fp8"), "['bf16', 'fp16'], got 'fp8'")):
        with pytest.raises(InvalidArgumentError, match=re.escape(needle)):
            TorchEstimator(**bad)
    proc = _train_two_ranks("spark_hvd.estimators._trainer_torch", tmp_path, "amp", store,
                            meta, objects, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "a callback stopped training after epoch 2" in out
    for rank in (0, 1):
        assert int((calls / f"graphs{rank}").read_text()) >= 1, "no compiled graph"
    state = trainer.read_checkpoint(store, "amp")
    assert all(v.dtype == torch.float32 for v in state["model"].values())
    assert list(state["model"]) == ["net.0.weight", "net.0.bias", "net.2.weight",
                                    "net.2.bias"]  # the model's own names, not _orig_mod.*
    history = state["history"]
    assert history["loss"][1] < history["loss"][0], history
    # The checkpoint's weights, evaluated here in float32, score what validation said.
    model = make_net()
    model.load_state_dict({k[len("net."):]: v for k, v in state["model"].items()})
    with torch.no_grad():
        pred = model(torch.tensor(x[1500:], dtype=torch.float32)).argmax(1).numpy()
    assert float((pred == y[1500:]).mean()) == pytest.approx(history["val_acc"][-1], abs=0.02)
    assert history["val_acc"][-1] > 0.5, history
    # The loss scale resumes with the rest: from a checkpoint whose scaler is one good step
    # from growing (scale 4, the growth count one short of its interval) the resumed fit's
    # first step doubles it to 8; a fresh scaler (65,536) could not end there.
    scaler = state["scaler"]
    assert scaler["scale"] > 0 and scaler["_growth_tracker"] >= 0, scaler
    scaler.update(scale=4.0, _growth_tracker=scaler["growth_interval"] - 1)
    trainer._write_checkpoint(store, "amp", [trainer.LAST_CHECKPOINT], state)
    objects = dict(objects, torch_compile=None, callbacks=[StopAfter(3, str(calls))])
    proc = _train_two_ranks("spark_hvd.estimators._trainer_torch", tmp_path, "amp", store,
                            meta, objects, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "a callback stopped training after epoch 3" in out
    resumed = trainer.read_checkpoint(store, "amp")
    assert (resumed["epoch"], len(resumed["history"]["loss"])) == (3, 3), resumed["history"]
    assert resumed["scaler"]["scale"] == 8.0, resumed["scaler"]


def _keras_recorder(out_dir, stop_after):
    """A Keras callback writing every rank's epoch logs; rank 1 alone asks to stop after
    ``stop_after`` epochs (every rank must stop there)."""
    import keras

    import spark_hvd

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            rank = spark_hvd.rank()
            with open(os.path.join(out_dir, f"rank{rank}_epoch{epoch}"), "w") as f:
                json.dump({k: float(v) for k, v in (logs or {}).items()}, f)
            if epoch + 1 >= stop_after and rank == 1:
                self.model.stop_training = True

    return Record()


def test_keras_two_ranks_weights_accumulation_compression_and_checkpoints(tmp_path):
    """The rank side of KerasEstimator (``_trainer_keras.train``), 2 ranks without Spark:
    sample weights, backward_passes_per_step=2, fp16 gradient compression,
    terminate_on_nan, a user callback stopping one rank, checkpoints and history."""
    import keras

    from est_helpers import make_keras_net
    from spark_hvd.estimators import _keras_io as keras_io
    from spark_hvd.estimators import _trainer_keras as ktrainer
    import spark_hvd.tensorflow as hvd_tf

    x, y, w, store, meta = _digits_data(tmp_path)
    calls = tmp_path / "calls"
    calls.mkdir()
    net = make_keras_net(seed=1)
    objects = dict(
        model=keras_io.model_to_bytes(net),
        optimizer=keras_io.optimizer_config(keras.optimizers.SGD(0.2, momentum=0.5)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], callbacks=[_keras_recorder(str(calls), 2)],
        custom_objects=None, transformation_fn=None,
        gradient_compression=hvd_tf.Compression.fp16)
    proc = _train_two_ranks("spark_hvd.estimators._trainer_keras", tmp_path, "kranks", store,
                            meta, objects, timeout=300,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]

    # 24 batches of 32 per rank per epoch; rank 1's callback stops both after epoch 2.
    assert "[0] epoch 1/5  [====================] 24/24" in out, out[-4000:]
    assert "a callback stopped training after epoch 2" in out and "epoch 3/5" not in out
    # Rank 0 also says how long it trained and wrote checkpoints (fit's time breakdown).
    assert "[0] result {'rank': 0, 'epochs': 2, 'start_epoch': 0, 'seconds': {'training': " \
        in out
    assert sorted(os.listdir(calls)) == ["rank0_epoch0", "rank0_epoch1", "rank1_epoch0",
                                         "rank1_epoch1"]
    # MetricAverageCallback: every rank's user callback saw the same epoch logs.
    logs = [json.loads((calls / f"rank{r}_epoch1").read_text()) for r in (0, 1)]
    assert logs[0] == pytest.approx(logs[1], rel=1e-6)
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(logs[0])

    found = ktrainer.read_checkpoint(store, "kranks")
    assert found is not None
    data, state = found
    assert state["epoch"] == 2 and state["history"]["loss"][1] < state["history"]["loss"][0]
    assert ktrainer.read_checkpoint(store, "kranks", ktrainer.BEST_CHECKPOINT) is not None
    history = json.loads(open(os.path.join(store.get_logs_path("kranks"),
                                           "history.json")).read())
    assert history == {"epochs": 2, "history": state["history"]}
    # The checkpoint is a .keras file that predicts what its history says.
    model = keras.models.load_model(_keras_file(tmp_path, data), compile=False)
    pred = np.asarray(model.predict_on_batch(x[1500:].astype(np.float32))).argmax(1)
    accuracy = float((pred == y[1500:]).mean())
    assert accuracy > 0.5  # chance: 0.1; two short epochs of SGD on digits
    # Keras' weighted val accuracy is per batch, averaged over ranks: close to, not equal to,
    # the plain accuracy of the whole validation set.
    assert state["history"]["val_accuracy"][-1] == pytest.approx(accuracy, abs=0.1)


def _keras_file(tmp_path, data):
    path = tmp_path / "ckpt.keras"
    path.write_bytes(data)
    return str(path)
