"""An unchanged DistributedDataParallel program, for TorchDistributor: as a function
(``train``) and as a script (``python ddp_program.py STEPS OUT_DIR``).

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
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        x, y = _batch(data)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
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


if __name__ == "__main__":
    result = train(int(sys.argv[1]))
    with open(os.path.join(sys.argv[2], f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)
