"""estimators.store: one contract, run against LocalStore and an fsspec-backed FilesystemStore."""

import pickle
import uuid

import pyarrow.fs as pafs
import pytest

from estimators.store import DBFSLocalStore, FilesystemStore, LocalStore, Store
from spark_hvd.exceptions import InvalidArgumentError


class StoreContract:
    """Every Store implementation passes these; subclasses provide the ``store`` fixture."""

    def test_layout(self, store):
        root = store.prefix
        assert store.get_data_path("k1") == f"{root}/intermediate_train_data/k1"
        assert store.get_run_path("r1") == f"{root}/runs/r1"
        assert store.get_checkpoint_path("r1").startswith(store.get_run_path("r1") + "/")
        assert store.get_logs_path("r1").startswith(store.get_run_path("r1") + "/")
        assert store.get_checkpoint_path("r1") != store.get_logs_path("r1")
        assert isinstance(store.filesystem, pafs.FileSystem)

    def test_write_read_exists(self, store):
        path = store.join("runs", "r1", "checkpoint", "model.pt")
        assert not store.exists(path)
        store.write_bytes_atomic(path, b"first")
        assert store.exists(path) and store.read_bytes(path) == b"first"
        store.write_bytes_atomic(path, b"second, longer")
        assert store.read_bytes(path) == b"second, longer"
        assert store.listdir(store.join("runs", "r1", "checkpoint")) == ["model.pt"]

    def test_makedirs_listdir_delete(self, store):
        base = store.get_data_path("key")
        store.makedirs(store.join("intermediate_train_data", "key", "sub"))
        store.write_bytes_atomic(store.join("intermediate_train_data", "key", "b"), b"x")
        store.write_bytes_atomic(store.join("intermediate_train_data", "key", "sub", "a"), b"y")
        assert store.listdir(base) == ["b", "sub"]
        store.delete(store.join("intermediate_train_data", "key", "b"))
        assert store.listdir(base) == ["sub"]
        store.delete(base)
        assert not store.exists(base)
        store.delete(base)  # absent is fine

    def test_delete_refuses_the_root_and_outside_paths(self, store):
        with pytest.raises(InvalidArgumentError, match="root"):
            store.delete(store.prefix)
        with pytest.raises(InvalidArgumentError, match="not under"):
            store.delete(store.prefix + "-sibling/x")

    def test_to_spark_path(self, store):
        path = store.get_data_path("k")
        assert store.to_spark_path(path) == store.url + "/intermediate_train_data/k"
        assert store.to_spark_path(store.prefix) == store.url

    def test_pickle_round_trip(self, store):
        path = store.join("a.bin")
        store.write_bytes_atomic(path, b"payload")
        clone = pickle.loads(pickle.dumps(store))
        assert type(clone) is type(store) and clone.prefix == store.prefix
        assert clone.url == store.url
        assert clone.read_bytes(path) == b"payload"

    def test_no_temporary_files_left(self, store):
        path = store.join("logs", "x.json")
        store.write_bytes_atomic(path, b"{}")
        assert store.listdir(store.join("logs")) == ["x.json"]


class TestLocalStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path):
        return Store.create(str(tmp_path / "store"))

    def test_create_kinds(self, tmp_path):
        assert type(Store.create(str(tmp_path))) is LocalStore
        file_url = Store.create("file://" + str(tmp_path))
        assert type(file_url) is LocalStore and file_url.prefix == str(tmp_path)
        assert file_url.to_spark_path(str(tmp_path / "x")) == f"file://{tmp_path}/x"

    def test_relative_path_becomes_absolute(self, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        assert Store.create("runs").prefix == str(tmp_path / "runs")

    def test_atomic_write_goes_through_a_temporary(self, store, monkeypatch):
        moves = []
        real = store.filesystem

        class Recording:
            def __getattr__(self, name):
                return getattr(real, name)

            def move(self, src, dst):
                moves.append((src, dst))
                real.move(src, dst)

        monkeypatch.setattr(store, "_filesystem", Recording())
        path = store.join("f")
        store.write_bytes_atomic(path, b"1")
        assert len(moves) == 1 and moves[0][1] == path and moves[0][0] != path


class TestMemoryFilesystemStore(StoreContract):
    """A FilesystemStore through fsspec (pyarrow has no memory:// scheme)."""

    @pytest.fixture
    def store(self):
        pytest.importorskip("fsspec")
        url = f"memory://spark_hvd_store_test/{uuid.uuid4().hex}"
        store = Store.create(url)
        yield store
        import fsspec
        fs = fsspec.filesystem("memory")
        if fs.exists(store.prefix):
            fs.rm(store.prefix, recursive=True)

    def test_is_fsspec_backed_without_rename(self, store):
        assert type(store) is FilesystemStore
        assert isinstance(store.filesystem, pafs.PyFileSystem)
        assert not store.atomic_rename

    def test_storage_options_go_to_fsspec(self):
        pytest.importorskip("fsspec")
        store = Store.create("memory://spark_hvd_store_test/opts", skip_instance_cache=True)
        assert store.storage_options == {"skip_instance_cache": True}
        assert pickle.loads(pickle.dumps(store)).storage_options == store.storage_options


def test_dbfs_paths():
    for url in ("dbfs:/ml/store", "dbfs:///ml/store", "/dbfs/ml/store"):
        store = Store.create(url)
        assert type(store) is DBFSLocalStore
        assert store.prefix == "/dbfs/ml/store"
        assert store.to_spark_path("/dbfs/ml/store/runs/r") == "dbfs:/ml/store/runs/r"
        assert pickle.loads(pickle.dumps(store)) == store


def test_bad_urls():
    with pytest.raises(InvalidArgumentError):
        Store.create("")
    with pytest.raises(InvalidArgumentError, match="file:///abs/path"):
        Store.create("file://somehost/x")
    with pytest.raises(InvalidArgumentError, match="cannot open store URL"):
        Store.create("nosuchscheme-xyz://bucket/x")
