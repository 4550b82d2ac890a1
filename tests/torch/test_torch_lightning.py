"""PyTorch Lightning's Trainer with HorovodStrategy (rank_lightning.py) at 1-3 ranks, and
examples/lightning_digits.py under spark-hvdrun -np 2."""

import os
import re
import sys

import pytest

import torch_harness
from _ranks import ROOT, hvdrun

EXAMPLE = os.path.join(ROOT, "examples", "lightning_digits.py")


@pytest.mark.parametrize("spec", torch_harness.specs("rank_lightning.py"))
def test_lightning_strategy(ranks, spec):
    ranks.check(spec)


def test_lightning_digits_example_two_ranks(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = hvdrun(2, [sys.executable, EXAMPLE, "--epochs", "4", "--checkpoint-dir", str(ckpt)],
                  timeout=240, cwd=ROOT)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "[0] parameters identical on all 2 ranks: True" in out, out[-3000:]
    found = re.findall(r"^\[0\] final val_acc: ([0-9.]+) ", out, re.M)
    assert found and float(found[0]) >= 0.9, out[-3000:]
    assert not re.search(r"^\[1\] final", out, re.M), "only rank 0 reports"
    # Rank 0 alone writes the checkpoints, one per epoch.
    assert sorted(os.listdir(ckpt)) == [f"digits-epoch={e}.ckpt" for e in range(4)]
