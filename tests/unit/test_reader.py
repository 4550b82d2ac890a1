"""spark_hvd.data: sharding plan, ParquetShardReader, prefetch, torch conversion."""

import itertools
import sys
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_hvd.data import RowsMissingError, ParquetShardReader, make_reader, steps_per_epoch
from spark_hvd.data import _batching, _shard
from spark_hvd.exceptions import InvalidArgumentError

# Row groups of the fixture dataset, per file ([] = a file without rows).
LAYOUT = {"a.parquet": [10, 10, 0, 3], "b.parquet": [0], "sub/c.parquet": [7, 7, 7, 7, 5],
          "z.parquet": [1]}
N = sum(sum(groups) for groups in LAYOUT.values())  # 57


def _table(ids):
    ids = np.asarray(ids, dtype=np.int64)
    vec = pa.array([[float(i), float(i) + 0.5, -float(i)] for i in ids], pa.list_(pa.float32()))
    fixed = pa.FixedSizeListArray.from_arrays(
        pa.array(np.repeat(ids, 2).astype(np.float64)), 2)
    return pa.table({"id": ids, "x": ids.astype(np.float32) / 2, "vec": vec, "fixed": fixed,
                     "flag": ids % 2 == 0})


@pytest.fixture
def dataset(tmp_path):
    start = 0
    for name, groups in LAYOUT.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        schema = _table([]).schema
        with pq.ParquetWriter(path, schema) as writer:
            for rows in groups:
                writer.write_table(_table(range(start, start + rows)))
                start += rows
    (tmp_path / "_SUCCESS").write_bytes(b"")
    (tmp_path / ".a.parquet.crc").write_bytes(b"junk")
    (tmp_path / "_temporary").mkdir()
    (tmp_path / "_temporary" / "x.parquet").write_bytes(b"junk")
    return tmp_path


def _read_all(path, size, batch_size, epoch=0, **kw):
    """Every rank's batches for one epoch."""
    out = []
    for rank in range(size):
        reader = ParquetShardReader(path, rank=rank, size=size, batch_size=batch_size, **kw)
        batches = list(reader.epoch(epoch))
        assert len(batches) == len(reader) == reader.steps_per_epoch
        out.append(batches)
    return out


# -- the plan -----------------------------------------------------------------------------

@pytest.mark.parametrize("size", [1, 2, 3])
def test_plan_exactly_once_equal_steps(size):
    groups = [_shard.RowGroup(0, i, n) for i, n in enumerate([5, 0, 3, 9, 1, 0, 4])]
    total = 22
    for batch_size, epoch, shuffle in itertools.product([1, 2, 3, 5, 8, 40], [0, 1], [0, 1]):
        seen, steps = [], set()
        for rank in range(size):
            plan = _shard.plan_epoch(groups, rank=rank, size=size, batch_size=batch_size,
                                     epoch=epoch, seed=7, shuffle=bool(shuffle), drop_last=False)
            steps.add(len(plan.batch_sizes))
            assert max(plan.batch_sizes) <= batch_size
            assert max(plan.batch_sizes) - min(plan.batch_sizes) <= 1
            assert sum(plan.batch_sizes) == sum(s.num_rows for s in plan.slices)
            if batch_size > 1:
                assert min(plan.batch_sizes) >= 1
            starts = np.cumsum([0] + [g.num_rows for g in groups])
            for s in plan.slices:
                seen.extend(range(starts[s.group.index] + s.start, starts[s.group.index] + s.stop))
        assert steps == {steps_per_epoch(total, size, batch_size)}
        assert sorted(seen) == list(range(total))


def test_plan_same_order_on_every_rank_and_changes_per_epoch():
    a = _shard.epoch_order(50, seed=3, epoch=0, shuffle=True)
    assert list(a) == list(_shard.epoch_order(50, seed=3, epoch=0, shuffle=True))
    assert list(a) != list(_shard.epoch_order(50, seed=3, epoch=1, shuffle=True))
    assert list(_shard.epoch_order(5, seed=3, epoch=1, shuffle=False)) == [0, 1, 2, 3, 4]


def test_batch_sizes():
    assert _shard.batch_sizes(10, 3) == [4, 3, 3]
    assert _shard.batch_sizes(2, 3) == [1, 1, 0]
    assert _shard.batch_sizes(0, 0) == []


# -- the reader ---------------------------------------------------------------------------

@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("batch_size", [1, 4, 7, 19, 100])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_row_once_and_equal_steps(dataset, size, batch_size, shuffle):
    for epoch in (0, 1):
        per_rank = _read_all(dataset, size, batch_size, epoch=epoch, shuffle=shuffle, seed=5,
                             shuffle_buffer_rows=8)
        assert len({len(b) for b in per_rank}) == 1
        ids = np.concatenate([b["id"] for batches in per_rank for b in batches])
        assert sorted(ids.tolist()) == list(range(N))
        for batches in per_rank:
            sizes = [len(b["id"]) for b in batches]
            assert max(sizes) <= batch_size and max(sizes) - min(sizes) <= 1
            for b in batches:  # the columns of a batch stay aligned
                assert np.array_equal(b["x"], b["id"].astype(np.float32) / 2)
                assert np.array_equal(b["vec"][:, 0], b["id"].astype(np.float32))


def test_no_shuffle_keeps_file_order(dataset):
    per_rank = _read_all(dataset, 3, 5, shuffle=False)
    ids = np.concatenate([b["id"] for batches in per_rank for b in batches])
    assert ids.tolist() == list(range(N))


def test_shuffle_changes_order_per_epoch_and_is_deterministic(dataset):
    def ids(seed, epoch):
        reader = ParquetShardReader(dataset, rank=0, size=1, batch_size=8, seed=seed)
        return np.concatenate([b["id"] for b in reader.epoch(epoch)]).tolist()
    e0, e1 = ids(1, 0), ids(1, 1)
    assert sorted(e0) == sorted(e1) == list(range(N))
    assert e0 != e1
    assert e0 == ids(1, 0)
    assert e0 != ids(2, 0)


def test_iterating_the_reader_advances_epochs(dataset):
    reader = ParquetShardReader(dataset, rank=0, size=1, batch_size=8, seed=1)
    first = [b["id"].tolist() for b in reader]
    second = [b["id"].tolist() for b in reader]
    assert first == [b["id"].tolist() for b in reader.epoch(0)]
    assert second == [b["id"].tolist() for b in reader.epoch(1)]


def test_two_dimensional_columns(dataset):
    reader = ParquetShardReader(dataset, rank=0, size=1, batch_size=64, shuffle=False)
    (batch,) = list(reader.epoch(0))
    ids = batch["id"]
    assert batch["vec"].shape == (N, 3) and batch["vec"].dtype == np.float32
    assert np.array_equal(batch["vec"][:, 2], -ids.astype(np.float32))
    assert batch["fixed"].shape == (N, 2) and batch["fixed"].dtype == np.float64
    assert np.array_equal(batch["fixed"][:, 1], ids.astype(np.float64))
    assert batch["flag"].dtype == np.bool_


def test_nested_lists_become_3d(tmp_path):
    rows = [[[float(i), 1.0], [2.0, 3.0], [4.0, 5.0]] for i in range(6)]
    pq.write_table(pa.table({"m": pa.array(rows, pa.list_(pa.list_(pa.float64())))}),
                   tmp_path / "m.parquet")
    (batch,) = list(ParquetShardReader(tmp_path, rank=0, size=1, batch_size=6,
                                       shuffle=False).epoch(0))
    assert batch["m"].shape == (6, 3, 2)
    assert batch["m"][4, 0, 0] == 4.0


def test_zero_copy_for_primitive_columns(dataset):
    reader = ParquetShardReader(dataset, rank=0, size=1, batch_size=5, shuffle=False,
                                prefetch=0, columns=["id", "vec"])
    batch = next(iter(reader.epoch(0)))  # rows 0..4 lie inside the first row group
    assert not batch["id"].flags.writeable and not batch["id"].flags.owndata
    assert not batch["vec"].flags.writeable and not batch["vec"].flags.owndata


def test_columns_selection_and_missing_column_hint(dataset):
    reader = ParquetShardReader(dataset, rank=0, size=1, batch_size=8, columns=["id"])
    assert list(next(iter(reader.epoch(0)))) == ["id"]
    with pytest.raises(InvalidArgumentError, match="'vek'.*did you mean 'vec'"):
        ParquetShardReader(dataset, rank=0, size=1, batch_size=8, columns=["id", "vek"])


def test_fewer_rows_than_ranks(tmp_path):
    pq.write_table(_table(range(2)), tmp_path / "t.parquet")
    with pytest.raises(InvalidArgumentError, match=r"2 rows but 3 ranks.*num_proc <= 2"):
        ParquetShardReader(tmp_path, rank=0, size=3, batch_size=4)


def test_bad_arguments(dataset, tmp_path):
    with pytest.raises(InvalidArgumentError, match="rank=2 must be < size=2"):
        ParquetShardReader(dataset, rank=2, size=2, batch_size=4)
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        ParquetShardReader(dataset, rank=0, size=1, batch_size=0)
    with pytest.raises(InvalidArgumentError, match="no such"):
        ParquetShardReader(tmp_path / "nope", rank=0, size=1, batch_size=4)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidArgumentError, match="no Parquet files"):
        ParquetShardReader(tmp_path / "empty", rank=0, size=1, batch_size=4)
    with pytest.raises(InvalidArgumentError, match="reader must be one of"):
        make_reader(dataset, rank=0, size=1, batch_size=4, reader="nope")


def test_batch_size_one_with_uneven_rows_ends_with_empty_batch(tmp_path):
    pq.write_table(_table(range(5)), tmp_path / "t.parquet")
    per_rank = _read_all(tmp_path, 2, 1, shuffle=False)
    assert [[len(b["id"]) for b in batches] for batches in per_rank] == [[1, 1, 0], [1, 1, 1]]
    assert per_rank[0][-1]["vec"].shape == (0, 3)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_drop_last(dataset, size):
    per_rank = _read_all(dataset, size, 4, drop_last=True, seed=2)
    steps = (N // size) // 4
    ids = [i for batches in per_rank for b in batches for i in b["id"].tolist()]
    assert all(len(b["id"]) == 4 for batches in per_rank for b in batches)
    assert all(len(batches) == steps for batches in per_rank)
    assert len(ids) == len(set(ids)) == size * steps * 4
    with pytest.raises(InvalidArgumentError, match="drop_last"):
        ParquetShardReader(dataset, rank=0, size=size, batch_size=N + 1, drop_last=True)


def test_ragged_and_null_values_are_refused(tmp_path):
    pq.write_table(pa.table({"v": pa.array([[1.0], [1.0, 2.0]])}), tmp_path / "r.parquet")
    with pytest.raises(InvalidArgumentError, match="'v' holds arrays of different lengths"):
        list(ParquetShardReader(tmp_path, rank=0, size=1, batch_size=2).epoch(0))
    (tmp_path / "r.parquet").unlink()
    pq.write_table(pa.table({"x": pa.array([1.0, None])}), tmp_path / "n.parquet")
    with pytest.raises(InvalidArgumentError, match="'x' has 1 null.*na.drop"):
        list(ParquetShardReader(tmp_path, rank=0, size=1, batch_size=2).epoch(0))


def test_fsspec_url(dataset):
    fsspec = pytest.importorskip("fsspec")
    mem = fsspec.filesystem("memory")
    root = "/spark_hvd_reader_test"
    for name in LAYOUT:
        mem.put(str(dataset / name), f"{root}/{name}")
    try:
        per_rank = _read_all(f"memory://{root}", 2, 5)
        ids = sorted(i for batches in per_rank for b in batches for i in b["id"].tolist())
        assert ids == list(range(N))
    finally:
        mem.rm(root, recursive=True)


# -- prefetch thread ----------------------------------------------------------------------

def test_prefetch_exception_reaches_the_consumer(dataset):
    baseline = threading.active_count()
    reader = ParquetShardReader(dataset, rank=0, size=1, batch_size=4, shuffle=False)
    real_read = reader._read

    def failing(slices):
        it = real_read(slices)
        yield next(it)
        raise RuntimeError("boom in the reader thread")

    reader._read = failing
    got = []
    with pytest.raises(RuntimeError, match="boom in the reader thread"):
        for batch in reader.epoch(0):
            got.append(batch)
    assert len(got) >= 1
    assert threading.active_count() == baseline


@pytest.mark.parametrize("prefetch", [1, 3])
def test_breaking_early_does_not_leak_the_thread(dataset, prefetch):
    baseline = threading.active_count()
    reader = ParquetShardReader(dataset, rank=0, size=1, batch_size=1, prefetch=prefetch)
    for _ in range(3):
        for i, _batch in enumerate(reader.epoch(0)):
            if i == 2:
                break
        assert threading.active_count() == baseline
    unstarted = reader.epoch(0)
    del unstarted
    assert threading.active_count() == baseline


def test_close_stops_a_running_epoch(dataset):
    baseline = threading.active_count()
    with ParquetShardReader(dataset, rank=0, size=1, batch_size=1, prefetch=1) as reader:
        it = reader.epoch(0)
        next(it)
        assert threading.active_count() == baseline + 1
    assert threading.active_count() == baseline
    assert len(list(it)) < N  # the loop ends instead of waiting forever


@pytest.mark.parametrize("prefetch,shuffle", [(0, False), (2, True)])
def test_a_batch_lost_in_the_pipeline_is_an_error_naming_the_files(dataset, prefetch,
                                                                     shuffle):
    """A reading pipeline made to drop one batch: the epoch ends in RowsMissingError
    naming the shard's files (checked against the footers), never with fewer rows."""
    for take in ("all", "planned"):  # a loop taking len(reader) batches sees it too
        reader = ParquetShardReader(dataset, rank=1, size=2, batch_size=4, shuffle=shuffle,
                                    prefetch=prefetch)
        real = reader._batches

        def dropping(epoch):
            for i, batch in enumerate(real(epoch)):
                if i != 1:
                    yield batch

        reader._batches = dropping
        expected = sum(s.num_rows for s in reader.plan(0).slices)
        with pytest.raises(RowsMissingError, match=rf"rank 1 delivered {expected - 4} of the "
                                                   rf"{expected} rows of epoch 0.*c\.parquet"):
            it = reader.epoch(0)
            for _ in (it if take == "all" else range(len(reader))):
                if take == "planned":
                    next(it)


def test_shuffled_batches_tiny_buffer_keeps_every_row():
    chunks = [{"a": np.arange(s, e)} for s, e in [(0, 3), (3, 3), (3, 10), (10, 11)]]
    sizes = _shard.batch_sizes(11, 4)
    out = list(_batching.shuffled_batches(iter(chunks), sizes, 2, np.random.default_rng(0)))
    assert [len(b["a"]) for b in out] == sizes
    assert sorted(np.concatenate([b["a"] for b in out]).tolist()) == list(range(11))


# -- petastorm and torch ------------------------------------------------------------------

def test_petastorm_reader_import_error_is_clear(dataset, monkeypatch):
    monkeypatch.setitem(sys.modules, "petastorm", None)  # makes `import petastorm` fail
    with pytest.raises(ImportError, match=r"petastorm 0\.13\.1.*pyarrow<=14.*reader='arrow'"):
        make_reader(dataset, rank=0, size=1, batch_size=4, reader="petastorm")


def test_to_torch_is_zero_copy(dataset):
    torch = pytest.importorskip("torch")
    from spark_hvd.data.torch import to_torch
    reader = ParquetShardReader(dataset, rank=0, size=1, batch_size=5, shuffle=False, prefetch=0)
    batch = next(iter(reader.epoch(0)))
    tensors = to_torch(batch)
    for name in ("id", "x", "vec", "fixed"):
        assert tensors[name].data_ptr() == batch[name].ctypes.data
        assert np.shares_memory(tensors[name].numpy(), batch[name])
    assert tensors["vec"].shape == (5, 3) and tensors["vec"].dtype == torch.float32
    with pytest.raises(InvalidArgumentError, match="'s' has numpy dtype"):
        to_torch({"s": np.array(["a"], dtype=object)})


def test_torch_batches(dataset):
    torch = pytest.importorskip("torch")
    from spark_hvd.data.torch import TorchBatches
    reader = ParquetShardReader(dataset, rank=1, size=2, batch_size=6, seed=3)
    batches = TorchBatches(reader, ["vec", "x"], ["id"], "x", dtype=torch.float64)
    items = list(batches)
    assert len(items) == len(batches) == len(reader)
    (vec, x), label, weight = items[0]
    assert vec.dtype == torch.float64 and vec.shape[1] == 3
    assert label.dtype == torch.int64 and torch.equal(weight, x)
    assert torch.equal(vec[:, 0].to(torch.int64), label)
    (vec2,), (label2,) = next(iter(TorchBatches(reader, "vec", "id", as_lists=True).epoch(0)))
    assert vec2.dtype == torch.float32 and label2.shape == vec2.shape[:1]
