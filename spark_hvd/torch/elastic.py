"""Elastic training with PyTorch: Horovod's ``hvd.elastic`` of ``horovod.torch``.

::

    import spark_hvd.torch as hvd

    hvd.init()
    sampler = hvd.elastic.ElasticSampler(dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=bs, sampler=sampler)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state):
        while state.epoch < epochs:
            for i, (x, y) in enumerate(loader):  # after a reset: the epoch's rest
                ...step...
                state.sampler.record_batch(i, bs)
                state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)

How a reset works is in :mod:`spark_hvd.elastic`. :class:`TorchState` keeps models,
optimizers, learning-rate schedulers and :class:`ElasticSampler` s given as arguments
(by type) and any other picklable attribute; it saves in host memory at ``commit()``,
restores after a failure, and syncs from rank 0 after each reset. The sampler makes the
surviving ranks train the rest of the epoch, each sample once.
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any, Dict, Iterable, Iterator, List, Optional, Set

import torch

from spark_hvd._basics import rank, size
from spark_hvd.elastic import ObjectState, State, run
from spark_hvd.torch.functions import (allgather_object, broadcast_object,
                                       broadcast_optimizer_state, broadcast_parameters)

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's ElasticSampler: a DistributedSampler that knows which samples of the
    epoch were processed, so that after a reset the new set of ranks shares out only
    the others.

    Every rank iterates over its stride of the epoch's unprocessed indices (shuffled
    with ``seed + epoch`` when ``shuffle``, the same on every rank; padded by repeating
    indices so each rank gets ``len(self)``). Track it in a :class:`TorchState`, call
    :meth:`record_batch` after each batch and :meth:`set_epoch` at the *end* of each
    epoch, before the commit that ends it.

    ``record_batch(i, batch_size)`` records batch ``i`` of every rank, not only this
    one's (the ranks step in lockstep, so each knows the others' batches): what a rank
    lost since the commit processed is then not lost with it. :meth:`record_indices`
    records what it is given; TorchState unions every rank's record at each sync.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: Set[int] = set()
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: List[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.indices: List[int] = []      # this rank's indices of the pass
        self._order: List[int] = []       # every rank's: rank r has _order[r::num_replicas]
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch`` with no sample processed (call it when an epoch ends)."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def get_indices(self, batch_idx: int, batch_size: int) -> List[int]:
        """This rank's dataset indices of batch ``batch_idx`` of the current pass."""
        start = batch_idx * batch_size
        return self.indices[start:start + batch_size]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Marks batch ``batch_idx`` of the current pass processed, on every rank."""
        n = self.num_replicas
        end = min((batch_idx + 1) * batch_size, self.num_samples)
        self.record_indices(self._order[batch_idx * batch_size * n:end * n])

    def record_indices(self, indices: Iterable) -> None:
        """Marks these dataset indices processed."""
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Shares the epoch's unprocessed indices out over the current ranks."""
        self.num_replicas, self.rank = size(), rank()
        self.remaining_indices = [i for i in range(len(self.dataset))
                                  if i not in self.processed_indices]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        order = list(self.remaining_indices)
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        while order and len(order) < self.total_size:  # pad: every rank gets num_samples
            order += order[:self.total_size - len(order)]
        self._order = order
        self.indices = order[self.rank:self.total_size:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return self.num_samples


# -- TorchState: one handler per tracked object ------------------------------------------

class _Handler:
    """Keeps one tracked object's saved copy: save/restore are local, sync collective."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.save()

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        # A copy: load_state_dict may keep the tensors it is given (an optimizer's
        # buffers), and training would then change the saved state in place.
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))

    def on_reset(self) -> None:
        """After every reset, synced or not (the ranks may have new numbers)."""


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def restore(self) -> None:
        clear = getattr(self.value, "_hvd_clear_pending", None)
        if clear is not None:  # a DistributedOptimizer, maybe failed mid-step
            clear()
        super().restore()

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def sync(self) -> None:
        """Rank 0's epoch; processed: every rank's record of that epoch."""
        states = allgather_object(self.value.state_dict())
        epoch = states[0]["epoch"]
        processed = set().union(*(s["processed_indices"] for s in states
                                  if s["epoch"] == epoch))
        self.value.load_state_dict({"epoch": epoch, "processed_indices": processed})

    def on_reset(self) -> None:
        self.value.reset()


_HANDLERS = ((torch.nn.Module, _ModelHandler), (torch.optim.Optimizer, _OptimizerHandler),
             (torch.optim.lr_scheduler.LRScheduler, _Handler), (ElasticSampler, _SamplerHandler))


def _handler_for(value: Any) -> Optional[_Handler]:
    for kind, handler in _HANDLERS:
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """Horovod's TorchState: ``TorchState(model, optimizer, sampler=..., epoch=0)``.

    Each argument becomes an attribute. Modules, optimizers (DistributedOptimizer
    included), learning-rate schedulers and ElasticSamplers are kept through their
    ``state_dict``: commit saves deep copies, restore loads them back, sync broadcasts
    rank 0's parameters and buffers (``broadcast_parameters``), optimizer state
    (``broadcast_optimizer_state``) and scheduler state, and merges the samplers'
    records (see :class:`ElasticSampler`). Anything else is kept as in
    :class:`ObjectState`. Assigning a new object to a tracked name tracks it instead
    (and saves it).
    """

    def __init__(self, model: Optional[torch.nn.Module] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: Dict[str, _Handler] = {}
        plain: Dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        self._handlers = handlers
        for name, handler in handlers.items():
            setattr(self, name, handler.value)
        super().__init__(broadcast_object, rank, **plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers and name in self.__dict__:
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
            handler.save()  # a failure before the next commit comes back to this
        super().sync()

    def on_reset(self) -> None:
        for handler in self._handlers.values():
            handler.on_reset()
        super().on_reset()
