"""Rank checks: training with DistributedGradientTape and the Keras DistributedOptimizer,
and the Keras callbacks.

Equivalence checks train the same model twice in each rank: distributed (this rank's
share of every batch, gradients reduced across ranks) and, as the reference, alone on the
full batches with a plain optimizer. With mean losses and equal shares the two must agree
to float32 rounding, at any number of ranks.
"""

import os
import shutil
import tempfile
import warnings

import keras
import numpy as np
import tensorflow as tf

import spark_hvd.tensorflow as hvd
import spark_hvd.tensorflow.keras as khvd

TOL = 1e-5
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def rn():
    return hvd.rank(), hvd.size()


def data(rows, features=8, classes=3, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(rows, features).astype(np.float32)
    w = rng.randn(features, classes).astype(np.float32)
    y = (x @ w).argmax(axis=1).astype(np.int32)
    return x, y


def make_model(seed=0, features=8, classes=3):
    model = keras.Sequential([keras.Input((features,)),
                              keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(classes)])
    rng = np.random.RandomState(seed)
    model.set_weights([rng.randn(*w.shape).astype(np.float32) * 0.3
                       for w in model.get_weights()])
    return model


def shard(array, batch):
    """This rank's rows: the r-th of n equal slices of every global batch of ``batch`` rows."""
    r, n = rn()
    local = batch // n
    parts = []
    for start in range(0, len(array), batch):
        parts.append(array[start + r * local:start + (r + 1) * local])
    return np.concatenate(parts)


def max_diff(a_weights, b_weights):
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(a_weights, b_weights))


def gather_equal(values):
    """Every rank's values, to compare after the collectives."""
    return hvd.allgather_object([np.asarray(v).tolist() for v in values])


# -- DistributedGradientTape ------------------------------------------------------------

def train_tape(optimizer_fn, steps, batch, graph):
    r, n = rn()
    x, y = data(steps * batch)
    dist, ref = make_model(), make_model()
    opt_d, opt_r = optimizer_fn(), optimizer_fn()

    def dist_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = LOSS(yb, dist(xb, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, dist.trainable_variables)
        opt_d.apply_gradients(zip(grads, dist.trainable_variables))

    def ref_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = LOSS(yb, ref(xb, training=True))
        grads = tape.gradient(loss, ref.trainable_variables)
        opt_r.apply_gradients(zip(grads, ref.trainable_variables))

    if graph:
        dist_step, ref_step = tf.function(dist_step), tf.function(ref_step)
    local = batch // n
    for i in range(steps):
        xb, yb = x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]
        dist_step(xb[r * local:(r + 1) * local], yb[r * local:(r + 1) * local])
        ref_step(xb, yb)
    return max_diff(dist.get_weights(), ref.get_weights())


def check_tape_equals_single_process_in_tf_function_sgd():
    diff = train_tape(lambda: keras.optimizers.SGD(0.2, momentum=0.9), steps=10, batch=16,
                      graph=True)
    assert diff <= TOL, diff
    return diff


def check_tape_equals_single_process_eager_adam():
    diff = train_tape(lambda: keras.optimizers.Adam(0.02), steps=10, batch=16, graph=False)
    assert diff <= TOL, diff
    return diff


def check_tape_options():
    r, n = rn()
    x, y = data(8)
    model = make_model()

    def grads(**kwargs):
        with tf.GradientTape(persistent=True) as tape:
            loss = LOSS(y, model(x * (r + 1)))
        out = hvd.DistributedGradientTape(tape, **kwargs).gradient(loss, model.trainable_variables)
        return [g.numpy() for g in out]

    avg = grads()
    summed = grads(op=hvd.Sum)
    predivided = grads(gradient_predivide_factor=float(n))
    fp16 = grads(compression=hvd.Compression.fp16)
    # a nested structure of sources keeps its structure; None stays None
    unused = tf.Variable(1.0)
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x))
    nested = hvd.DistributedGradientTape(tape).gradient(
        loss, {"w": model.trainable_variables[:2], "unused": unused})
    assert max_diff(summed, [a * n for a in avg]) <= 1e-4
    assert max_diff(predivided, avg) <= 1e-6
    assert max_diff(fp16, avg) <= 1e-2
    assert nested["unused"] is None and len(nested["w"]) == 2


# -- Keras DistributedOptimizer with model.fit -------------------------------------------

def fit_pair(optimizer_fn, batch=16, steps=10, epochs=2, model_fn=make_model, xy=None,
             **dist_kwargs):
    """Trains dist (this rank's shard, batch/n, DistributedOptimizer) and ref (full data,
    batch, plain optimizer) for the same number of steps; returns both models."""
    r, n = rn()
    x, y = xy if xy is not None else data(steps // epochs * batch)
    dist, ref = model_fn(), model_fn()
    dist.compile(khvd.DistributedOptimizer(optimizer_fn(), **dist_kwargs), LOSS)
    ref.compile(optimizer_fn(), LOSS)
    dist.fit(shard(x, batch), shard(y, batch), batch_size=batch // n, epochs=epochs,
             shuffle=False, verbose=0)
    ref.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return dist, ref


def check_fit_sgd_equals_single_process():
    dist, ref = fit_pair(lambda: keras.optimizers.SGD(0.2, momentum=0.9))
    diff = max_diff(dist.get_weights(), ref.get_weights())
    assert int(dist.optimizer.iterations) == 10
    assert diff <= TOL, diff
    return diff


def check_fit_adam_equals_single_process():
    dist, ref = fit_pair(lambda: keras.optimizers.Adam(0.02))
    diff = max_diff(dist.get_weights(), ref.get_weights())
    assert diff <= TOL, diff
    return diff


def check_fit_steps_per_execution_and_run_eagerly():
    r, n = rn()
    x, y = data(64)
    results = {}
    for name, kwargs in (("steps_per_execution=2", {"steps_per_execution": 2}),
                         ("run_eagerly", {"run_eagerly": True})):
        dist, ref = make_model(), make_model()
        dist.compile(khvd.DistributedOptimizer(keras.optimizers.SGD(0.2)), LOSS, **kwargs)
        ref.compile(keras.optimizers.SGD(0.2), LOSS)
        dist.fit(shard(x, 16), shard(y, 16), batch_size=16 // n, epochs=1, shuffle=False,
                 verbose=0)
        ref.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        results[name] = max_diff(dist.get_weights(), ref.get_weights())
    assert max(results.values()) <= TOL, results
    return results


def check_fit_sparse_embedding_gradients():
    def embedding_model():
        model = keras.Sequential([keras.Input((3,), dtype="int32"),
                                  keras.layers.Embedding(20, 4), keras.layers.Flatten(),
                                  keras.layers.Dense(3)])
        rng = np.random.RandomState(1)
        model.set_weights([rng.randn(*w.shape).astype(np.float32) * 0.3
                           for w in model.get_weights()])
        return model

    rng = np.random.RandomState(2)
    xy = (rng.randint(0, 20, size=(80, 3)).astype(np.int32),
          rng.randint(0, 3, size=80).astype(np.int32))
    diffs = []
    for sparse_as_dense in (False, True):
        dist, ref = fit_pair(lambda: keras.optimizers.SGD(0.5), model_fn=embedding_model,
                             xy=xy, sparse_as_dense=sparse_as_dense)
        diffs.append(max_diff(dist.get_weights(), ref.get_weights()))
    assert max(diffs) <= TOL, diffs
    return diffs


def check_backward_passes_per_step():
    r, n = rn()
    k, local, updates = 2, 4, 5
    x, y = data(updates * k * local * n)
    # reference batch i = the k local batches of every rank used for update i
    dist = make_model()
    opt = khvd.DistributedOptimizer(keras.optimizers.SGD(0.3), backward_passes_per_step=k,
                                    average_aggregated_gradients=True)
    dist.compile(opt, LOSS)
    dist.fit(shard(x, local * n), shard(y, local * n), batch_size=local, epochs=1,
             shuffle=False, verbose=0)
    ref = make_model()
    ref.compile(keras.optimizers.SGD(0.3), LOSS)
    ref.fit(x, y, batch_size=k * local * n, epochs=1, shuffle=False, verbose=0)
    diff = max_diff(dist.get_weights(), ref.get_weights())
    assert int(opt.iterations) == updates * k, int(opt.iterations)
    assert diff <= TOL, diff
    return diff


def check_jit_compile_model_trains_with_one_warning():
    r, n = rn()
    x, y = data(64, seed=r)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        histories, models = [], []
        for epochs in (4, 1):
            model = make_model()
            model.compile(khvd.DistributedOptimizer(keras.optimizers.Adam(0.05)), LOSS,
                          jit_compile=True)
            histories.append(model.fit(x, y, batch_size=16, epochs=epochs, verbose=0).history)
            models.append(model)
        model.evaluate(x, y, verbose=0)
    ours = [w for w in caught if "DistributedOptimizer" in str(w.message)
            and "jit_compile" in str(w.message)]
    weights = gather_equal(models[0].get_weights())
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert models[0].jit_compile and models[1].jit_compile  # kept for evaluate/predict
    assert histories[0]["loss"][-1] < histories[0]["loss"][0], histories[0]
    assert all(w == weights[0] for w in weights), "ranks diverged"


def check_optimizer_identity_config_and_load_model():
    r, n = rn()
    adam = keras.optimizers.Adam(0.01, beta_1=0.8)
    opt = khvd.DistributedOptimizer(adam)
    assert isinstance(opt, keras.optimizers.Adam) and type(opt).__name__ == "Adam"
    assert khvd.is_distributed(opt) and not khvd.is_distributed(adam)
    assert opt.get_config() == adam.get_config()
    ser = keras.optimizers.serialize(opt)
    assert ser["class_name"] == "Adam", ser
    assert type(keras.optimizers.deserialize(ser)) is keras.optimizers.Adam
    x, y = data(32)
    model = make_model()
    model.compile(opt, LOSS)
    model.fit(shard(x, 16), shard(y, 16), batch_size=16 // n, epochs=1, verbose=0)
    tmp = tempfile.mkdtemp(prefix=f"tf_rank{r}_")
    path = os.path.join(tmp, "model.keras")
    try:
        model.save(path)
        plain = keras.models.load_model(path)
        loaded = khvd.load_model(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert type(plain.optimizer) is keras.optimizers.Adam
    assert khvd.is_distributed(loaded.optimizer)
    assert isinstance(loaded.optimizer, keras.optimizers.Adam)
    assert int(loaded.optimizer.iterations) == int(opt.iterations) == 2
    assert max_diff(loaded.get_weights(), model.get_weights()) == 0
    loaded.fit(shard(x, 16), shard(y, 16), batch_size=16 // n, epochs=1, verbose=0)
    after = gather_equal(loaded.get_weights())
    assert int(loaded.optimizer.iterations) == 4
    assert all(w == after[0] for w in after), "ranks diverged after load_model"


def check_other_optimizer_wrappers():
    r, n = rn()
    x, y = data(8)
    # LossScaleOptimizer inside: scaled gradients are reduced, then unscaled
    model = make_model()
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    model.compile(khvd.DistributedOptimizer(lso), LOSS)
    model.fit(x * (r + 1), y, batch_size=8, epochs=1, verbose=0)
    lso_weights = gather_equal(model.get_weights())
    # a tf.compat.v1 optimizer through spark_hvd.tensorflow.DistributedOptimizer
    v = tf.Variable([1.0, 2.0])
    v1 = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0))
    gv = v1.compute_gradients(lambda: tf.reduce_sum(v * float(r + 1)), var_list=[v])
    assert all(w == lso_weights[0] for w in lso_weights), "ranks diverged (LossScale)"
    np.testing.assert_allclose(gv[0][0].numpy(), [(n + 1) / 2] * 2, rtol=1e-6)
    assert isinstance(v1, tf.compat.v1.train.GradientDescentOptimizer)


# -- callbacks -----------------------------------------------------------------------------

class RecordLR(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.values = []

    def on_train_batch_end(self, batch, logs=None):
        self.values.append(float(np.asarray(self.model.optimizer.learning_rate)))


def check_learning_rate_warmup_values():
    r, n = rn()
    steps, warmup, epochs = 4, 2, 3
    x, y = data(steps * 4)
    model = make_model()
    model.compile(khvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), LOSS)
    rec = RecordLR()
    hist = model.fit(x, y, batch_size=4, epochs=epochs, verbose=0, shuffle=False, callbacks=[
        khvd.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=warmup), rec])
    expected = []
    for e in range(epochs):
        for b in range(steps):
            t = min(e + (b + 1) / steps, warmup)
            expected.append(0.4 / n * (1 + t * (n - 1) / warmup))
    np.testing.assert_allclose(rec.values, expected, rtol=1e-6)
    np.testing.assert_allclose(hist.history["learning_rate"], [expected[3], 0.4, 0.4],
                               rtol=1e-6)
    return rec.values


def check_learning_rate_schedule_values():
    x, y = data(16)
    model = make_model()
    model.compile(khvd.DistributedOptimizer(keras.optimizers.SGD(0.3)), LOSS)
    rec = RecordLR()
    model.fit(x, y, batch_size=8, epochs=4, verbose=0, callbacks=[
        khvd.callbacks.LearningRateScheduleCallback(0.2, lambda e: 0.5 ** e, start_epoch=1,
                                                    end_epoch=3), rec])
    linear = RecordLR()
    model.compile(khvd.DistributedOptimizer(keras.optimizers.SGD(0.3)), LOSS)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[
        khvd.callbacks.LearningRateScheduleCallback(1.0, lambda e: 0.1 * (1 + e),
                                                    staircase=False), linear])
    np.testing.assert_allclose(rec.values, [0.3, 0.3, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05],
                               rtol=1e-6)
    np.testing.assert_allclose(linear.values, [0.1, 0.15, 0.2, 0.25], rtol=1e-6)


class RecordRawLoss(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.values = []

    def on_epoch_end(self, epoch, logs=None):
        self.values.append(float(logs["loss"]))


def check_metric_average_callback():
    r, n = rn()
    x, y = data(32, seed=10 + r)  # different data per rank: different losses
    model = make_model()
    model.compile(khvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), LOSS)
    raw = RecordRawLoss()
    hist = model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                     callbacks=[raw, khvd.callbacks.MetricAverageCallback()])
    everyone = hvd.allgather_object(raw.values)
    expected = np.mean(np.array(everyone), axis=0)
    np.testing.assert_allclose(hist.history["loss"], expected, rtol=1e-6)
    if n > 1:
        assert len({tuple(v) for v in everyone}) == n, "ranks' raw losses should differ"


class RecordFirstWeights(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if not hasattr(self, "first"):
            self.first = [w.tolist() for w in self.model.get_weights()]


def check_broadcast_global_variables_callback():
    r, n = rn()
    x, y = data(32, seed=r)
    model = make_model(seed=100 + r)  # a different start on every rank
    model.compile(khvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), LOSS)
    first = RecordFirstWeights()
    model.fit(x, y, batch_size=8, epochs=2, verbose=0,
              callbacks=[khvd.callbacks.BroadcastGlobalVariablesCallback(0), first])
    start = hvd.allgather_object(first.first)
    weights = gather_equal(model.get_weights())
    opt_vars = gather_equal(model.optimizer.variables)
    root_start = [w.tolist() for w in make_model(seed=100).get_weights()]
    assert all(s == root_start for s in start), "ranks did not start from rank 0's weights"
    assert all(w == weights[0] for w in weights), "model weights differ across ranks"
    assert all(v == opt_vars[0] for v in opt_vars), "optimizer state differs across ranks"
