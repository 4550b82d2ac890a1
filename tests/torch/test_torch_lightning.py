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
    proc = hvdrun(2, [sys.executable, EXAMPLE, "--epochs", "3", "--checkpoint-dir", str(ckpt)],
                  timeout=240, cwd=ROOT)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "[0] parameters identical on all 2 ranks: True" in out, out[-3000:]
    found = re.findall(r"^\[0\] final val_acc: ([0-9.]+) ", out, re.M)
    assert found and float(found[0]) >= 0.9, out[-3000:]
    assert not re.search(r"^\[1\] final", out, re.M), "only rank 0 reports"
    # Rank 0 alone writes the checkpoints, one per epoch.
    assert sorted(os.listdir(ckpt)) == [f"digits-epoch={e}.ckpt" for e in range(3)]


ALONE = r"""
import importlib, torch
import spark_hvd.torch as hvd
from spark_hvd.torch.lightning import lightning_package  # registers strategy="horovod"
pl = importlib.import_module(lightning_package())

class M(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).square().mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

assert not hvd.is_initialized()
data = torch.utils.data.TensorDataset(torch.randn(16, 4))
trainer = pl.Trainer(strategy="horovod", max_epochs=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.fit(M(), torch.utils.data.DataLoader(data, batch_size=4))
print("trained with", type(trainer.strategy).__name__, "on", hvd.size(), "rank")
"""


def test_strategy_by_name_in_a_plain_process():
    """strategy="horovod" in a process no launcher started: the strategy initializes
    spark_hvd itself (one rank), as the Trainer asks for ranks before any setup."""
    import subprocess
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", ALONE], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trained with HorovodStrategy on 1 rank" in proc.stdout
