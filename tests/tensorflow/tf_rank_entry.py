"""Rank side of tf_harness: ``tf_rank_entry.py FILE::FN...`` (under spark-hvdrun).

Pins TensorFlow to one thread each way (the test machine has two cores for two ranks),
initializes spark_hvd, then runs the named check functions (FILE relative to this
directory) with _ranks.run_checks, seeding Keras before each. A check may return a
JSON-able value, reported as ``result``. A failed assertion leaves the ranks in step
and the next check runs; any other error ends the rank.
"""

import os
import sys

import keras
import tensorflow as tf

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/_ranks.py

import _ranks  # noqa: E402


def main() -> None:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import spark_hvd.tensorflow as hvd

    hvd.init()
    _ranks.run_checks(HERE, sys.argv[1:], hvd.rank(),
                      before_each=lambda: keras.utils.set_random_seed(1234),
                      fatal=lambda exc: not isinstance(exc, AssertionError))
    hvd.shutdown()


if __name__ == "__main__":
    main()
