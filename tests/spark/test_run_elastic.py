"""spark_hvd.spark.run_elastic on ``local[2]``: a worker lost mid-training, an
undisturbed job, and the checks made before anything starts.

The functions the workers run are module-level functions of this module, pickled by
value (the executors cannot import this test module).
"""

import io
import os
import re
import sys

import cloudpickle
import pytest

import spark_hvd.spark
from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.spark import runner

cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS, KILL_AT = 30, 10


def _no_active_jobs(spark, wait_s=15.0):
    """Whether Spark shows no active job within ``wait_s`` (its status tracker learns that a
    job ended through the listener bus, a moment after the job did)."""
    import time

    deadline = time.monotonic() + wait_s
    while spark.sparkContext.statusTracker().getActiveJobsIds():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _wait_file(path, what, timeout_s=60.0):
    """Waits for another worker's marker file (the workers share the driver's disk)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} ({path}) did not happen within {timeout_s} s")
        time.sleep(0.01)


def _train_losing_rank_1_once(marker_dir):
    """An elastic loop that sums allreduces of ones (each adds the job's size); rank 1
    SIGKILLs its own process once, at step KILL_AT."""
    import signal

    import numpy as np

    import spark_hvd as hvd
    import spark_hvd.elastic

    hvd.init()
    state = spark_hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=0, total=0.0)
    starts = []  # (step, size) at each (re)start of train: not part of the state

    @spark_hvd.elastic.run
    def train(state):
        starts.append((state.step, hvd.size()))
        while state.step < STEPS:
            if state.step == KILL_AT and hvd.rank() == 1:
                try:
                    os.close(os.open(os.path.join(marker_dir, "killed"),
                                     os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    pass
                else:
                    os.kill(os.getpid(), signal.SIGKILL)
            state.total += float(hvd.allreduce(np.ones(4), op=hvd.Sum, name="ones")[0])
            state.step += 1
            state.commit()

    train(state)
    return {"rank": hvd.rank(), "size": hvd.size(), "step": state.step, "total": state.total,
            "starts": starts}


def _rank_and_sum():
    import numpy as np

    import spark_hvd as hvd

    hvd.init()
    total = hvd.allreduce(np.full(3, hvd.rank() + 1.0), op=hvd.Sum, name="ranks")
    print(f"rank {hvd.rank()} of {hvd.size()}")
    return hvd.rank(), hvd.size(), total.tolist()


@pytest.mark.spark
def test_a_lost_worker_leaves_the_survivor_to_finish_from_its_last_commit(spark_local,
                                                                          tmp_path, capsys):
    results = spark_hvd.spark.run_elastic(_train_losing_rank_1_once, args=(str(tmp_path),),
                                          num_proc=2, min_num_proc=1, start_timeout=60,
                                          elastic_timeout=30, spark=spark_local)
    assert (tmp_path / "killed").exists()
    # the survivor went on from its commit at step KILL_AT, alone: 2 per step, then 1
    assert results == [{"rank": 0, "size": 1, "step": STEPS,
                        "total": 2.0 * KILL_AT + (STEPS - KILL_AT),
                        "starts": [(0, 2), (KILL_AT, 1)]}]
    err = capsys.readouterr().err
    assert re.search(r"run_elastic: epoch 1: 2 ranks \(workers \d+, \d+\)", err), err
    assert re.search(r"run_elastic: worker \d+ .*lost \(rank 1 of epoch 1\)", err), err
    assert re.search(r"run_elastic: worker \d+ ended: its process was killed by signal 9", err)
    assert re.search(r"run_elastic: epoch 2: 1 ranks \(workers \d+\), reset 1", err), err
    assert _no_active_jobs(spark_local)


def _train_until_two_ranks(marker_dir):
    """Commits every step and goes on until the job has 2 ranks. The second worker to get
    here asks for a place only once the first has trained 5 steps alone (it arrives while
    the first trains), and the first waits for it there, then commits until the new
    worker is announced."""
    import numpy as np

    import spark_hvd as hvd
    import spark_hvd.elastic

    trained, second = (os.path.join(marker_dir, name) for name in ("trained", "second"))
    try:
        os.close(os.open(os.path.join(marker_dir, "first"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        _wait_file(trained, "the first worker training 5 steps alone")
        open(second, "w").close()
    hvd.init()
    state = spark_hvd.elastic.ObjectState(step=0, total=0.0)

    @spark_hvd.elastic.run
    def train(state):
        while state.step < 5 or hvd.size() < 2:
            state.total += float(hvd.allreduce(np.ones(2), op=hvd.Sum, name="ones")[0])
            state.step += 1
            if state.step == 5 and hvd.size() == 1:
                open(trained, "w").close()
                _wait_file(second, "the second worker asking for a place")
            state.commit()

    train(state)
    return {"rank": hvd.rank(), "size": hvd.size(), "step": state.step, "total": state.total}


@pytest.mark.spark
def test_a_worker_that_starts_later_joins_up_to_max_num_proc(spark_local, tmp_path, capsys):
    """num_proc=1, max_num_proc=2: the job starts with the first worker to ask; the second
    task's worker is announced to it and joins at its next commit, with its state."""
    results = spark_hvd.spark.run_elastic(_train_until_two_ranks, args=(str(tmp_path),),
                                          num_proc=1, max_num_proc=2,
                                          start_timeout=60, elastic_timeout=30,
                                          spark=spark_local)
    err = capsys.readouterr().err
    assert [r["rank"] for r in results] == [0, 1], (results, err)
    assert all(r["size"] == 2 for r in results), results
    assert results[0]["step"] == results[1]["step"], results
    assert results[0]["total"] == results[1]["total"], results
    assert re.search(r"run_elastic: epoch 1: 1 ranks", err), err
    assert re.search(r"run_elastic: epoch 2: 2 ranks", err), err
    assert _no_active_jobs(spark_local)


@pytest.mark.spark
def test_an_undisturbed_job_returns_every_rank_s_value_in_rank_order(spark_local):
    out = io.StringIO()
    results = spark_hvd.spark.run_elastic(_rank_and_sum, num_proc=2, stdout=out, verbose=0,
                                          spark=spark_local)
    assert results == [(0, 2, [3.0] * 3), (1, 2, [3.0] * 3)]
    lines = sorted(out.getvalue().splitlines())
    assert len(lines) == 2 and all(re.fullmatch(r"\[w\d+\] rank [01] of 2", ln) for ln in lines)
    assert _no_active_jobs(spark_local)


@pytest.mark.spark
@pytest.mark.parametrize("kwargs, match", [
    (dict(num_proc=2, min_num_proc=3, max_num_proc=4), "min_num_proc <= num_proc"),
    (dict(num_proc=3, max_num_proc=2), "min_num_proc <= num_proc <= max_num_proc"),
    (dict(min_num_proc=2, max_num_proc=1), "min_num_proc <= num_proc <= max_num_proc"),
    (dict(num_proc=0), "num_proc must be an int >= 1"),
    (dict(num_proc=2, reset_limit=-1), "reset_limit must be an int >= 0"),
    (dict(num_proc=2, elastic_timeout=0), "elastic_timeout must be a number"),
    (dict(num_proc=2, min_np=1, min_num_proc=1), "min_np is the deprecated name"),
    (dict(num_proc=2, nics=["eth0"]), "nics"),
    (dict(num_proc=3, min_num_proc=3), r"min_num_proc=3 is more than the 2 tasks"),
])
def test_arguments_that_cannot_work_fail_before_anything_starts(spark_local, monkeypatch,
                                                                kwargs, match):
    def no_launch(*args, **kwargs):
        raise AssertionError("run_elastic started a job")

    monkeypatch.setattr(runner, "_start_server", no_launch)
    with pytest.raises(InvalidArgumentError, match=match):
        spark_hvd.spark.run_elastic(_rank_and_sum, spark=spark_local, **kwargs)
