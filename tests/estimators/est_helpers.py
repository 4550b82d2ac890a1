"""Helpers shared by the estimator tests (the model, the metric, store listings)."""

import os
import sys

import cloudpickle

# Executors cannot import this file: ship what it defines (the model, the metric) by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def accuracy(output, label):
    """Share of rows whose highest output is the label."""
    return (output.argmax(dim=1) == label).float().mean()


def make_net(seed=0, hidden=64):
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


def listing(root):
    """Every path under root (relative), sorted; [] when root does not exist."""
    out = []
    for base, dirs, files in os.walk(root):
        out += [os.path.relpath(os.path.join(base, n), root) for n in dirs + files]
    return sorted(out)

