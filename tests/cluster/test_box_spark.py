"""spark_hvd on a real Spark standalone cluster across the box: a Master, a Worker per
host with 2 fake GPUs, one executor per host, the driver in this process. spark.run,
run_elastic, TorchDistributor and a TorchEstimator's fit and transform, each with its
ranks on several hosts."""

import os
import socket
import sys

import cloudpickle
import pytest

import rank_traffic
import spark_hvd.spark
from spark_hvd.spark import TorchDistributor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "spark"))
import ddp_program  # noqa: E402  (tests/spark's DDP program and its reference weights)

cloudpickle.register_pickle_by_value(ddp_program)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_run_spreads_ranks_over_hosts_shm_within_tcp_across(spark, box):
    """8 barrier tasks fill the 4 executors' 8 GPU slots: each host runs 2 ranks, each
    pinned to its own fake GPU; Spark numbers the ranks across the hosts in turn, so
    the flat ring crosses a cable at every hop (rank_traffic.check computes where)."""
    n = 2 * len(box.hosts)
    results = spark_hvd.spark.run(rank_traffic.measure, args=(rank_traffic.NBYTES,),
                                  num_proc=n, verbose=0)
    hosts = results[0]["hosts"]
    assert sorted(hosts) == sorted(box.names * 2), hosts
    for name in box.names:
        assert sorted(r["gpu"] for r in results if r["host"] == name) == ["0", "1"], results
    rank_traffic.check(results, rank_traffic.NBYTES, hierarchical=False)


STEPS = 20


def _elastic_steps(steps):
    import numpy as np

    import spark_hvd as hvd
    import spark_hvd.elastic

    hvd.init()
    state = spark_hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=0, total=0.0)

    @spark_hvd.elastic.run
    def train(state):
        while state.step < steps:
            state.total += float(hvd.allreduce(np.ones(2), op=hvd.Sum, name="ones")[0])
            state.step += 1
            state.commit()

    train(state)
    return {"rank": hvd.rank(), "size": hvd.size(), "host": socket.gethostname(),
            "local_size": hvd.local_size(), "total": state.total}


def test_run_elastic_forms_one_epoch_over_every_host(spark, box):
    n = 2 * len(box.hosts)
    results = spark_hvd.spark.run_elastic(_elastic_steps, args=(STEPS,), num_proc=n,
                                          min_num_proc=n // 2, start_timeout=120,
                                          elastic_timeout=60, verbose=0)
    assert sorted(r["rank"] for r in results) == list(range(n))
    assert {(r["size"], r["local_size"], r["total"]) for r in results} == {(n, 2, n * STEPS)}
    assert sorted(r["host"] for r in results) == sorted(box.names * 2)


def _ddp_on_hosts(steps):
    result = ddp_program.train(steps)
    import spark_hvd as hvd

    hvd.init()
    hosts = hvd.allgather_object(socket.gethostname())
    hvd.shutdown()
    return dict(result, hosts=hosts)


def test_torch_distributor_trains_ddp_across_hosts(spark, box):
    """pyspark's layout (each task a node of one process) on 2 barrier tasks, which Spark
    gives 2 executors (one task per executor first): the DDP weights are those one
    process reaches on both ranks' batches."""
    result = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
        _ddp_on_hosts, 3)
    assert (result["rank"], result["world"], result["local_rank"]) == (0, 2, 0)
    assert len(set(result["hosts"])) == 2 and set(result["hosts"]) <= set(box.names)
    expected = ddp_program.reference(3, 2)
    assert [pytest.approx(w, rel=1e-5, abs=1e-7) for w in expected] == result["weights"]


def test_torch_estimator_fits_on_ranks_across_hosts_and_transforms(reference_fit, box):
    """The digits MLP on 2 ranks: the ranks ran on 2 hosts, in one launch, and
    the model the fit returned predicts the held-out digits through transform."""
    launches = reference_fit["launches"]
    assert list(launches) == [0], launches
    assert sorted(launches[0]) == [0, 1] and len(set(launches[0].values())) == 2
    assert set(launches[0].values()) <= set(box.names)
    # 3 epochs of the digits MLP on 2 ranks: 0.896 in one clean-clone CI run (2026-12-06),
    # at least 0.9 in the runs before; chance is 0.1
    assert reference_fit["transform_accuracy"] >= 0.85, reference_fit
    # transform ran the fitted model: its predictions are the module's, run here (a row
    # or two may flip on a near tie of two outputs between batchings)
    assert abs(reference_fit["transform_accuracy"] - reference_fit["accuracy"]) <= 0.005, \
        reference_fit
