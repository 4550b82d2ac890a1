"""Rank side of torch_harness: ``rank_entry.py FILE::FN...`` (under spark-hvdrun).

Pins torch to one thread, initializes spark_hvd, then runs each named function of its
rank module FILE (a path relative to this directory) with _ranks.run_checks, seeding
torch before each. On any failure the rank exits at once (status 1): its peers may be
blocked in a collective the failed rank will never join, and the launcher ends them.
"""

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/_ranks.py

import _ranks  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    import spark_hvd.torch as hvd

    hvd.init()
    _ranks.run_checks(HERE, sys.argv[1:], hvd.rank(), before_each=lambda: torch.manual_seed(1234))
    hvd.barrier()  # a rank that shuts down early would fail its peers' pending work
    hvd.shutdown()


if __name__ == "__main__":
    main()
