"""An unchanged DistributedDataParallel program, for TorchDistributor: as a function
(``train``) and as a script (``python ddp_program.py STEPS OUT_DIR``); and the same
training with FSDP (``train_fsdp``: torch's ``fully_shard``, each rank holding half of
every parameter, gradients reduce-scattered over gloo).

It reads only torch.distributed's environment (``init_process_group("gloo")`` with
``env://``, LOCAL_RANK, WORLD_SIZE) and trains a small seeded linear model on rank-dependent
data, so its weights depend on every rank's gradients. The function returns the rank's
``(rank, world size, local rank, spark_hvd allreduce of its rank, weights)``; the script
writes the same as ``rank<r>.json`` in OUT_DIR. ``reference`` trains the same in one
process.
"""

import json
import os
import sys


def _model_and_data(rank: int):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = torch.Generator().manual_seed(100 + rank)
    return model, data


def _batch(data):
    import torch

    return torch.randn(8, 4, generator=data), torch.randn(8, 2, generator=data)


def _sgd_steps(model, data, steps: int) -> None:
    """``steps`` SGD steps of ``model`` (DDP or FSDP) on this rank's batches."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        x, y = _batch(data)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def reference(steps: int, world: int):
    """The weights DDP must reach, trained in one process: each step's gradient is the mean
    of the ranks' gradients on their batches."""
    import torch

    model, _ = _model_and_data(0)
    datas = [_model_and_data(r)[1] for r in range(world)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        losses = [torch.nn.functional.mse_loss(model(x), y)
                  for x, y in (_batch(d) for d in datas)]
        (sum(losses) / world).backward()
        opt.step()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def train(steps: int = 5):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    module, data = _model_and_data(rank)
    model = torch.nn.parallel.DistributedDataParallel(module)
    _sgd_steps(model, data, steps)
    weights = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    dist.destroy_process_group()
    # spark_hvd's collectives work in the same processes
    import numpy as np
    import spark_hvd as hvd

    hvd.init()
    total = float(hvd.allreduce(np.array([float(rank)]), op=hvd.Sum)[0])
    hvd.shutdown()
    print(f"trained rank {rank}/{world}")
    return {"rank": rank, "world": world, "local_rank": local_rank, "sum": total,
            "weights": weights}


def train_fsdp(steps: int = 5):
    """``train``'s model, data and optimizer under FSDP2 (``fully_shard``) instead of DDP:
    the same weights (gradients are averaged either way). Returns the rank, the world size,
    the type of a parameter (a ``DTensor`` shard) and the full weights."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, data = _model_and_data(rank)
    fully_shard(model)
    _sgd_steps(model, data, steps)
    kind = type(model.weight).__name__
    local = list(model.weight.to_local().shape)
    weights = [p.full_tensor().reshape(-1).tolist() for p in model.parameters()]
    dist.destroy_process_group()
    return {"rank": rank, "world": world, "param": kind, "local_shape": local,
            "weights": weights}


if __name__ == "__main__":
    result = train(int(sys.argv[1]))
    with open(os.path.join(sys.argv[2], f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)
