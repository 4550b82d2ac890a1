"""Elastic state in one process: ElasticSampler's partitioning and records, the State /
ObjectState contract and run_fn's reset loop (with a fake reset), TorchState's
save/restore. No job: rank and size are patched where the sampler reads them."""

import pytest
import torch

import spark_hvd.elastic as core
import spark_hvd.torch as hvd
from spark_hvd.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from spark_hvd.torch import elastic


@pytest.fixture
def place(monkeypatch):
    """place(rank, size): what the sampler's next reset() sees."""
    def set_place(rank, size):
        monkeypatch.setattr(elastic, "rank", lambda: rank)
        monkeypatch.setattr(elastic, "size", lambda: size)
    set_place(0, 1)
    return set_place


def samplers(place, dataset, size, **kw):
    """One sampler per rank of a ``size``-rank job."""
    out = []
    for r in range(size):
        place(r, size)
        out.append(elastic.ElasticSampler(dataset, **kw))
    return out


# -- ElasticSampler ------------------------------------------------------------------

@pytest.mark.parametrize("n,size", [(12, 1), (12, 3), (10, 3), (2, 3), (0, 2), (7, 4)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_sampler_partitions_the_dataset(place, n, size, shuffle):
    ranks = samplers(place, list(range(n)), size, shuffle=shuffle, seed=5)
    per_rank = [list(s) for s in ranks]
    expect = -(-n // size)  # ceil
    assert all(len(s) == expect == len(idx) for s, idx in zip(ranks, per_rank))
    flat = [i for idx in per_rank for i in idx]
    assert sorted(set(flat)) == list(range(n))  # every index; the padding repeats some
    if not shuffle:  # rank r: r, r + size, ... of the indices, padded cyclically
        padded = [i % n for i in range(expect * size)] if n else []
        assert per_rank == [padded[r::size] for r in range(size)]


def test_sampler_shuffle_depends_on_seed_and_epoch(place):
    data = list(range(50))
    a, b, c = (elastic.ElasticSampler(data, seed=s) for s in (1, 1, 2))
    assert list(a) == list(b) != list(c)
    first = list(a)
    a.set_epoch(1)
    assert sorted(a) == sorted(first) and list(a) != first
    assert list(elastic.ElasticSampler(data, shuffle=False)) == data


def test_sampler_record_batch_records_every_ranks_batch(place):
    ranks = samplers(place, list(range(24)), 3, seed=3)
    for s in ranks:
        s.record_batch(0, 2)
        s.record_batch(1, 2)
    local = [set(s.get_indices(0, 2) + s.get_indices(1, 2)) for s in ranks]
    assert all(s.processed_indices == set().union(*local) for s in ranks)
    assert len(ranks[0].processed_indices) == 12
    # the last, partial batch: only what exists
    s = ranks[0]
    s.record_batch(3, 2)  # samples 6..7 of 8 per rank
    assert len(s.processed_indices) == 18


def test_sampler_reset_shares_out_only_the_unprocessed_indices(place):
    data = list(range(30))
    ranks = samplers(place, data, 3, seed=11)
    batches = [[], [], []]
    for i in range(2):  # two batches of 3 on each of 3 ranks
        for r, s in enumerate(ranks):
            batches[r] += s.get_indices(i, 3)
            s.record_batch(i, 3)
    done = set().union(*map(set, batches))
    assert len(done) == 18
    state = ranks[0].state_dict()
    # a rank was lost: the two others re-form and share out the 12 left
    survivors = []
    for r in range(2):
        place(r, 2)
        survivors.append(elastic.ElasticSampler(data, seed=11))
        survivors[-1].load_state_dict(state)
    rest = [list(s) for s in survivors]
    assert [len(x) for x in rest] == [6, 6]
    assert sorted(rest[0] + rest[1] + sorted(done)) == data
    # reset() alone re-reads the place: 1 rank takes all 12
    place(0, 1)
    survivors[0].reset()
    assert sorted(survivors[0]) == sorted(set(data) - done)


def test_sampler_state_dict_round_trip(place):
    s = elastic.ElasticSampler(list(range(20)), seed=4)
    s.set_epoch(3)
    s.record_indices(torch.tensor([1, 2, 3]))
    s.record_indices([5])
    sd = s.state_dict()
    assert sd == {"epoch": 3, "processed_indices": {1, 2, 3, 5}}
    sd["processed_indices"].add(7)  # a copy: the sampler does not change
    assert s.processed_indices == {1, 2, 3, 5}
    assert len(s) == 20  # records change the next pass, from the next reset()
    t = elastic.ElasticSampler(list(range(20)), seed=4)
    t.load_state_dict(s.state_dict())
    s.reset()
    assert t.epoch == 3 and list(t) == list(s) and len(t) == 16
    assert not {1, 2, 3, 5} & set(t)
    s.set_epoch(4)
    assert s.processed_indices == set() and len(s) == 20


# -- State, ObjectState, run_fn ------------------------------------------------------

class Calls:
    def __init__(self):
        self.log = []

    def bcast(self, obj):
        self.log.append(("bcast", obj))
        return obj


def test_object_state_commit_restore_sync():
    calls = Calls()
    state = core.ObjectState(calls.bcast, lambda: 0, epoch=0, seen=[1])
    assert state.epoch == 0 and state.seen == [1]
    state.epoch, state.seen = 5, [1, 2]
    state.commit()  # outside an elastic job: saves, no host check (no broadcast)
    assert calls.log == []
    state.seen.append(3)  # saved values are copies
    state.epoch = 9
    state.restore()
    assert (state.epoch, state.seen) == (5, [1, 2])
    state.sync()
    assert calls.log == [("bcast", {"epoch": 5, "seen": [1, 2]})]


def test_check_host_updates_outside_an_elastic_job_is_a_no_op():
    def bcast(obj):
        raise AssertionError("no broadcast outside an elastic job")
    state = core.ObjectState(bcast, lambda: 0, x=1)
    state.check_host_updates()
    state.commit()


def test_reset_callbacks_run_in_order():
    state = core.ObjectState(lambda o: o, lambda: 0)
    seen = []
    state.register_reset_callbacks([lambda: seen.append(1)])
    state.register_reset_callbacks([lambda: seen.append(2), lambda: seen.append(3)])
    state.on_reset()
    assert seen == [1, 2, 3]


@pytest.fixture
def elastic_job(monkeypatch):
    """run_fn as in an elastic job (a failure re-forms it), without one."""
    monkeypatch.setattr(core, "_in_elastic_job", lambda: True)
    monkeypatch.setattr(core, "_pending_updates", lambda: None)


def test_run_fn_restores_after_a_failure_and_keeps_state_after_an_interrupt(elastic_job):
    log = []

    def bcast(obj):  # sync broadcasts the saved attributes, commit the host check
        log.append("sync" if isinstance(obj, dict) else "check")
        return obj

    state = core.ObjectState(bcast, lambda: 0, step=0)
    state.register_reset_callbacks([lambda: log.append("callback")])
    errors = [HorovodInternalError("lost"), HostsUpdatedInterrupt(True),
              HostsUpdatedInterrupt(False)]

    def train(state, until):
        log.append(f"train@{state.step}")
        state.step += 1
        state.commit()
        state.step += 1  # not committed
        if errors:
            raise errors.pop(0)
        return until

    wrapped = core.run_fn(train, lambda: log.append("reset"))
    assert wrapped(state, "done") == "done"
    assert log == ["sync", "train@0", "check",                        # failure: the commit
                   "reset", "callback", "sync", "train@1", "check",   # interrupt, skip_sync:
                   "reset", "callback", "train@3", "check",           # kept as it is
                   "reset", "callback", "sync", "train@4", "check"]   # synced: the commit's
    assert state.step == 6


def test_run_fn_outside_an_elastic_job_fails_on_a_failure():
    log = []
    state = core.ObjectState(lambda o: o, lambda: 0)

    def train(state):
        raise HorovodInternalError("lost")

    with pytest.raises(HorovodInternalError, match="lost"):
        core.run_fn(train, lambda: log.append("reset"))(state)
    assert log == []


def test_run_fn_retries_a_reset_that_fails(elastic_job):
    attempts = []

    def reset():
        attempts.append(1)
        if len(attempts) < 3:
            raise HorovodInternalError("a rank was lost while the job re-formed")

    calls = []
    state = core.ObjectState(lambda o: o, lambda: 0)

    def train(state):
        calls.append(1)
        if len(calls) == 1:
            raise HorovodInternalError("lost")
        return "ok"

    assert core.run_fn(train, reset)(state) == "ok" and len(attempts) == 3


# -- TorchState ----------------------------------------------------------------------

def make_model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer


def step(model, optimizer):
    optimizer.zero_grad()
    model(torch.ones(4, 3)).pow(2).sum().backward()
    optimizer.step()


def test_torch_state_tracks_by_type(place):
    model, optimizer = make_model_and_optimizer()
    sampler = elastic.ElasticSampler(list(range(8)))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    state = elastic.TorchState(model, optimizer, sampler=sampler, scheduler=scheduler,
                               epoch=0)
    assert state.model is model and state.optimizer is optimizer and state.sampler is sampler
    assert sorted(state._handlers) == ["model", "optimizer", "sampler", "scheduler"]
    assert state.epoch == 0 and hvd.elastic is elastic
    assert elastic.TorchState(epoch=1).model is None  # nothing to track


def test_torch_state_restores_the_last_commit(place):
    model, optimizer = make_model_and_optimizer()
    sampler = elastic.ElasticSampler(list(range(8)))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    state = elastic.TorchState(model, optimizer, sampler=sampler, scheduler=scheduler, batch=0)
    step(model, optimizer)
    scheduler.step()
    sampler.record_indices([0, 1])
    state.batch = 1
    state.commit()
    committed = ({k: v.clone() for k, v in model.state_dict().items()},
                 optimizer.state_dict()["state"][0]["momentum_buffer"].clone(),
                 optimizer.param_groups[0]["lr"])
    for _ in range(2):  # twice: a restore must not hand the saved tensors to training
        step(model, optimizer)
        scheduler.step()
        sampler.record_indices([2, 3])
        state.batch = 7
        state.restore()
        assert all(torch.equal(v, committed[0][k]) for k, v in model.state_dict().items())
        assert torch.equal(optimizer.state_dict()["state"][0]["momentum_buffer"], committed[1])
        assert optimizer.param_groups[0]["lr"] == committed[2] == 0.05
        assert sampler.processed_indices == {0, 1} and len(sampler) == 6
        assert state.batch == 1


def test_torch_state_assigning_a_tracked_name_tracks_the_new_object(place):
    model, optimizer = make_model_and_optimizer()
    state = elastic.TorchState(model, optimizer)
    other = torch.nn.Linear(3, 2)
    state.model = other
    saved = other.weight.detach().clone()
    with torch.no_grad():
        other.weight.add_(1.0)
    state.restore()
    assert state.model is other and torch.equal(other.weight, saved)


def test_object_state_forms():
    from spark_hvd import _ops, _runtime

    plain = elastic.ObjectState(epoch=2)  # spark_hvd's broadcast_object and rank
    assert plain.epoch == 2 and elastic.ObjectState is core.ObjectState
    assert plain._bcast_object is _ops.broadcast_object and plain._rank is _runtime.rank
    log = []
    s = elastic.ObjectState(lambda o: (log.append(o), o)[1], lambda: 0, batch=3)  # Horovod's
    s.sync()
    assert log == [{"batch": 3}]


def test_hvd_elastic_is_reachable_from_the_bare_package_without_the_core():
    """``import spark_hvd as hvd; hvd.elastic.run`` works as Horovod's does, and reaching
    it loads no native core (a launcher or driver may touch it)."""
    import subprocess
    import sys

    code = ("import sys, spark_hvd as hvd; assert hvd.elastic.run and hvd.elastic.ObjectState;"
            "assert 'spark_hvd._core' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
