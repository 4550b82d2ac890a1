"""PyTorch Lightning on spark_hvd, on scikit-learn's bundled 8x8 digits (no download).

    spark-hvdrun -np 2 python examples/lightning_digits.py

The LightningModule is plain Lightning; the only spark_hvd line is the strategy
(``Trainer(strategy="horovod")`` works too, once spark_hvd.torch.lightning is
imported). Lightning shards the data per rank, the strategy scales the learning rate by
the number of ranks and averages gradients; validation metrics are averaged across
ranks (``sync_dist=True``) and only rank 0 writes checkpoints. Under Spark, call
``main()`` from ``spark_hvd.spark.run`` instead.
"""

import argparse
import hashlib
import importlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import spark_hvd.torch as hvd
from spark_hvd.torch.lightning import HorovodStrategy, lightning_package

pl = importlib.import_module(lightning_package())

parser = argparse.ArgumentParser(description="PyTorch Lightning digits example")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank")
parser.add_argument("--accumulate-grad-batches", type=int, default=1)
parser.add_argument("--gradient-clip-val", type=float, default=None)
parser.add_argument("--checkpoint-dir", default=None, help="rank 0 saves checkpoints here")
parser.add_argument("--seed", type=int, default=42)


class DigitsModule(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        return [optimizer], [scheduler]


def loaders(seed: int, batch_size: int):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_val, y_train, y_val = train_test_split(x, y, test_size=0.2, random_state=seed,
                                                      stratify=y)
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_train, y_train),
                                        batch_size=batch_size, shuffle=True)
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_val, y_val),
                                      batch_size=256)
    return train, val


def main(argv=None):
    args = parser.parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)  # one thread per rank: ranks share the host's cores
    pl.seed_everything(args.seed + hvd.rank(), verbose=False)  # rank 0's weights win
    train, val = loaders(args.seed, args.batch_size)
    model = DigitsModule(args.lr)
    callbacks = []
    if args.checkpoint_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.checkpoint_dir,
                                                      filename="digits-{epoch}",
                                                      save_top_k=-1))
    trainer = pl.Trainer(strategy=HorovodStrategy(), accelerator="cpu", devices=1,
                         max_epochs=args.epochs, logger=False,
                         enable_checkpointing=bool(args.checkpoint_dir), callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False,
                         accumulate_grad_batches=args.accumulate_grad_batches,
                         gradient_clip_val=args.gradient_clip_val)
    trainer.fit(model, train, val)
    metrics = trainer.validate(model, val, verbose=False)[0]
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()[:16]
    digests = hvd.allgather_object(digest)
    if hvd.rank() == 0:
        print(f"parameters identical on all {hvd.size()} ranks: {len(set(digests)) == 1}")
        print(f"lr after training: {trainer.optimizers[0].param_groups[0]['lr']:.4f}")
        print(f"final val_acc: {metrics['val_acc']:.4f} val_loss: {metrics['val_loss']:.4f} "
              f"({hvd.size()} ranks)")
    return metrics


if __name__ == "__main__":
    main()
