"""spark_hvd.runner.run (Horovod's horovod.runner.run): a Python function as N ranks,
its return values by rank."""

import sys

import cloudpickle
import pytest

import spark_hvd
from spark_hvd.exceptions import InvalidArgumentError, RankFailedError
from spark_hvd.runner import run

from test_hvdrun import ENV, needs_mpirun

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import it


def _sum_of_ranks(scale, offset=0):
    import numpy as np

    import spark_hvd as hvd

    hvd.init()
    total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum, name="sum")
    return {"rank": hvd.rank(), "size": hvd.size(), "value": float(total[0]) * scale + offset}


def _under_mpi():
    """This rank's place as MPI gives it (mpirun's environment) and as the job sees it."""
    import os

    import numpy as np

    import spark_hvd as hvd

    hvd.init()
    total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum, name="sum")
    return {"rank": hvd.rank(), "mpi_rank": int(os.environ["OMPI_COMM_WORLD_RANK"]),
            "mpi_enabled": hvd.mpi_enabled(), "value": float(total[0])}


def _rank_1_fails():
    import spark_hvd as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise KeyError("no such weights")
    return hvd.rank()


def _leaves_work_for_the_exit(where):
    """A thread still running, an atexit handler, and an object only the interpreter's
    teardown would finalize; each leaves a file named for it and the rank."""
    import atexit
    import os
    import threading
    import time

    import spark_hvd as hvd

    hvd.init()
    rank = hvd.rank()

    def mark(what):
        os.close(os.open(os.path.join(where, f"{what}.{rank}"), os.O_CREAT | os.O_WRONLY))

    class Teardown:
        def __del__(self):
            mark("finalized")

    sys.modules["__main__"].left_behind = Teardown()
    atexit.register(mark, "atexit")
    threading.Thread(target=lambda: (time.sleep(0.2), mark("thread"))).start()
    return rank


def test_a_rank_ends_as_python_would_without_tearing_the_interpreter_down(tmp_path):
    """Once its value is stored a rank joins its threads, runs the atexit handlers (the
    job's shutdown is one) and leaves without the interpreter's teardown, which takes
    seconds once torch is imported (a run of a torch function at 2 ranks: 2.6-3.0 s
    against 4.1-4.6 s): a module global's finalizer, which only that teardown would call,
    does not run."""
    assert run(_leaves_work_for_the_exit, args=(str(tmp_path),), np=2, env=ENV) == [0, 1]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["atexit.0", "atexit.1", "thread.0", "thread.1"], left


def test_values_come_back_in_rank_order():
    got = run(_sum_of_ranks, args=(2,), kwargs={"offset": 1}, np=3, env=ENV)
    assert got == [{"rank": r, "size": 3, "value": 13.0} for r in range(3)]
    assert spark_hvd.run is run  # horovod.run is there too


@needs_mpirun
def test_use_mpi_launches_the_ranks_through_mpirun():
    """use_mpi=True (horovod.run's): mpirun starts the ranks, which run the function and
    send their values back as under the Gloo-style launch."""
    got = run(_under_mpi, np=2, use_mpi=True, env=ENV)
    assert got == [{"rank": r, "mpi_rank": r, "mpi_enabled": True, "value": 3.0} for r in range(2)]


def test_a_rank_that_raises_fails_the_run_with_its_traceback(capfd):
    with pytest.raises(RankFailedError) as info:
        run(_rank_1_fails, np=2, env=ENV)
    assert "exit code 1" in str(info.value)
    assert "KeyError: 'no such weights'" in capfd.readouterr().err


@pytest.mark.parametrize("kwargs, needle", [
    (dict(hostfile="hosts.txt"), "hosts='host1:4"),
    (dict(mpi_args="--bind-to none"), "use_mpi=True"),
    (dict(use_gloo=True, use_mpi=True), "exclude each other"),
    (dict(slots=2), "slots= goes with min_np"),
])
def test_arguments_it_cannot_honour_are_refused(kwargs, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        run(_sum_of_ranks, args=(1,), np=2, **kwargs)
    with pytest.raises(InvalidArgumentError, match="callable"):
        run("not a function", np=1)
