"""The GPU backends on 1, 2 and 3 ranks through the fake CUDA runtime and NCCL of
tests/fakes (built here; CI has no GPU): the op matrix of cases_nccl.py on NCCL (one GPU
per rank) and staged through host memory on the tcp backend (SPARK_HVD_GPU_OPERATIONS=tcp,
every rank on GPU 0, which NCCL refuses), and a rank SIGKILLed in the middle of a GPU
allreduce on NCCL (every survivor raises PeerLostError naming it within 10 s)."""

import json
import os
import signal
import time

import pytest

import cases_nccl
from _ranks import PYTHON, DirectJob
from fakes.build import cached_fakes, fake_env

pytestmark = pytest.mark.nccl
NAMES = cases_nccl.CASES.names()
DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def gpu_env():
    return fake_env(cached_fakes(), devices=3)


MODES = {
    "nccl": {},
    "staged_shared_gpu": {"SPARK_HVD_GPU_OPERATIONS": "tcp", "SHVD_TEST_SHARED_GPU": "1"},
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("np", [1, 2, 3])
@pytest.mark.parametrize("case", NAMES)
def test_case(case_runs, gpu_env, case, np, mode):
    case_runs.get("cases_nccl", np, env=dict(gpu_env, **MODES[mode])).check(case)


KILL_SCRIPT = r'''
import json, os, signal, sys, time
here = os.environ["SHVD_TESTS_MULTIPROC"]
sys.path[:0] = [here, os.path.dirname(here)]
import numpy as np
import spark_hvd as hvd
import cases_nccl as g

out = sys.argv[1]
hvd.init()
me = hvd.rank()
for i in range(3):
    g.wait_for(g.allreduce_async(np.ones(1 << 16, np.float32), f"warm.{i}"), 20, "warm-up")
hvd.barrier()
h = g.allreduce_async(np.ones(1 << 20, np.float32), "big")
if me == 2:
    # Negotiated and queued on this rank's NCCL stream, which is still in the fake's
    # SHVD_FAKE_CUDA_DELAY_US: the peers' collective waits for a contribution that
    # never comes.
    time.sleep(0.15)
    with open(os.path.join(out, "killed_at"), "w") as f:
        json.dump({"at": time.time()}, f)
    os.kill(os.getpid(), signal.SIGKILL)
try:
    hvd.synchronize(h)
    res = {"error": None}
except Exception as e:
    res = {"error": type(e).__name__, "message": str(e), "ranks": getattr(e, "ranks", [])}
res["at"] = time.time()
with open(os.path.join(out, f"result{me}"), "w") as f:
    json.dump(res, f)
'''


def test_rank_killed_mid_gpu_allreduce(gpu_env, tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    env = dict(gpu_env, SHVD_TESTS_MULTIPROC=os.path.dirname(os.path.abspath(__file__)),
               SHVD_FAKE_CUDA_DELAY_US="400000")
    job = DirectJob(3, [PYTHON, str(script), str(tmp_path)], env=env)
    try:
        codes = job.wait(DEADLINE_S + 30)
        logs = "\n".join(f"--- rank {r} ---\n{job.output(r)[-2000:]}" for r in range(3))
        assert codes[2] == -signal.SIGKILL, (codes, logs)
        killed = json.loads((tmp_path / "killed_at").read_text())["at"]
        for r in (0, 1):
            path = tmp_path / f"result{r}"
            assert path.exists(), f"rank {r} did not report (exit {codes[r]})\n{logs}"
            res = json.loads(path.read_text())
            print(f"rank {r}: {res['at'] - killed:.2f} s after the kill: {res}")
            assert res["error"] == "PeerLostError", (res, logs)
            assert 2 in res["ranks"] and "2" in res["message"], res
            assert res["at"] - killed < DEADLINE_S, (res["at"] - killed, res)
    finally:
        job.close()
