"""spark_hvd.spark.TorchDistributor, pyspark's TorchDistributor on spark_hvd's launch.

- Wrong arguments are named before anything starts (``local[2]``, no launch).
- ``local_mode=True`` (the processes on the driver host): an unchanged DDP program
  (``ddp_program.py``) as a function and as a script at 2 ranks, both reaching the weights
  one process reaches on both ranks' batches, and pyspark's TorchDistributor's on the same
  program (it runs here in local mode; on local-cluster it takes about a minute more);
  the same training under FSDP (``fully_shard``) reaching the same weights;
  a failing script; the driver's GPUs shared by every process (as torchrun), through a
  session that has driver GPU resources.
- ``local_mode=False`` on ``local-cluster[2,1,1024]`` (one barrier task per process): the
  same program as a function and as a script; a failing rank's traceback in the error.
Spark Connect: tests/spark/test_submit.py.
"""

import json
import os
import sys
from pathlib import Path

import cloudpickle
import pytest

import ddp_program
from spark_hvd.exceptions import InvalidArgumentError, RankFailedError
from spark_hvd.spark import TorchDistributor

# The processes cannot import this test directory: ship the programs by value.
cloudpickle.register_pickle_by_value(ddp_program)
cloudpickle.register_pickle_by_value(sys.modules[__name__])
SCRIPT = str(Path(ddp_program.__file__).resolve())
STEPS = 3


def _fail_on_rank_1():
    if os.environ["RANK"] == "1":  # torch.distributed's variable, set by TorchDistributor
        raise KeyError("no such weight")
    return "rank 0 ok"


def _script_results(out_dir):
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]


def _check_ddp(results, local_ranks):
    """Both ranks trained the model one process would on both ranks' batches (DDP), and
    spark_hvd's allreduce ran in the same processes."""
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["local_rank"] for r in results] == local_ranks
    assert all(r["world"] == 2 and r["sum"] == 1.0 for r in results)
    expected = ddp_program.reference(STEPS, 2)
    for r in results:
        assert [pytest.approx(w, rel=1e-5, abs=1e-7) for w in expected] == r["weights"]


@pytest.mark.spark
def test_wrong_arguments_are_named_before_anything_starts(spark_local, tmp_path):
    cases = [
        (dict(num_processes=0), "num_processes=0"),
        (dict(num_processes="2"), "num_processes='2'"),
        (dict(num_processes=2, local_mode="no"), "local_mode='no'"),
        (dict(num_processes=2, use_gpu=None), "use_gpu=None"),
        (dict(num_processes=2, verbose=3), "verbose=3"),
        # the driver of local[2] has no GPU resources; its tasks never get GPUs
        (dict(num_processes=2), "spark.driver.resource.gpu.amount"),
        (dict(num_processes=2, local_mode=False), "never assigns GPUs"),
        (dict(num_processes=3, local_mode=False, use_gpu=False), "more than the 2 tasks"),
    ]
    for kwargs, match in cases:
        with pytest.raises(InvalidArgumentError, match=match):
            TorchDistributor(**kwargs)
    distributor = TorchDistributor(num_processes=2, use_gpu=False)
    for args, kwargs, match in [
        ((42,), {}, "function or the path of a Python script, got int"),
        ((str(tmp_path / "missing.py"),), {}, "missing.py does not exist"),
        ((SCRIPT, "3"), {"lr": 0.1}, r"keyword arguments \['lr'\]"),
    ]:
        with pytest.raises(InvalidArgumentError, match=match):
            distributor.run(*args, **kwargs)


@pytest.mark.spark
@pytest.mark.timeout(600)
def test_local_mode_runs_a_ddp_function_and_script_on_the_driver_as_pyspark(spark_local,
                                                                           tmp_path, capfd,
                                                                           monkeypatch):
    from pyspark.ml.torch.distributor import TorchDistributor as PysparkTorchDistributor

    distributor = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    result = distributor.run(ddp_program.train, STEPS)
    assert distributor.run(SCRIPT, STEPS, tmp_path) is None  # args become strings
    scripts = _script_results(tmp_path)
    _check_ddp(scripts, [0, 1])  # one node of two processes, as torchrun --standalone
    assert result == scripts[0]  # the function's value is rank 0's
    out = capfd.readouterr().out.splitlines()
    assert "[0] trained rank 0/2" in out and "[1] trained rank 1/2" in out
    # pyspark's own, on the same program (its torchrun processes import it by name; under
    # pyspark, spark_hvd.init() in them is a job of one, whose sum is 0)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(SCRIPT).parent),
                                                      os.environ.get("PYTHONPATH", "")]))
    theirs = PysparkTorchDistributor(num_processes=2, local_mode=True,
                                     use_gpu=False).run(ddp_program.train, STEPS)
    # (In local mode every one of pyspark's processes writes the value to one file, so the
    # last to finish wins; ours is rank 0's, as pyspark documents.)
    assert theirs["world"] == 2 and theirs["local_rank"] == theirs["rank"]
    assert theirs["weights"] == result["weights"]

    # The same training under FSDP (fully_shard): each process holds half of every
    # parameter (a DTensor shard) and ends with DDP's weights.
    fsdp = distributor.run(ddp_program.train_fsdp, STEPS)
    assert (fsdp["rank"], fsdp["world"], fsdp["param"]) == (0, 2, "DTensor")
    assert fsdp["local_shape"] == [1, 4], fsdp  # Linear(4, 2)'s weight split by rows
    assert [pytest.approx(w, rel=1e-5, abs=1e-7) for w in ddp_program.reference(STEPS, 2)] \
        == fsdp["weights"]

    failing = tmp_path / "fail.py"
    failing.write_text("import os, sys\nprint('rank', os.environ['RANK'], 'fails', "
                       "file=sys.stderr)\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    with pytest.raises(RankFailedError, match="exited with code 3 on rank 1") as err:
        distributor.run(str(failing))
    assert "[1] rank 1 fails" in str(err.value)


def _gpu_env():
    return {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "RANK",
                                           "OMP_NUM_THREADS")}


class _DriverWithGpus:
    """A classic session's face as TorchDistributor reads it in local mode: the driver's GPU
    resources (spark.driver.resource.gpu.*), which a local[N] test session cannot have."""

    def __init__(self, addresses):
        from pyspark.resource.information import ResourceInformation

        self.sparkContext = type("Context", (), {
            "resources": {"gpu": ResourceInformation("gpu", addresses)}})()


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_local_mode_gives_every_process_the_driver_s_gpus(monkeypatch, caplog):
    # The driver owns Spark GPU addresses 1 and 2 of its CUDA_VISIBLE_DEVICES=4,6,7: both
    # processes see devices 6,7 and pick theirs by LOCAL_RANK, as under torchrun.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    distributor = TorchDistributor(num_processes=2, spark=_DriverWithGpus(["1", "2"]))
    assert distributor.run(_gpu_env) == {"CUDA_VISIBLE_DEVICES": "6,7", "LOCAL_RANK": "0",
                                         "RANK": "0", "OMP_NUM_THREADS": "1"}
    # More processes than GPUs: as pyspark, fewer processes, with a warning.
    three = TorchDistributor(num_processes=3, spark=_DriverWithGpus(["1"]))
    assert three.num_processes == 1 and "more than the driver's 1 GPUs" in caplog.text
    assert three.run(_gpu_env)["CUDA_VISIBLE_DEVICES"] == "6"


# -- local-cluster, in a pytest process of its own -----------------------------------

@pytest.mark.usefixtures("spark_cluster")
@pytest.mark.local_cluster
@pytest.mark.spark
@pytest.mark.timeout(900)
def test_cluster_mode_runs_a_ddp_function_and_script_in_barrier_tasks(tmp_path):
    ours = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    result = ours.run(ddp_program.train, STEPS)
    assert ours.run(SCRIPT, STEPS, tmp_path) is None
    scripts = _script_results(tmp_path)
    # pyspark's layout: each task is a node of one process, so LOCAL_RANK is 0 everywhere
    _check_ddp(scripts, [0, 0])
    assert scripts[0] == result


@pytest.mark.usefixtures("spark_cluster")
@pytest.mark.local_cluster
@pytest.mark.spark
@pytest.mark.timeout(900)
def test_cluster_mode_failure_carries_the_rank_s_traceback():
    with pytest.raises(RankFailedError) as err:
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(_fail_on_rank_1)
    text = str(err.value)
    assert "rank 1 failed: KeyError: 'no such weight'" in text
    assert "_fail_on_rank_1" in text  # the traceback's frame
