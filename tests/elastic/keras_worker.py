"""An elastic Keras worker (tests/elastic/test_elastic_keras.py): a one-layer model fitted
with KerasState and the elastic callbacks, a commit after every batch.

The worker at rank 1 of a 2-rank epoch SIGKILLs itself once, as batch 2 of epoch 1
begins. Each commit appends a record of the committed weights, each reset one of the
weights the state came back with. At the end the worker also checks TensorFlowState and
the reading of a graph's collective failure in this process (one TensorFlow import for
the whole suite).
"""

import os
import sys

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import spark_hvd.tensorflow as hvd_tf  # noqa: E402
import spark_hvd.tensorflow.keras as hvd  # noqa: E402
from elastic_harness import append_record, die_once, write_result  # noqa: E402
from spark_hvd.exceptions import PeerLostError  # noqa: E402

EPOCHS, SAMPLES, BATCH = 3, 64, 8
rng = np.random.default_rng(0)
X = rng.normal(size=(SAMPLES, 4)).astype("float32")
Y = X @ rng.normal(size=(4, 1)).astype("float32")

hvd.init()
keras.utils.set_random_seed(hvd.rank())  # different initial weights: sync equalizes them
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.5)),
              loss="mse")
state = hvd.elastic.KerasState(model, batch=0, epoch=0)


def weights():
    return [w.tolist() for w in model.get_weights()] + [int(model.optimizer.iterations.numpy())]


state.register_reset_callbacks([lambda: append_record(
    {"kind": "reset", "size": hvd.size(), "epoch": state.epoch, "weights": weights()})])


class Record(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if (state.epoch, batch, hvd.rank(), hvd.size()) == (1, 2, 1, 2):
            die_once("keras")

    def on_train_batch_end(self, batch, logs=None):  # after CommitStateCallback's
        append_record({"kind": "commit", "size": hvd.size(), "epoch": state.epoch,
                       "batch": state.batch, "weights": weights()})


callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
             hvd.elastic.UpdateBatchStateCallback(state),
             hvd.elastic.CommitStateCallback(state), Record()]


@hvd.elastic.run
def train(state):
    x, y = X[hvd.rank()::hvd.size()], Y[hvd.rank()::hvd.size()]
    state.model.fit(x, y, batch_size=BATCH, epochs=EPOCHS - state.epoch, shuffle=False,
                    callbacks=callbacks, verbose=0)


train(state)
result = {"rank": hvd.rank(), "size": hvd.size(), "epoch": state.epoch, "weights": weights(),
          "loss": float(model.evaluate(X, Y, verbose=0))}

# TensorFlowState: save, restore, sync (here at size 1) and its extra attributes.
v = tf.Variable([1.0, 2.0])
tf_state = hvd_tf.elastic.TensorFlowState([v], step=3)
v.assign([5.0, 6.0])
tf_state.step = 4
tf_state.restore()
restored = (v.numpy().tolist(), tf_state.step)
v.assign([7.0, 8.0])
tf_state.step = 5
tf_state.commit()
tf_state.sync()
result["tf_state"] = [restored, v.numpy().tolist(), tf_state.step]


# A host function's failure inside a graph is read back as the spark_hvd error it was.
def fail(_):
    raise PeerLostError("rank 3 lost", ranks=[3])


try:
    tf.function(lambda t: tf.numpy_function(fail, [t], [tf.float32]))(tf.constant(1.0))
except tf.errors.OpError as e:
    found = hvd_tf.elastic.collective_failure(e)
    result["graph_failure"] = [type(found).__name__, str(found)]
write_result(result)
