"""The elastic coordinator, driven through a real rendezvous server by clients acting as
workers (spark_hvd._job.elastic's protocol, no collectives)."""

import json
import threading

import pytest

from _ranks import poll_until

from spark_hvd._job import elastic as proto
from spark_hvd.runner._elastic import Coordinator
from spark_hvd.runner.rendezvous import RendezvousClient, RendezvousServer

WAIT_S = 10.0  # upper bound for what should happen at once


class Worker:
    """One elastic worker: registered in group "w" as its id, asking for places."""

    def __init__(self, server: RendezvousServer, worker: int) -> None:
        self.id = worker
        self.store = server.store
        self.client = RendezvousClient("127.0.0.1", server.port, server.secret, server.run_id)
        self.client.register_rank(worker, host=f"host{worker}", group=proto.WORKER_GROUP)
        self.requests = 0
        self._thread = None
        self._result = None

    def ask(self, lost=()) -> "Worker":
        """Asks for a place in a thread (naming `lost` workers lost); :meth:`answer` waits
        for what came back."""
        self.requests += 1

        def run(n=self.requests):
            try:
                self._result = proto.join(self.client, self.id, n, f"host{self.id}", WAIT_S,
                                          lost=lost)
            except Exception as e:  # noqa: BLE001 - the answer under test
                self._result = e

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def asked(self) -> bool:
        """Whether its last request is in the store (where the coordinator reads it)."""
        key = f"{proto.JOIN}{self.id}"
        return self.store.check([key]) and json.loads(self.store.get(key, 0))["n"] == self.requests

    def answer(self):
        self._thread.join(WAIT_S + 1)
        assert not self._thread.is_alive(), f"worker {self.id} got no answer"
        return self._result

    def crash(self) -> None:
        self.client._registration.sock.close()  # the connection drops without a goodbye

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def job():
    """``start(**kwargs)`` -> (coordinator, log lines, workers(n) -> [Worker])."""
    server = RendezvousServer(host="127.0.0.1")
    server.start()
    made, coordinators = [], []

    def start(num_proc=2, min_num_proc=None, max_num_proc=None, start_timeout_s=30.0,
              elastic_timeout_s=10.0, reset_limit=None, **kwargs):
        log = []
        c = Coordinator(server, num_proc, min_num_proc or num_proc, max_num_proc or num_proc,
                        start_timeout_s, elastic_timeout_s, reset_limit, log=log.append,
                        **kwargs).start()
        coordinators.append(c)

        def workers(*ids):
            ws = [Worker(server, i) for i in ids]
            made.extend(ws)
            return ws

        return c, log, workers

    yield start
    for c in coordinators:
        c.stop()
    for w in made:
        w.close()
    server.stop()


def formed(*workers):
    """The epoch every worker got (the same one), after asking."""
    epochs = [w.answer() for w in workers]
    for e in epochs:
        assert isinstance(e, proto.Epoch), e
    assert len({e.number for e in epochs}) == 1
    return epochs[0]


def until(predicate, timeout_s=WAIT_S):
    assert poll_until(predicate, timeout_s), f"still not true after {timeout_s} s"


def seen(c, *workers):
    """Returns once the workers' requests are in the store and the coordinator has made
    a whole pass since: what it does about them, it has done."""
    until(lambda: all(w.asked() for w in workers))
    passes = c.steps
    until(lambda: c.steps >= passes + 2)  # the first may have begun before the requests


class Clock:
    """A clock the test moves: the coordinator's timeouts without waiting them out."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_first_epoch_forms_once_num_proc_workers_ask(job):
    c, log, workers = job(num_proc=3, min_num_proc=2, max_num_proc=4)
    w = workers(2, 0, 1)
    w[0].ask(), w[1].ask()
    seen(c, w[0], w[1])
    assert c.epoch == 0 and c.members() == []  # 2 of 3, before the start timeout
    w[2].ask()
    epoch = formed(*w)
    assert (epoch.number, epoch.workers, epoch.hosts) == (1, [0, 1, 2], ["host0", "host1", "host2"])
    assert epoch.topology_of(2).rank == 2 and epoch.topology_of(2).size == 3
    assert c.members() == [0, 1, 2] and c.resets == 0
    assert log == ["epoch 1: 3 ranks (workers 0, 1, 2)"]


def test_first_epoch_forms_with_min_num_proc_after_the_start_timeout(job):
    c, _, workers = job(num_proc=3, min_num_proc=2, max_num_proc=3, start_timeout_s=0.3)
    w = workers(0, 1)
    assert formed(*[x.ask() for x in w]).workers == [0, 1]


def test_survivors_keep_their_rank_order_and_newcomers_follow(job):
    c, log, workers = job(num_proc=3, min_num_proc=2, max_num_proc=4)
    w0, w1, w2 = workers(0, 1, 2)
    assert formed(w0.ask(), w1.ask(), w2.ask()).workers == [0, 1, 2]
    w1.crash()
    until(lambda: any("worker 1" in line and "lost" in line for line in log))
    (w3,) = workers(3)
    w3.ask(), w2.ask()  # the newcomer and the higher rank ask first
    seen(c, w3, w2)
    assert c.epoch == 1  # w0, a live member, has not asked yet
    w0.ask()
    epoch = formed(w0, w2, w3)
    assert (epoch.number, epoch.workers) == (2, [0, 2, 3])
    assert c.resets == 1 and log[-1] == "epoch 2: 3 ranks (workers 0, 2, 3), reset 1"


def test_a_member_the_others_name_lost_is_left_out_if_it_does_not_ask(job):
    """A host cut off keeps its worker's registration open (until TCP keepalive gives up);
    the survivors' requests name it lost: once it has not asked for NAMED_LOST_GRACE_S
    after being named, the epoch forms without it, and a later request of its own is
    answered removed. A member named lost that does ask is kept."""
    from spark_hvd.runner import _elastic

    clock = Clock()
    c, log, workers = job(num_proc=4, min_num_proc=2, clock=clock)
    w0, w1, w2, w3 = workers(0, 1, 2, 3)
    formed(w0.ask(), w1.ask(), w2.ask(), w3.ask())
    w0.ask(lost=[2, 3]), w1.ask(lost=[2, 3])
    seen(c, w0, w1)
    w3.ask(lost=[0])  # named, but it asks: it stays
    seen(c, w3)
    clock.now += _elastic.NAMED_LOST_GRACE_S - 0.5
    seen(c, w0, w1, w3)
    assert c.epoch == 1  # not yet: w2 may still ask
    clock.now += 1.0
    epoch = formed(w0, w1, w3)
    assert (epoch.number, epoch.workers) == (2, [0, 1, 3])
    assert any("worker 2 on host2 lost (rank 2 of epoch 1): the others named it lost" in line
               for line in log), log
    assert 2 in c.gone() and 2 in c.alive()  # still registered: cut off, not crashed
    assert isinstance(w2.ask().answer(), proto.WorkerRemoved)


def test_a_member_left_out_on_being_named_is_logged_once(job):
    """The pass that leaves a named member out need not form the epoch (another member
    has not asked yet): the passes after it do not name it lost again."""
    from spark_hvd.runner import _elastic

    clock = Clock()
    c, log, workers = job(num_proc=3, min_num_proc=2, clock=clock)
    w0, w1, w2 = workers(0, 1, 2)
    formed(w0.ask(), w1.ask(), w2.ask())
    w0.ask(lost=[2])
    seen(c, w0)
    clock.now += _elastic.NAMED_LOST_GRACE_S + 0.5
    seen(c, w0)
    seen(c, w0)  # more passes while w1 has not asked
    assert c.epoch == 1
    w1.ask()
    epoch = formed(w0, w1)
    assert (epoch.number, epoch.workers) == (2, [0, 1])
    named = [line for line in log if "worker 2 on host2 lost" in line]
    assert len(named) == 1, log


def test_a_newcomer_is_announced_to_the_running_epoch(job):
    clock = Clock()
    c, log, workers = job(num_proc=2, min_num_proc=2, max_num_proc=3, elastic_timeout_s=0.3,
                          clock=clock)
    w0, w1 = workers(0, 1)
    epoch = formed(w0.ask(), w1.ask())
    assert proto.pending_updates(w0.client, epoch.updates) is None
    (w2,) = workers(2)
    w2.ask()
    until(lambda: proto.pending_updates(w0.client, epoch.updates) is not None)
    assert proto.pending_updates(w0.client, epoch.updates) is False  # an addition: sync
    seen(c, w2)
    clock.now += 0.6  # twice the elastic timeout: a newcomer waiting is not a short job
    seen(c, w2)
    assert c.error is None and c.epoch == 1
    assert "worker 2 waiting to join epoch 1's 2 ranks" in log
    new = formed(w0.ask(), w1.ask(), w2)
    assert new.workers == [0, 1, 2] and new.updates > epoch.updates


def test_a_removed_worker_is_answered_removed(job):
    c, _, workers = job(num_proc=3, min_num_proc=2, max_num_proc=3)
    w0, w1, w2 = workers(0, 1, 2)
    epoch = formed(w0.ask(), w1.ask(), w2.ask())
    c.remove(1)
    until(lambda: proto.pending_updates(w0.client, epoch.updates) is not None)
    assert proto.pending_updates(w0.client, epoch.updates) is True  # removals only: no sync
    w1.ask(), w0.ask(), w2.ask()
    assert isinstance(w1.answer(), proto.WorkerRemoved)
    assert formed(w0, w2).workers == [0, 2]
    assert c.members() == [0, 2]


def test_reset_limit_fails_the_waiting_workers(job):
    c, log, workers = job(num_proc=2, reset_limit=0,
                          names={"reset_limit": "--reset-limit {}"})
    w0, w1 = workers(0, 1)
    formed(w0.ask(), w1.ask())
    w0.ask(), w1.ask()
    for answer in (w0.answer(), w1.answer()):
        assert isinstance(answer, proto.ElasticJobError)
        assert "reset limit reached" in str(answer) and "--reset-limit 0" in str(answer)
    assert c.error == str(answer) and log[-1] == f"elastic job failed: {c.error}"
    (late,) = workers(5)
    assert isinstance(late.ask().answer(), proto.ElasticJobError)  # and so is anyone later


def test_too_few_workers_for_the_elastic_timeout_fail_the_job(job):
    c, log, workers = job(num_proc=2, min_num_proc=2, elastic_timeout_s=0.3)
    w0, w1 = workers(0, 1)
    formed(w0.ask(), w1.ask())
    w1.crash()
    answer = w0.ask().answer()
    assert isinstance(answer, proto.ElasticJobError)
    assert "only 1 worker after waiting 0.3 s" in str(answer)
    assert "min_num_proc=2" in str(answer)
    assert "1 worker ready, fewer than min_num_proc=2: waiting up to 0.3 s for more" in log


def test_too_few_workers_at_the_start_fail_after_start_and_elastic_timeouts(job):
    c, _, workers = job(num_proc=3, min_num_proc=2, max_num_proc=3, start_timeout_s=0.2,
                        elastic_timeout_s=0.2)
    (w0,) = workers(0)
    answer = w0.ask().answer()
    assert isinstance(answer, proto.ElasticJobError) and "fewer than min_num_proc=2" in str(answer)
    assert c.epoch == 0


def test_once_a_member_finished_waiting_workers_leave_and_stuck_members_fail(job):
    """A member that leaves cleanly (its function returned) ends the job: a newcomer is
    told to leave, not given an epoch of its own; a member still asking to re-form
    failed after its peer finished, and the job fails saying so."""
    c, log, workers = job(num_proc=2, min_num_proc=1, max_num_proc=3)
    w0, w1 = workers(0, 1)
    formed(w0.ask(), w1.ask())
    w0.close()  # a goodbye: rank 0 finished
    until(lambda: 0 not in c.alive())
    (w2,) = workers(2)
    assert isinstance(w2.ask().answer(), proto.WorkerRemoved)
    assert isinstance(w1.ask().answer(), proto.ElasticJobError)
    assert c.epoch == 1 and "rank(s) 0 of epoch 1 finished while rank(s) 1" in c.error
