"""An elastic PyTorch worker (tests/elastic/test_elastic_torch.py): linear regression
with SGD + momentum, TorchState + ElasticSampler, a commit after every batch.

The worker at rank ``--kill-rank`` of a ``--kill-size``-rank epoch SIGKILLs itself once,
at batch ``--kill-batch`` of epoch ``--kill-epoch``, before that batch's step. With
``--grow-at-step``, the ranks stop after that step's commit until workers join (the test
starts them) and the job re-forms with ``--grow-to`` ranks. Each commit
appends a record: the epoch, the dataset indices this rank trained since the last
commit, the step count and the loss on the whole dataset; so the test can tell which
samples went into the committed model, by whom, and how training went on.
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import spark_hvd.torch as hvd  # noqa: E402
from elastic_harness import append_record, die_once, write_result  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--samples", type=int, default=96)
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--kill-epoch", type=int, default=1)
parser.add_argument("--kill-batch", type=int, default=3)
parser.add_argument("--kill-rank", type=int, default=1)
parser.add_argument("--kill-size", type=int, default=3)
parser.add_argument("--grow-at-step", type=int, default=0,
                    help="after this step's commit, wait for --grow-to workers")
parser.add_argument("--grow-to", type=int, default=3)
args = parser.parse_args()

torch.set_num_threads(1)
gen = torch.Generator().manual_seed(1)
X = torch.randn(args.samples, 8, generator=gen)
Y = X @ torch.randn(8, 1, generator=gen) + 0.01 * torch.randn(args.samples, 1, generator=gen)
dataset = torch.utils.data.TensorDataset(X, Y)

hvd.init()
torch.manual_seed(hvd.rank())  # different initial weights: sync must make them equal
model = torch.nn.Linear(8, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5),
                                     named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=7)
loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0)
trained = []  # this rank's indices since the last commit


def full_loss() -> float:
    with torch.no_grad():
        return F.mse_loss(model(X), Y).item()


def on_reset() -> None:
    trained.clear()  # a failure threw them away; an interrupt comes only at a commit
    append_record({"kind": "reset", "rank": hvd.rank(), "size": hvd.size(),
                   "step": state.step, "epoch": state.epoch})


state.register_reset_callbacks([on_reset])


def commit() -> None:
    # Written before commit(): its save() cannot fail, so what is recorded is committed.
    append_record({"kind": "commit", "epoch": state.epoch, "indices": trained,
                   "step": state.step, "loss": full_loss(), "size": hvd.size()})
    trained.clear()
    state.commit()


def wait_for_workers() -> None:
    """Checks for joining workers (on every rank at once) until the interrupt comes."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state.check_host_updates()  # raises HostsUpdatedInterrupt once a worker waits
        time.sleep(0.05)
    raise RuntimeError("no worker joined within 60 s")


@hvd.elastic.run
def train(state):
    while state.epoch < args.epochs:
        for i, (x, y) in enumerate(loader):
            if (state.epoch, i, hvd.rank(), hvd.size()) == (
                    args.kill_epoch, args.kill_batch, args.kill_rank, args.kill_size):
                die_once("torch")
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            trained.extend(state.sampler.get_indices(i, args.batch_size))
            state.sampler.record_batch(i, args.batch_size)
            state.step += 1
            commit()
            if state.step == args.grow_at_step and hvd.size() < args.grow_to:
                wait_for_workers()
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        commit()


append_record({"kind": "start", "rank": hvd.rank(), "size": hvd.size(), "loss": full_loss()})
train(state)
write_result({"rank": hvd.rank(), "size": hvd.size(), "step": state.step, "loss": full_loss(),
              "params": [p.detach().flatten().tolist() for p in model.parameters()]})
