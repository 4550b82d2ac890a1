"""An elastic job on the GPU (run_gpu_checks.sh runs it under spark-hvdrun --min-np 1 with
two workers sharing the one GPU through host staging): worker rank 1 SIGKILLs itself once
at step 12; the survivor resumes from the commit of step 10 and finishes alone. Rank 0
prints ``PASS elastic_gpu ...`` or ``FAIL``."""

import os
import signal
import sys
import tempfile

import torch

import spark_hvd.torch as hvd

if not torch.cuda.is_available():
    print("SKIP elastic_gpu torch sees no CUDA device", flush=True)
    sys.exit(0)
MARK = os.path.join(tempfile.gettempdir(), f"shvd_elastic_gpu.{os.environ.get('SPARK_HVD_RUN_ID')}")
hvd.init()
torch.cuda.set_device(0)
state = hvd.elastic.ObjectState(step=0, total=0.0)


@hvd.elastic.run
def train(state):
    while state.step < 30:
        x = torch.full((1024,), float(hvd.rank() + 1), device="cuda")
        state.total += float(hvd.allreduce(x, op=hvd.Sum, name="elastic.gpu")[0].item())
        state.step += 1
        if state.step == 12 and hvd.rank() == 1 and not os.path.exists(MARK):
            open(MARK, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        if state.step % 5 == 0:
            state.commit()


train(state)
want = 10 * 3 + 20 * 1  # steps 1-10 at 2 ranks (1+2), 11-30 alone (1)
ok = state.total == want and hvd.size() == 1
print(f"{'PASS' if ok else 'FAIL'} elastic_gpu total={state.total} want={want} "
      f"size={hvd.size()}", flush=True)
