"""SyncBatchNormalization: Keras batch normalization whose training statistics cover the
batches of every rank (Horovod's ``hvd.SyncBatchNormalization``).

In training, each rank computes its batch's per-channel mean and mean of squares; one
Sum-allreduce, divided by the size, gives the ranks' average of each, and the variance is
E[x^2] - E[x]^2, as Horovod computes it (every rank's batch weighs the same, so give the
ranks batches of one size). Differentiable through the allreduce. With one rank, with a
mask, or in inference it is Keras' BatchNormalization.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from spark_hvd._runtime import size
from spark_hvd.tensorflow import mpi_ops


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` with statistics over every rank's batch; takes
    the same arguments (``synchronized`` must stay False: that is Keras' own
    tf.distribute mechanism)."""

    def _moments(self, inputs, mask):
        mean, variance = super()._moments(inputs, mask)
        if mask is not None or size() <= 1:
            return mean, variance
        dtype = mean.dtype
        mean32 = tf.cast(mean, tf.float32)
        stats = tf.stack([mean32, tf.cast(variance, tf.float32) + tf.square(mean32)])
        total = mpi_ops.allreduce(stats, op=mpi_ops.Sum,
                                  name=f"SyncBatchNormalization.{self.name}")
        group_mean, group_mean_sq = tf.unstack(total / float(size()))
        return (tf.cast(group_mean, dtype),
                tf.cast(group_mean_sq - tf.square(group_mean), dtype))
