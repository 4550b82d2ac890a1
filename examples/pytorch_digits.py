"""Horovod's PyTorch MNIST example, on scikit-learn's bundled 8x8 digits (no download).

    spark-hvdrun -np 2 python examples/pytorch_digits.py

The classic shape: init, one thread per rank, learning rate scaled by the number
of ranks, DistributedOptimizer, parameters and optimizer state broadcast from
rank 0, a DistributedSampler per rank, checkpoints written by rank 0 only (and
resumed from), metrics averaged across ranks with allreduce.
"""

import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import spark_hvd.torch as hvd

# The training options (elastic_torch_digits.py takes them too).
training_options = argparse.ArgumentParser(add_help=False)
training_options.add_argument("--batch-size", type=int, default=32,
                              help="input batch size per rank")
training_options.add_argument("--test-batch-size", type=int, default=256)
training_options.add_argument("--epochs", type=int, default=8)
training_options.add_argument("--lr", type=float, default=0.05,
                              help="learning rate for one rank")
training_options.add_argument("--momentum", type=float, default=0.9)
training_options.add_argument("--seed", type=int, default=42)
training_options.add_argument("--log-interval", type=int, default=10,
                              help="batches between logs")

parser = argparse.ArgumentParser(description="PyTorch digits example",
                                 parents=[training_options])
parser.add_argument("--fp16-allreduce", action="store_true", help="fp16 compression")
parser.add_argument("--use-adasum", action="store_true", help="Adasum instead of Average")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--checkpoint-dir", default=None,
                    help="rank 0 saves a checkpoint here each epoch and resumes from it")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.conv2_drop = nn.Dropout2d(0.1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))                  # 16 x 4 x 4
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))  # 32 x 2 x 2
        x = x.flatten(1)
        x = F.dropout(F.relu(self.fc1(x)), p=0.1, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def datasets(seed):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2,
                                                        random_state=seed, stratify=y)
    return (torch.utils.data.TensorDataset(x_train, y_train),
            torch.utils.data.TensorDataset(x_test, y_test))


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(value), name=name).item()


def checkpoint_path(args, epoch):
    return os.path.join(args.checkpoint_dir, f"checkpoint-{epoch}.pt")


def main():
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # one thread per rank: ranks share the host's cores

    train_set, test_set = datasets(args.seed)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=args.seed)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size,
                                               sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=args.test_batch_size,
                                              sampler=test_sampler)

    model = Net()
    # Adasum combines the ranks' updates rather than averaging gradients: keep lr.
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # Resume: rank 0 finds the last checkpoint and tells the others the epoch.
    resume_from_epoch = 0
    if args.checkpoint_dir and hvd.rank() == 0:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        for epoch in range(args.epochs, 0, -1):
            if os.path.exists(checkpoint_path(args, epoch)):
                resume_from_epoch = epoch
                break
    resume_from_epoch = hvd.broadcast_object(resume_from_epoch, root_rank=0,
                                             name="resume_from_epoch")
    if resume_from_epoch > 0 and hvd.rank() == 0:
        state = torch.load(checkpoint_path(args, resume_from_epoch))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    # Every rank starts from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)

    def train(epoch):
        model.train()
        train_sampler.set_epoch(epoch)  # a different shuffle each epoch, same on all ranks
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
                print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)} "
                      f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}")

    def test():
        model.eval()
        test_loss = 0.0
        test_accuracy = 0.0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                pred = output.argmax(dim=1)
                test_accuracy += pred.eq(target).float().sum().item()
        # Each rank saw len(test_sampler) samples; average the per-rank means.
        test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
        test_accuracy = metric_average(test_accuracy / len(test_sampler), "avg_accuracy")
        if hvd.rank() == 0:
            print(f"\nTest set: Average loss: {test_loss:.4f}, "
                  f"Accuracy: {100.0 * test_accuracy:.2f}%\n")
        return test_accuracy

    def save_checkpoint(epoch):
        if not args.checkpoint_dir or hvd.rank() != 0:
            return
        path = checkpoint_path(args, epoch)
        tmp = path + ".tmp"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch}, tmp)
        os.replace(tmp, path)  # readers never see a partial file

    accuracy = None
    start = time.monotonic()
    for epoch in range(resume_from_epoch + 1, args.epochs + 1):
        train(epoch)
        accuracy = test()
        save_checkpoint(epoch)
    if accuracy is None:
        accuracy = test()
    if hvd.rank() == 0:
        print(f"final test accuracy: {accuracy:.4f} ({hvd.size()} ranks, "
              f"{time.monotonic() - start:.1f} s of training)")
    # Keep every rank up until rank 0 has written its last checkpoint and output:
    # a rank that exits shuts down its engine, which stops its peers' engines.
    hvd.barrier()


if __name__ == "__main__":
    main()
