"""Rank checks of the host functions, the fallback where spark_hvd's asynchronous
TensorFlow kernels cannot be built (SPARK_HVD_TF_KERNELS=host): every op, eager and in a
tf.function, the error classes eagerly, and size-dependent factors read when the graph runs.
They run in rank_ops.py's launch, each check switching this process to the host functions
for its own duration (``host_functions``: what the setting makes ``_kernels`` decide)."""

import contextlib
import functools

import tensorflow as tf

import rank_ops
import spark_hvd.tensorflow as hvd
from spark_hvd.exceptions import TensorMismatchError
from spark_hvd.tensorflow import _async, _kernels


def _no_kernels():
    raise AssertionError("a host-function check reached spark_hvd's TensorFlow kernels "
                         "(_async._lib): the host path was not taken")


@contextlib.contextmanager
def _host_functions():
    """What SPARK_HVD_TF_KERNELS=host makes ``_kernels`` decide; any use of the kernels
    meanwhile fails the check."""
    state = _kernels._State
    saved = (state.decided, state.ops, state.reason, _async._lib)
    state.decided, state.ops, state.reason = True, None, "SPARK_HVD_TF_KERNELS=host (the test's)"
    _async._lib = _no_kernels
    try:
        yield
    finally:
        state.decided, state.ops, state.reason, _async._lib = saved


def host_functions(check):
    """Runs ``check`` with collectives as host functions."""
    @functools.wraps(check)
    def wrapper():
        with _host_functions():
            return check()
    return wrapper


@host_functions
def check_collectives_run_as_host_functions():
    assert _kernels.ops() is None and "host" in _kernels.reason(), _kernels.reason()
    graph = tf.function(lambda x: hvd.allreduce(x)).get_concrete_function(
        tf.TensorSpec([2], tf.float32)).graph
    types = {op.type for op in graph.get_operations()}
    assert "PyFunc" in types and not any(t.startswith("SparkHvd") for t in types), types


@host_functions
def check_every_op_eager_and_in_tf_function():
    rank_ops.compare_all(rank_ops.run_ops(tf.float32), rank_ops.expected_ops(tf.float32),
                         "eager")
    got = tf.function(rank_ops.run_ops)(tf.float32)
    rank_ops.compare_all(got, rank_ops.expected_ops(tf.float32), "tf.function")


@host_functions
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


@host_functions
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
