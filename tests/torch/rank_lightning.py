"""Rank functions: PyTorch Lightning's Trainer with spark_hvd's HorovodStrategy.

The reference is plain torch in this process, on the batches of every rank at once: an
unshuffled DistributedSampler gives rank r samples r, r+n, r+2n, ... (Lightning's own
sampler always shuffles training data, so the equality checks pass theirs), so batch k of all
ranks together is the contiguous block k of n*B samples. Averaged
gradients on B per rank equal the gradient of that block; with the learning rate scaled
by n (the strategy's default) the parameters after fit must equal plain SGD on the
blocks at n*lr, and likewise with gradient clipping (clipping the averaged gradient)
and with gradient accumulation (k micro-batches per step).
"""

import importlib
import logging
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import spark_hvd.torch as hvd
from spark_hvd.torch.lightning import HorovodStrategy, lightning_package

pl = importlib.import_module(lightning_package())
logging.getLogger(lightning_package()).setLevel(logging.ERROR)
warnings.filterwarnings("ignore", module=lightning_package() + ".*")

B, FEATURES, CLASSES, SAMPLES_PER_RANK = 4, 6, 3, 24
LR = 0.1


def data(n):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(SAMPLES_PER_RANK * n, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (SAMPLES_PER_RANK * n,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def fresh_net():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES))


class Module(pl.LightningModule):
    def __init__(self, seed_offset=0):
        super().__init__()
        self.net = fresh_net()
        if seed_offset:  # other ranks start elsewhere: the strategy broadcasts rank 0's
            with torch.no_grad():
                for p in self.net.parameters():
                    p.add_(float(seed_offset))
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=False, on_epoch=True)
        self.seen.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def fit(strategy="horovod", epochs=2, lightning_sampler=False, **trainer_kwargs):
    n = hvd.size()
    module = Module(seed_offset=hvd.rank())
    sampler = None if lightning_sampler else torch.utils.data.distributed.DistributedSampler(
        data(n), num_replicas=n, rank=hvd.rank(), shuffle=False)
    loader = torch.utils.data.DataLoader(data(n), batch_size=B, sampler=sampler)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=epochs,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=lightning_sampler,
                         **trainer_kwargs)
    trainer.fit(module, loader)
    return trainer, module


def reference(epochs=2, accumulate=1, clip=None):
    n = hvd.size()
    net = fresh_net()
    opt = torch.optim.SGD(net.parameters(), lr=LR * n)
    loader = torch.utils.data.DataLoader(data(n), batch_size=B * n * accumulate, shuffle=False)
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            opt.step()
    return net


def same_params(module, ref, what):
    for (name, p), q in zip(module.net.named_parameters(), ref.parameters()):
        assert torch.allclose(p.detach(), q.detach(), atol=1e-5, rtol=1e-5), \
            (what, name, (p - q).abs().max())


def check_fit_equals_sgd_on_all_ranks_batches():
    trainer, module = fit()
    assert isinstance(trainer.strategy, HorovodStrategy)
    assert trainer.world_size == hvd.size() and trainer.global_rank == hvd.rank()
    assert trainer.optimizers[0].param_groups[0]["lr"] == LR * hvd.size()
    same_params(module, reference(), "plain")
    # The epoch's train_loss is averaged over ranks: the same value everywhere.
    logged = float(trainer.callback_metrics["train_loss"])
    assert hvd.allgather_object(logged) == [logged] * hvd.size()


def check_gradient_clipping_sees_the_averaged_gradients():
    _, module = fit(gradient_clip_val=0.05)
    same_params(module, reference(clip=0.05), "clipped")


def check_gradient_accumulation_allreduces_per_step():
    _, module = fit(accumulate_grad_batches=2)
    same_params(module, reference(accumulate=2), "accumulate 2")


def check_collectives_lightning_asks_for():
    trainer, module = fit(epochs=1, lightning_sampler=True)
    s = trainer.strategy
    r, n = hvd.rank(), hvd.size()
    sampler = trainer.train_dataloader.sampler  # Lightning's, from distributed_sampler_kwargs
    assert isinstance(sampler, torch.utils.data.distributed.DistributedSampler), sampler
    assert (sampler.num_replicas, sampler.rank) == (n, r)
    assert len(module.seen) == SAMPLES_PER_RANK // B  # this rank's share of the batches
    assert float(s.reduce(torch.tensor(float(r)), reduce_op="sum")) == n * (n - 1) / 2
    assert float(s.reduce(torch.tensor(float(r)))) == (n - 1) / 2  # mean
    assert float(s.reduce(torch.tensor(float(r)), reduce_op="max")) == n - 1
    assert s.reduce("not a tensor") == "not a tensor"
    g = s.all_gather(torch.tensor([r, 10 + r]))
    assert g.shape == (n, 2) and g[:, 0].tolist() == list(range(n))
    assert s.broadcast({"from": r}, src=n - 1) == {"from": n - 1}
    assert s.reduce_boolean_decision(r == 0, all=False) is True
    assert s.reduce_boolean_decision(r == 0) is (n == 1)
    assert s.distributed_sampler_kwargs == {"num_replicas": n, "rank": r}
    s.barrier("check")


def check_strategy_options():
    _, module = fit(strategy=HorovodStrategy(scale_lr=False), epochs=1)
    ref = fresh_net()  # one epoch at lr (unscaled) on the blocks
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for x, y in torch.utils.data.DataLoader(data(hvd.size()), batch_size=B * hvd.size()):
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    same_params(module, ref, "scale_lr=False")
    try:
        HorovodStrategy(op=hvd.Adasum)
    except hvd.InvalidArgumentError as e:
        assert "Average or Sum" in str(e)
    else:
        raise AssertionError("op=Adasum was accepted")
