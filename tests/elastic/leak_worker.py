"""An elastic worker that resets many times in a row (tests/elastic/test_elastic_leaks.py).

Every rank raises HostsUpdatedInterrupt from inside the elastic function ``--resets``
times, so each time spark_hvd shuts down, joins a new epoch and initialises again. At the
start of each round (after the reset and the sync) it runs an allreduce and records this
process's thread count, open file descriptors and resident memory.
"""

import argparse
import gc
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import spark_hvd as hvd  # noqa: E402
import spark_hvd.elastic  # noqa: E402,F401 - hvd.elastic
from elastic_harness import append_record, write_result  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--resets", type=int, default=20)
args = parser.parse_args()


def resources() -> dict:
    gc.collect()
    with open("/proc/self/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")),
            "rss_kb": rss_kb}


hvd.init()
state = hvd.elastic.ObjectState(round=0)


@hvd.elastic.run
def train(state):
    total = hvd.allreduce(np.full(1024, state.round, dtype=np.float32), op=hvd.Sum,
                          name="leak.round")
    assert float(total[0]) == state.round * hvd.size(), total[:3]
    append_record({"round": state.round, "rank": hvd.rank(), "size": hvd.size(), **resources()})
    if state.round < args.resets:
        state.round += 1
        state.commit()
        raise hvd.HostsUpdatedInterrupt(False)


train(state)
write_result({"round": state.round, **resources()})
