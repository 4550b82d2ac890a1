"""reader="petastorm" under petastorm 0.13.1 and pyarrow 14: every row once per epoch and
equal steps on every rank (as spark_hvd's own reader), its worker pool at 1, 2 and 4
threads, and no silent row loss (a pool made to drop a batch is an error naming the files;
one that ends an epoch early, as petastorm's can, is asked again)."""

import contextlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_hvd.data import ParquetShardReader, RowsMissingError, make_reader
from spark_hvd.data.petastorm_reader import PetastormBatchReader
from spark_hvd.exceptions import InvalidArgumentError

# Row groups per file (0: an empty row group).
LAYOUT = {"a.parquet": [40, 0, 25], "b.parquet": [30, 30], "sub/c.parquet": [35, 10, 20]}
N = sum(sum(g) for g in LAYOUT.values())


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("petastorm_data")
    start = 0
    for name, groups in LAYOUT.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        schema = pa.schema([("id", pa.int64()), ("x", pa.list_(pa.float32()))])
        with pq.ParquetWriter(path, schema) as writer:
            for rows in groups:
                ids = np.arange(start, start + rows, dtype=np.int64)
                writer.write_table(pa.table({"id": ids, "x": [[float(i), -float(i)] for i in ids]},
                                            schema=schema))
                start += rows
    (root / "_SUCCESS").write_bytes(b"")
    return root


def _epoch_ids(readers, epoch):
    batches = [list(r.epoch(epoch)) for r in readers]
    steps = {len(b) for b in batches}
    assert steps == {len(readers[0])}, f"steps per rank differ: {[len(b) for b in batches]}"
    for b in batches:
        for batch in b:
            assert batch["x"].shape == (len(batch["id"]), 2)
            assert np.array_equal(batch["x"][:, 0], batch["id"].astype(np.float32))
    return [np.concatenate([batch["id"] for batch in b]) for b in batches]


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_every_row_once_equal_steps_every_epoch(dataset, workers):
    for size, batch_size, shuffle in [(1, 16, True), (2, 16, False), (3, 7, True)]:
        readers = [make_reader(dataset, reader="petastorm", rank=r, size=size,
                               batch_size=batch_size, shuffle=shuffle, seed=3,
                               workers_count=workers) for r in range(size)]
        arrow = [ParquetShardReader(dataset, rank=r, size=size, batch_size=batch_size,
                                    shuffle=shuffle, seed=3) for r in range(size)]
        for epoch in range(4):  # several epochs: petastorm's early ends are intermittent
            per_rank = _epoch_ids(readers, epoch)
            every = np.sort(np.concatenate(per_rank))
            assert np.array_equal(every, np.arange(N)), (size, epoch)
            assert np.array_equal(every, np.sort(np.concatenate(_epoch_ids(arrow, epoch))))
        assert [len(ids) for ids in per_rank] == readers[0].shares


def test_same_epoch_same_rows_and_batch_sizes_and_drop_last(dataset):
    """An epoch read twice gives the same rows in the same batch sizes (not always in the
    same order: petastorm's pool hands row groups over as its threads finish them)."""
    reader = PetastormBatchReader(dataset, rank=1, size=2, batch_size=8, shuffle=True, seed=5)
    a, b = list(reader.epoch(2)), list(reader.epoch(2))
    assert [len(x["id"]) for x in a] == [len(y["id"]) for y in b] == reader.batch_sizes()
    assert sorted(np.concatenate([x["id"] for x in a]).tolist()) == \
        sorted(np.concatenate([y["id"] for y in b]).tolist())
    full = [PetastormBatchReader(dataset, rank=r, size=2, batch_size=8, drop_last=True)
            for r in range(2)]
    for r in full:
        assert len(r) == min(r.shares) // 8
        assert all(len(batch["id"]) == 8 for batch in r.epoch(0))


class _Pool:
    """Stands for make_batch_reader: the real reader's items, with ``drop`` left out, or the
    iteration ended once early (``stop_once_at``), as petastorm's thread pool can."""

    def __init__(self, real, drop=None, stop_once_at=None):
        self.real, self.drop, self.stop_once_at = real, drop, stop_once_at

    def __call__(self, urls, **kwargs):
        return self._reader(urls, kwargs)

    @contextlib.contextmanager
    def _reader(self, urls, kwargs):
        with self.real(urls, **kwargs) as reader:
            yield self._items(iter(reader))

    def _items(self, items):
        stopped = [False]
        outer = self

        class It:
            def __iter__(self):
                return self

            def __next__(self):
                if outer.stop_once_at is not None and not stopped[0]:
                    if It.count == outer.stop_once_at:
                        stopped[0] = True
                        raise StopIteration
                item = next(items)
                It.count += 1
                if It.count - 1 == outer.drop:
                    return next(items)
                return item
        It.count = 0
        return It()


def test_a_pool_that_drops_a_batch_is_an_error_naming_the_files(dataset):
    reader = PetastormBatchReader(dataset, rank=0, size=2, batch_size=8, shuffle=False,
                                  workers_count=2)
    reader._make_batch_reader = _Pool(reader._make_batch_reader, drop=1)
    with pytest.raises(RowsMissingError, match=r"rank 0 delivered \d+ of the "
                                               rf"{reader.num_rows} rows of epoch 0") as info:
        for _ in reader.epoch(0):
            pass
    for f in reader.shard_files:
        assert f"'{f}'" in str(info.value)


def test_a_pool_that_ends_early_once_is_asked_again(dataset):
    reader = PetastormBatchReader(dataset, rank=1, size=2, batch_size=8, shuffle=False,
                                  workers_count=4)
    reader._make_batch_reader = _Pool(reader._make_batch_reader, stop_once_at=1)
    ids = np.concatenate([b["id"] for b in reader.epoch(0)])
    assert len(ids) == reader.num_rows == len(set(ids.tolist()))


def test_wrong_combinations_are_clear_errors(dataset, tmp_path):
    with pytest.raises(InvalidArgumentError, match="1 row group.*for 2 ranks"):
        path = tmp_path / "one.parquet"
        pq.write_table(pa.table({"id": np.arange(5)}), path)
        PetastormBatchReader(path, rank=0, size=2, batch_size=2)
    with pytest.raises(InvalidArgumentError, match="workers_count"):
        PetastormBatchReader(dataset, rank=0, size=1, batch_size=2, workers_count=0)
    with pytest.raises(InvalidArgumentError, match="empty batches"):
        PetastormBatchReader(dataset, rank=0, size=3, batch_size=1)  # shares 95/55/40
    import fsspec
    mem = fsspec.filesystem("memory")
    with mem.open("/d/a.parquet", "wb") as f:
        pq.write_table(pa.table({"id": np.arange(4)}), f)
    with pytest.raises(InvalidArgumentError, match="reads local files"):
        PetastormBatchReader("/d", rank=0, size=1, batch_size=2, filesystem=mem)
