"""PyTorch Lightning on spark_hvd: ``Trainer(strategy=HorovodStrategy())``, or
``Trainer(strategy="horovod")`` once this module is imported.

Lightning 2 dropped its own Horovod strategy; this one behaves as it did. Each process
is one rank (started by spark-hvdrun, ``spark_hvd.spark.run`` or ``run_elastic``; the
strategy launches nothing), on one device: the GPU of its task when the Trainer's
accelerator is a GPU (``cuda:local_rank`` when a process sees several), else the CPU.
When fitting, the learning rates of every optimizer (and its schedulers' base rates)
are multiplied by the number of ranks (``scale_lr=False`` keeps them), rank 0's
parameters and optimizer state are broadcast, and each optimizer becomes a
:func:`spark_hvd.torch.DistributedOptimizer`: gradients are averaged across ranks
before the step, gradient clipping sees the averaged gradients, and gradient
accumulation (``accumulate_grad_batches=k``) allreduces once per k backward passes.
``self.log(..., sync_dist=True)``, ``all_gather``, ``broadcast`` and barriers go through
spark_hvd; Lightning gives each rank its share of the data (a DistributedSampler with
``num_replicas=size``, ``rank=rank``), and only rank 0 writes checkpoints.

The strategy derives from the Lightning package in use: ``lightning.pytorch`` or
``pytorch_lightning``, whichever the program imported first (if neither yet,
``lightning.pytorch`` when installed). The Trainer must come from the same package.
"""

from __future__ import annotations

import functools
import importlib
import sys
import weakref
from typing import Any, Callable, Dict, Optional

import torch

from spark_hvd.exceptions import InvalidArgumentError
import spark_hvd.torch as hvd

__all__ = ["HorovodStrategy", "SparkHvdEnvironment", "lightning_package"]

# Lightning's reduce ops ("mean", "sum", torch.distributed.ReduceOp.SUM, ...) by name.
_REDUCE_OPS = {"mean": hvd.Average, "avg": hvd.Average, "average": hvd.Average,
               "sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min, "product": hvd.Product,
               "prod": hvd.Product}


def lightning_package() -> str:
    """The Lightning package the strategy is built on (see the module docstring)."""
    for name in ("lightning.pytorch", "pytorch_lightning"):
        if name in sys.modules:
            return name
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            importlib.import_module(name)
            return name
        except ImportError:
            continue
    raise ImportError("spark_hvd.torch.lightning needs PyTorch Lightning: pip install "
                      "lightning (or pytorch-lightning)")


def _reduce_op(op: Any):
    if op is None:
        return hvd.Average
    text = str(op).lower().rsplit(".", 1)[-1]
    if text not in _REDUCE_OPS:
        raise InvalidArgumentError(f"HorovodStrategy.reduce: unsupported reduce_op {op!r}; "
                                   f"use one of {sorted(_REDUCE_OPS)}")
    return _REDUCE_OPS[text]


def _track_steps_for_schedulers(optimizer) -> None:
    """What a torch LR scheduler does to the optimizer it is made with (its step records
    that it ran, so the scheduler can tell the order of the two steps), for a scheduler
    re-pointed at the optimizer's DistributedOptimizer."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = type(optimizer).step
    me = weakref.ref(optimizer)

    @functools.wraps(step)
    def tracked(*args, **kwargs):
        opt = me()
        opt._opt_called = True
        return step(opt, *args, **kwargs)

    tracked._wrapped_by_lr_sched = True
    optimizer.step = tracked


def _build(package: str):
    pl = importlib.import_module(package)
    strategies = importlib.import_module(f"{package}.strategies")
    environments = importlib.import_module(f"{package}.plugins.environments")

    class SparkHvdEnvironment(environments.ClusterEnvironment):
        """Ranks as spark_hvd knows them (the launcher started the processes)."""

        @property
        def creates_processes_externally(self) -> bool:
            return True

        @property
        def main_address(self) -> str:
            return "127.0.0.1"  # unused: spark_hvd rendezvouses on its own

        @property
        def main_port(self) -> int:
            return 0

        @staticmethod
        def detect() -> bool:
            return hvd.is_initialized()

        def world_size(self) -> int:
            return hvd.size()

        def set_world_size(self, size: int) -> None:
            pass  # the launcher decides

        def global_rank(self) -> int:
            return hvd.rank()

        def set_global_rank(self, rank: int) -> None:
            pass

        def local_rank(self) -> int:
            return hvd.local_rank()

        def node_rank(self) -> int:
            return hvd.cross_rank()

    class HorovodStrategy(strategies.ParallelStrategy):
        """Data-parallel training over spark_hvd (see the module docstring)."""

        strategy_name = "horovod"

        def __init__(self, accelerator=None, parallel_devices=None, checkpoint_io=None,
                     precision_plugin=None, scale_lr: bool = True,
                     compression=hvd.Compression.none, op=hvd.Average,
                     gradient_predivide_factor: float = 1.0) -> None:
            if hvd.ReduceOp(op) not in (hvd.ReduceOp.AVERAGE, hvd.ReduceOp.SUM):
                raise InvalidArgumentError(f"HorovodStrategy(op=...) takes Average or Sum, "
                                           f"not {hvd.ReduceOp(op).name}")
            if not hvd.is_initialized():  # the Trainer asks for ranks before setup
                hvd.init()
            super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                             cluster_environment=SparkHvdEnvironment(),
                             checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
            self.scale_lr = scale_lr
            self._optimizer_options = dict(compression=compression, op=op,
                                           gradient_predivide_factor=gradient_predivide_factor)

        # -- where this rank runs ----------------------------------------------------
        @property
        def is_distributed(self) -> bool:
            return True

        @property
        def root_device(self) -> torch.device:
            devices = self.parallel_devices or [torch.device("cpu")]
            if devices[0].type == "cuda":
                visible = max(torch.cuda.device_count(), 1)
                return torch.device("cuda", hvd.local_rank() % visible)
            return devices[0]

        @property
        def distributed_sampler_kwargs(self) -> Dict[str, int]:
            return {"num_replicas": hvd.size(), "rank": hvd.rank()}

        def setup_environment(self) -> None:
            if not hvd.is_initialized():
                hvd.init()
            if self.root_device.type == "cuda":
                torch.cuda.set_device(self.root_device)
            super().setup_environment()

        def model_to_device(self) -> None:
            assert self.model is not None
            self.model.to(self.root_device)

        # -- training ------------------------------------------------------------------
        def setup(self, trainer) -> None:
            super().setup(trainer)
            if trainer.state.fn != pl.trainer.states.TrainerFn.FITTING:
                return
            if self.scale_lr:
                for optimizer in self.optimizers:
                    for group in optimizer.param_groups:
                        group["lr"] *= hvd.size()
                for config in self.lr_scheduler_configs:
                    scheduler = config.scheduler
                    if hasattr(scheduler, "base_lrs"):
                        scheduler.base_lrs = [lr * hvd.size() for lr in scheduler.base_lrs]
            hvd.broadcast_parameters(self.lightning_module.state_dict(), root_rank=0)
            named = list(self.lightning_module.named_parameters())
            wrapped = []
            for optimizer in self.optimizers:
                hvd.broadcast_optimizer_state(optimizer, root_rank=0)
                mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
                distributed = hvd.DistributedOptimizer(
                    optimizer, named_parameters=[(n, p) for n, p in named if id(p) in mine],
                    backward_passes_per_step=max(1, int(trainer.accumulate_grad_batches)),
                    **self._optimizer_options)
                for config in self.lr_scheduler_configs:
                    if getattr(config.scheduler, "optimizer", None) is optimizer:
                        config.scheduler.optimizer = distributed
                        _track_steps_for_schedulers(distributed)
                wrapped.append(distributed)
            self.optimizers = wrapped

        def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None,
                           **kwargs: Any) -> Any:
            if not isinstance(optimizer, hvd.optimizer._DistributedOptimizer):
                return super().optimizer_step(optimizer, closure, model, **kwargs)

            # The closure runs forward and backward (the gradient hooks start the
            # allreduces); wait for the averages right after it, so that Lightning's
            # clipping and on_before_optimizer_step see them, then step without
            # synchronizing again.
            def closure_then_synchronize():
                result = closure()
                optimizer.synchronize()
                return result

            with optimizer.skip_synchronize():
                return super().optimizer_step(optimizer, closure_then_synchronize, model,
                                              **kwargs)

        # -- collectives Lightning asks for -----------------------------------------------
        def reduce(self, tensor, group: Optional[Any] = None, reduce_op: Any = "mean"):
            if not isinstance(tensor, torch.Tensor):
                return tensor
            return hvd.allreduce(tensor, op=_reduce_op(reduce_op))

        def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None,
                       sync_grads: bool = False) -> torch.Tensor:
            gathered = hvd.allgather(tensor.unsqueeze(0))
            return gathered if sync_grads else gathered.detach()

        def broadcast(self, obj, src: int = 0):
            return hvd.broadcast_object(obj, root_rank=src)

        def barrier(self, name: Optional[str] = None) -> None:
            hvd.barrier()

        @classmethod
        def register_strategies(cls, strategy_registry) -> None:
            strategy_registry.register("horovod", cls, description="spark_hvd's Horovod "
                                       "strategy", override=True)

    return HorovodStrategy, SparkHvdEnvironment


_PACKAGE = lightning_package()
HorovodStrategy, SparkHvdEnvironment = _build(_PACKAGE)
_registry = importlib.import_module(f"{_PACKAGE}.strategies").StrategyRegistry
if "horovod" not in _registry:
    HorovodStrategy.register_strategies(_registry)
