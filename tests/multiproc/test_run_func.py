"""spark_hvd.runner.run (Horovod's horovod.runner.run): a Python function as N ranks,
its return values by rank."""

import sys

import cloudpickle
import pytest

import spark_hvd
from spark_hvd.exceptions import InvalidArgumentError, RankFailedError
from spark_hvd.runner import run

from test_hvdrun import ENV

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import it


def _sum_of_ranks(scale, offset=0):
    import numpy as np

    import spark_hvd as hvd

    hvd.init()
    total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum, name="sum")
    return {"rank": hvd.rank(), "size": hvd.size(), "value": float(total[0]) * scale + offset}


def _rank_1_fails():
    import spark_hvd as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise KeyError("no such weights")
    return hvd.rank()


def test_values_come_back_in_rank_order():
    got = run(_sum_of_ranks, args=(2,), kwargs={"offset": 1}, np=3, env=ENV)
    assert got == [{"rank": r, "size": 3, "value": 13.0} for r in range(3)]
    assert spark_hvd.run is run  # horovod.run is there too


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
