"""TorchEstimator(reader="petastorm") in the compat environment (petastorm 0.13.1, pyarrow
14, numpy 1.23, pyspark): it trains from the store's Parquet with
train_reader_num_workers, equal steps on both ranks, and ends where reader="arrow" ends on
the same data. With one step per epoch over each rank's whole (equal) share, both readers'
runs are full-batch gradient descent over every row, so the test compares the petastorm
fit with that descent run here (one fit, not two: CI time; the arrow reader's fits are
tests/estimators')."""

import numpy as np
import pytest


def _fit(spark, df, store, reader, **kw):
    import torch

    from spark_hvd.estimators import TorchEstimator

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    est = TorchEstimator(num_proc=2, store=store, model=net,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                         loss=torch.nn.functional.mse_loss, feature_cols=["features"],
                         label_cols=["y"], batch_size=64, epochs=3, shuffle=False,
                         random_seed=1, partitions_per_process=1, verbose=0, reader=reader,
                         **kw)
    model = est.fit(df)
    return [p.detach().numpy().copy() for p in model.getModel().parameters()]


def test_petastorm_reader_fits_as_full_batch_descent(spark, tmp_path):
    import torch

    from spark_hvd.estimators import LocalStore

    rs = np.random.RandomState(0)
    x = rs.randn(64, 4).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5, 3.0], dtype=np.float32) + 0.25
    df = spark.createDataFrame([(x[i].tolist(), float(y[i])) for i in range(64)],
                               "features array<float>, y float")
    store = LocalStore(str(tmp_path / "store"))
    fitted = _fit(spark, df, store, "petastorm", train_reader_num_workers=2)

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)  # the estimator's initial weights
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    start = [p.detach().numpy().copy() for p in net.parameters()]
    for _ in range(3):  # every row each epoch, averaged: what both readers' runs do
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(torch.from_numpy(x)),
                                     torch.from_numpy(y).reshape(-1, 1)).backward()
        opt.step()
    for got, want, before in zip(fitted, net.parameters(), start):
        want = want.detach().numpy()
        assert not np.allclose(want, before)
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), (got, want)


def test_petastorm_reader_on_a_store_it_cannot_read_is_refused_before_any_work(tmp_path):
    import pyarrow.fs as pafs
    import torch

    from spark_hvd.estimators import LocalStore, TorchEstimator
    from spark_hvd.exceptions import InvalidArgumentError

    class RemoteStore(LocalStore):  # a store on another filesystem than the local one
        @property
        def filesystem(self):
            return pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())

    net = torch.nn.Linear(4, 1)
    est = TorchEstimator(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                         loss=torch.nn.functional.mse_loss, feature_cols=["features"],
                         label_cols=["y"], store=RemoteStore(str(tmp_path)), reader="petastorm")
    with pytest.raises(InvalidArgumentError, match="reader='petastorm' reads a local store"):
        est._check_params(est._values())
