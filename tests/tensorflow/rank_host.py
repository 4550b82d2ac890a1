"""Rank checks of the host functions, the fallback where spark_hvd's asynchronous
TensorFlow kernels cannot be built (run with SPARK_HVD_TF_KERNELS=host): every op, eager
and in a tf.function, the error classes eagerly, and size-dependent factors read when the
graph runs."""

import tensorflow as tf

import rank_ops
import spark_hvd.tensorflow as hvd
from spark_hvd.exceptions import TensorMismatchError
from spark_hvd.tensorflow import _kernels


def check_collectives_run_as_host_functions():
    assert _kernels.ops() is None and "host" in _kernels.reason(), _kernels.reason()
    graph = tf.function(lambda x: hvd.allreduce(x)).get_concrete_function(
        tf.TensorSpec([2], tf.float32)).graph
    types = {op.type for op in graph.get_operations()}
    assert "PyFunc" in types and not any(t.startswith("SparkHvd") for t in types), types


def check_every_op_eager_and_in_tf_function():
    rank_ops.compare_all(rank_ops.run_ops(tf.float32), rank_ops.expected_ops(tf.float32),
                         "eager")
    got = tf.function(rank_ops.run_ops)(tf.float32)
    rank_ops.compare_all(got, rank_ops.expected_ops(tf.float32), "tf.function")


def check_eager_errors_are_tensorflows_classes():
    r, n = hvd.rank(), hvd.size()
    if n < 2:
        return
    try:
        hvd.allreduce(tf.ones([5 if r == n - 1 else 3]), name="host.mismatch")
    except tf.errors.FailedPreconditionError as exc:
        assert isinstance(exc.__cause__, TensorMismatchError), repr(exc.__cause__)
    else:
        raise AssertionError("the mismatch did not raise")


def check_size_dependent_factors_are_read_when_the_graph_runs():
    """The size Python reports is changed after tracing: the host functions read it at
    each run."""
    n = hvd.size()
    step = rank_ops.size_dependent_step()
    before = step()
    process_set = type(hvd.global_process_set)
    real_size = process_set.size
    process_set.size = lambda self: 4 * n if self is hvd.global_process_set else real_size(self)
    try:
        after = step()
    finally:
        process_set.size = real_size
    assert step.experimental_get_tracing_count() == 1
    rank_ops.same_size_dependent_values(before, n)
    rank_ops.same_size_dependent_values(after, 4 * n)
