"""Elastic training with PyTorch: pytorch_digits.py's model, data and options, made elastic.

    spark-hvdrun -np 2 --min-np 1 --max-np 3 --host-discovery-script ./discover.sh \\
        python examples/elastic_torch_digits.py

Workers may come and go while it trains: when one is lost, the others go back to the
last commit and carry on without it; when one joins, the others stop at their next
commit, and the job goes on with it. What makes that work:

- the training function is decorated with ``hvd.elastic.run`` and takes a ``TorchState``
  holding the model, the optimizer, the sampler and the epoch. No collective runs before
  it: ``run`` syncs the state from rank 0 (a joining worker gets the others' weights);
- ``ElasticSampler`` records the batches trained, so after a reset the rest of the
  epoch is shared out among the new set of workers, each sample once;
- ``state.commit()`` every ``--batches-per-commit`` batches and at the end of each epoch
  (a commit copies the state to host memory, and is where a membership change is noticed);
- a reset callback scales the learning rate to the new number of workers.

Under plain ``spark-hvdrun -np 2`` (or as one process) the same script trains as a
fixed-size job.
"""

import argparse
import time

import torch
import torch.nn.functional as F
import torch.optim as optim

import spark_hvd.torch as hvd
from pytorch_digits import Net, datasets, metric_average, training_options

parser = argparse.ArgumentParser(description="Elastic PyTorch digits example",
                                 parents=[training_options])
parser.add_argument("--batches-per-commit", type=int, default=5,
                    help="batches between commits: fewer lose less work to a failure")


def main():
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # one thread per rank: ranks share the host's cores

    train_set, test_set = datasets(args.seed)
    train_sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size,
                                               sampler=train_sampler)

    model = Net()
    optimizer = hvd.DistributedOptimizer(
        optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum),
        named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, sampler=train_sampler, epoch=0)

    def on_reset():
        for group in optimizer.param_groups:  # the new number of workers
            group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"reset: {hvd.size()} workers, resuming epoch {state.epoch} "
                  f"({len(train_sampler.processed_indices)} samples of it done)", flush=True)

    state.register_reset_callbacks([on_reset])

    def test():
        # The test set is split by the current rank and size; each rank averages its part.
        model.eval()
        part = torch.utils.data.Subset(test_set, range(hvd.rank(), len(test_set), hvd.size()))
        loss = correct = 0.0
        with torch.no_grad():
            for data, target in torch.utils.data.DataLoader(part, args.test_batch_size):
                output = model(data)
                loss += F.nll_loss(output, target, reduction="sum").item()
                correct += output.argmax(dim=1).eq(target).float().sum().item()
        return (metric_average(loss / len(part), "avg_loss"),
                metric_average(correct / len(part), "avg_accuracy"))

    @hvd.elastic.run
    def train(state):
        while state.epoch < args.epochs:
            model.train()
            for batch_idx, (data, target) in enumerate(train_loader):
                optimizer.zero_grad()
                loss = F.nll_loss(model(data), target)
                loss.backward()
                optimizer.step()
                state.sampler.record_batch(batch_idx, args.batch_size)
                if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
                    print(f"Train Epoch: {state.epoch} [{batch_idx}/{len(train_loader)} "
                          f"batches, {hvd.size()} workers]\tLoss: {loss.item():.6f}",
                          flush=True)
                if (batch_idx + 1) % args.batches_per_commit == 0:
                    state.commit()
            test_loss, accuracy = test()
            if hvd.rank() == 0:
                print(f"\nepoch {state.epoch} done: test loss {test_loss:.4f}, accuracy "
                      f"{100.0 * accuracy:.2f}%\n", flush=True)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)  # at the end of an epoch: a new shuffle
            state.commit()
        return test()[1]

    start = time.monotonic()
    accuracy = train(state)
    if hvd.rank() == 0:
        print(f"final test accuracy: {accuracy:.4f} ({hvd.size()} ranks, "
              f"{time.monotonic() - start:.1f} s of training)", flush=True)


if __name__ == "__main__":
    main()
