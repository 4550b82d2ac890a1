"""An elastic worker whose collectives run on (fake) GPUs through the NCCL backend
(tests/elastic/test_elastic_gpu.py points the core at tests/fakes' CUDA runtime and NCCL).

Each step allreduces a device buffer holding ``rank + 1``; the sum must be the size's
triangular number. Worker 1 SIGKILLs itself once at step 12: the survivors' NCCL
communicator fails, the engine aborts it, and the next epoch builds a new one among them.
"""

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "multiproc"), os.path.dirname(HERE)]
import spark_hvd as hvd  # noqa: E402
import spark_hvd.elastic  # noqa: E402,F401 - hvd.elastic
import cases_nccl as gpu  # noqa: E402 - DeviceArray, allreduce_async on a device
from elastic_harness import append_record, die_once, worker_id, write_result  # noqa: E402

STEPS = 30

hvd.init()
state = hvd.elastic.ObjectState(step=0, total=0.0)


@hvd.elastic.run
def train(state):
    append_record({"kind": "start", "step": state.step, "size": hvd.size(), "rank": hvd.rank()})
    while state.step < STEPS:
        n = hvd.size()
        h = gpu.allreduce_async(np.full(16, hvd.rank() + 1, np.float32), f"gpu.step{state.step}")
        got = hvd.synchronize(h)
        assert np.all(got == n * (n + 1) / 2), (got[:3], n)
        state.total += float(got[0])
        state.step += 1
        if state.step == 12 and worker_id() == 1:
            die_once("gpu")
        if state.step % 5 == 0:
            state.commit()


train(state)
write_result({"step": state.step, "total": state.total, "size": hvd.size()})
