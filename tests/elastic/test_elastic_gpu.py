"""Elastic training on GPUs takes the same path as on CPUs: through tests/fakes' CUDA
runtime and NCCL, a worker SIGKILLed mid-training makes the survivors' NCCL communicator
fail; the engine aborts it, and the next epoch builds a new one among the survivors."""

import os
import sys

import pytest

from elastic_harness import run_job

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fakes.build import cached_fakes, fake_env  # noqa: E402

pytestmark = pytest.mark.nccl


def test_a_worker_killed_mid_gpu_training_the_survivors_re_form_on_nccl(tmp_path):
    env = fake_env(cached_fakes(), devices=3)
    out = run_job("gpu_worker.py", 3, str(tmp_path), min_np=2, timeout_s=90, env=env)
    why = out.describe()
    assert out.codes == {0: 0, 1: -9, 2: 0}, why
    assert any(line.startswith("epoch 2: 2 ranks") for line in out.log), why
    for w in (0, 2):
        res = out.results[w]
        # the last commit before the kill was step 10: 10 steps at size 3 (sum 6), then
        # 20 at size 2 (sum 3); none lost or counted twice
        assert (res["step"], res["size"]) == (30, 2), (res, why)
        assert res["total"] == 10 * 6 + 20 * 3, (res, why)
        starts = [(r["step"], r["size"]) for r in out.records[w] if r["kind"] == "start"]
        assert starts == [(0, 3), (10, 2)], (starts, why)
