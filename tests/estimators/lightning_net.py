"""The LightningModule of the LightningEstimator tests (shipped to the executors by value)."""

import importlib
import os
import signal
import sys

import cloudpickle
import torch
import torch.nn.functional as F

from spark_hvd.torch.lightning import lightning_package

pl = importlib.import_module(lightning_package())
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class DigitsNet(pl.LightningModule):
    """64 -> 64 -> 10 on the digits' 'features' and 'label' columns; logs the epoch's
    train_loss, val_loss and val_acc (averaged over the processes)."""

    def __init__(self, lr: float = 0.05, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch["features"]), batch["label"])
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self(batch["features"])
        self.log("val_loss", F.cross_entropy(logits, batch["label"]), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == batch["label"]).float().mean(),
                 sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)]


class ForwardOnly(pl.LightningModule):
    """A module without training_step or configure_optimizers."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.net(x)


class EpochsSeen(pl.Callback):
    """A user callback: counts the training epochs it saw on each process."""

    def __init__(self) -> None:
        self.epochs = 0

    def on_train_epoch_end(self, trainer, module):
        self.epochs += 1
        if trainer.global_rank == 0:
            print(f"user callback: epoch {trainer.current_epoch + 1} ended", flush=True)


class KillOnce(DigitsNet):
    """DigitsNet whose rank 1 SIGKILLs its own process at its ``step``-th training batch,
    once: it creates the file ``marker`` first, and a process that finds it trains on."""

    def __init__(self, step: int, marker: str) -> None:
        super().__init__()
        self.kill_at, self.marker, self.steps = step, marker, 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        if (self.steps == self.kill_at and self.global_rank == 1
                and not os.path.exists(self.marker)):
            open(self.marker, "x").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)
