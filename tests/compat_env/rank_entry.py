"""Rank side of mxnet_harness: ``rank_entry.py FILE::FN...`` (under spark-hvdrun).

Initializes spark_hvd.mxnet, then runs each named function of its rank module with
_ranks.run_checks, seeding MXNet and numpy before each; a failure ends the rank at once
(its peers may wait in a collective it will never join)."""

import os
import sys

import mxnet as mx
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/_ranks.py

import _ranks  # noqa: E402


def main() -> None:
    import spark_hvd.mxnet as hvd

    hvd.init()

    def seed():
        mx.random.seed(1234)
        np.random.seed(1234)

    _ranks.run_checks(HERE, sys.argv[1:], hvd.rank(), before_each=seed)
    hvd.barrier()
    hvd.shutdown()


if __name__ == "__main__":
    main()
