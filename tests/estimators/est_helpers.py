"""Helpers shared by the estimator tests (the model, the metric, store listings)."""

import os
import signal
import sys

import cloudpickle
from pyspark.ml import Transformer
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import DefaultParamsReadable, DefaultParamsWritable

# Executors cannot import this file: ship what it defines (the model, the metric) by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def accuracy(output, label):
    """Share of rows whose highest output is the label."""
    return (output.argmax(dim=1) == label).float().mean()


def make_net(seed=0, hidden=64):
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


def torch_estimator(store, **kw):
    """The digits TorchEstimator: make_net, Adam, cross-entropy and accuracy, 2 ranks, 4
    epochs, 10% validation; ``kw`` overrides any param."""
    import torch
    import torch.nn.functional as F
    from spark_hvd.estimators import TorchEstimator
    net = make_net()
    args = dict(num_proc=2, store=store, model=net,
                optimizer=torch.optim.Adam(net.parameters(), lr=1e-2), loss=F.cross_entropy,
                metrics=[accuracy], feature_cols=["features"], label_cols=["label"],
                batch_size=32, epochs=4, validation=0.1, random_seed=1, verbose=1)
    args.update(kw)
    return TorchEstimator(**args)


def kill_once(net, rank, step, marker):
    """``net`` wrapped so that, while training, rank ``rank`` SIGKILLs its own process at its
    ``step``-th forward pass, once: it creates the file ``marker`` first, and a process that
    finds it there trains on undisturbed (the restarted run, or another fit)."""
    import torch

    class KillOnce(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.steps = net, 0

        def forward(self, x):
            if self.training:
                self.steps += 1
                if self.steps == step and not os.path.exists(marker):
                    import spark_hvd
                    if spark_hvd.rank() == rank:
                        open(marker, "x").close()
                        os.kill(os.getpid(), signal.SIGKILL)
            return self.net(x)

    return KillOnce()


def bad_input(train_df, case):
    """``(df, estimator kwargs, part of the error)`` for a bad-input case of the estimator
    tests, made from the digits training DataFrame."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F
    if case == "misspelt":
        return train_df, dict(feature_cols=["featrues"]), "did you mean 'features'"
    if case == "string_type":
        return (train_df.withColumn("label", F.concat(F.lit("c"), F.col("label"))), {},
                "label column 'label' has type string; index it first")
    if case == "empty":
        return train_df.limit(0), {}, "the DataFrame is empty"
    if case == "shape":
        return (train_df.withColumn("features", F.slice(vector_to_array("features"), 1, 10)),
                {}, "'features' as (2, 10)")
    if case == "num_proc":
        return train_df, dict(num_proc=3), "num_proc=3 is more than the 2 tasks"
    if case == "float_label":
        return train_df.withColumn("label", F.col("label").cast("double")), {}, "cast('long')"
    if case == "duplicate":  # a join's output: two columns named 'label'
        return (train_df.select("*", F.col("label").alias("label")), {},
                "the DataFrame has 2 columns named 'label' (the label column)")
    if case == "input_shapes":
        return (train_df, dict(input_shapes=[[-1, 7]]),
                "input_shapes gives column 'features' the shape [-1, 7], which holds 7 "
                "element(s) per row, but each row of 'features' has 64")
    if case == "nonfinite":  # element 3 of every row labelled 7 is NaN
        return (nan_rows(train_df), {}, "column 'features' has the non-finite value NaN at "
                                        "element 3 in a row of partition")
    if case == "label_range":  # label 9 written as 10: the model has 10 outputs, 0..9
        return (train_df.withColumn("label", F.when(F.col("label") == 9, 10)
                                    .otherwise(F.col("label"))), {},
                "the label column(s) hold values the loss refuses: 'label' from 0 to 10")
    raise ValueError(case)


def nan_rows(train_df):
    """The digits with NaN as element 3 of the features of every row labelled 7."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F
    return train_df.withColumn("features", F.transform(
        vector_to_array("features"), lambda x, i: F.when((i == 3) & (F.col("label") == 7),
                                                         F.lit(float("nan"))).otherwise(x)))


def listing(root):
    """Every path under root (relative), sorted; [] when root does not exist."""
    out = []
    for base, dirs, files in os.walk(root):
        out += [os.path.relpath(os.path.join(base, n), root) for n in dirs + files]
    return sorted(out)


def make_keras_net(seed=0, hidden=64, compile_with=None):
    """A Keras MLP for the 64 digits pixels (logits); compiled when ``compile_with`` is a dict
    of compile arguments."""
    import keras
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(hidden, activation="relu"),
                              keras.layers.Dense(10)])
    if compile_with is not None:
        model.compile(**compile_with)
    return model


def at_batch(rank, epoch, batch, action):
    """A Keras callback that calls ``action(model)`` on rank ``rank`` alone, after batch
    ``batch`` of epoch ``epoch`` (0-based, as Keras counts)."""
    import keras

    import spark_hvd

    class AtBatch(keras.callbacks.Callback):
        def on_epoch_begin(self, e, logs=None):
            self.epoch = e

        def on_train_batch_end(self, b, logs=None):
            if spark_hvd.rank() == rank and self.epoch == epoch and b == batch:
                action(self.model)

    return AtBatch()


def stop_mid_epoch(rank, epoch, batch):
    """Sets model.stop_training on one rank only, in the middle of an epoch (the estimator
    must stop every rank at that epoch's end, not hang)."""
    return at_batch(rank, epoch, batch, lambda model: setattr(model, "stop_training", True))


def kill_at_batch(rank, epoch, batch, marker):
    """SIGKILLs rank ``rank``'s process at that batch, once: it creates the file ``marker``
    first, and a process that finds it there trains on (the restarted run)."""
    def kill(model):
        if not os.path.exists(marker):
            open(marker, "x").close()
            os.kill(os.getpid(), signal.SIGKILL)
    return at_batch(rank, epoch, batch, kill)


def tensorboard_scalars(logdir):
    """``{tag: [(step, value)]}`` of the event files in ``logdir``, read as TensorBoard
    reads them (its plugin event accumulator)."""
    from tensorboard.backend.event_processing import plugin_event_accumulator
    from tensorboard.util import tensor_util
    acc = plugin_event_accumulator.EventAccumulator(logdir)
    acc.Reload()
    return {tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto)))
                  for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"]}


def mlflow_runs(run_id, experiment=None):
    """The MLflow runs tagged with the Store's ``run_id`` (in ``experiment``, else in all)."""
    import mlflow
    where = dict(experiment_names=[experiment]) if experiment else \
        dict(search_all_experiments=True)
    return mlflow.search_runs(filter_string=f"tags.`spark_hvd.run_id` = '{run_id}'",
                              output_format="list", **where)


def assert_mlflow_history(mlflow_run_id, history):
    """The MLflow run has every epoch of ``history`` once, step = epoch index."""
    import mlflow
    client = mlflow.MlflowClient()
    for key, values in history.items():
        logged = client.get_metric_history(mlflow_run_id, key)
        assert sorted((m.step, m.value) for m in logged) == list(enumerate(values)), key


def assert_tensorboard_history(logdir, history):
    """The event files in the local directory ``logdir`` (a run's logs) hold every epoch of
    ``history`` once, step = epoch index."""
    import numpy as np
    scalars = tensorboard_scalars(logdir)
    assert set(scalars) == set(history)
    for key, values in history.items():
        got = sorted(scalars[key])
        assert [s for s, _ in got] == list(range(len(values))), (key, got)
        np.testing.assert_allclose([v for _, v in got], values, rtol=1e-6)


class LabelCast(Transformer, DefaultParamsReadable, DefaultParamsWritable):
    """A Python pipeline stage (no JVM side): casts the ``label`` column to ``dtype``."""

    dtype = Param(Params._dummy(), "dtype", "the label's new type", TypeConverters.toString)

    def __init__(self, dtype="long"):
        super().__init__()
        self._set(dtype=dtype)

    def _transform(self, df):
        from pyspark.sql import functions as F
        return df.withColumn("label", F.col("label").cast(self.getOrDefault(self.dtype)))
