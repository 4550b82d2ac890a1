"""estimators.store: one contract, run against LocalStore, an fsspec memory store and S3
(moto's server on 127.0.0.1, tests/_s3.py)."""

import pickle
import posixpath
import uuid

import pyarrow.fs as pafs
import pytest

from _s3 import make_bucket, s3_endpoint, s3_url  # noqa: F401 (fixtures)
from estimators.store import DBFSLocalStore, FilesystemStore, LocalStore, Store
from spark_hvd.exceptions import InvalidArgumentError

STALE = "." + "{}." + "0" * 32 + ".tmp"  # a temporary of write_bytes_atomic, by name


class _ShortWrites:
    """A filesystem that reports one byte fewer for every file it stats: a write that lost
    its tail."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def get_file_info(self, path):
        info = self.real.get_file_info(path)
        if isinstance(path, str) and info.type == pafs.FileType.File:
            return pafs.FileInfo(info.path, pafs.FileType.File, size=info.size - 1)
        return info


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

    def test_interrupted_write_is_cleaned_up_by_the_next_write(self, store):
        """A writer killed mid-write leaves its temporary; the next write of that name removes
        it, and remove_temporaries (a resume) removes every one."""
        ckpt = store.join("runs", "r", "checkpoint")
        store.write_bytes_atomic(posixpath.join(ckpt, "last.pt"), b"epoch 1")
        for name in ("last.pt", "best.pt"):
            store.write_bytes_atomic(posixpath.join(ckpt, STALE.format(name)), b"half")
        assert len(store.listdir(ckpt)) == 3
        store.write_bytes_atomic(posixpath.join(ckpt, "last.pt"), b"epoch 2")
        assert store.listdir(ckpt) == [STALE.format("best.pt"), "last.pt"]
        assert store.read_bytes(posixpath.join(ckpt, "last.pt")) == b"epoch 2"
        assert store.remove_temporaries(ckpt) == [posixpath.join(ckpt, STALE.format("best.pt"))]
        assert store.listdir(ckpt) == ["last.pt"]
        assert store.remove_temporaries(store.join("runs", "absent")) == []

    def test_a_short_write_leaves_the_old_file(self, store, monkeypatch):
        path = store.join("runs", "r", "checkpoint", "last.pt")
        store.write_bytes_atomic(path, b"good")
        monkeypatch.setattr(store, "_filesystem", _ShortWrites(store.filesystem))
        with pytest.raises(OSError, match="holds 4 bytes of 5"):
            store.write_bytes_atomic(path, b"newer")
        monkeypatch.undo()
        assert store.read_bytes(path) == b"good"
        assert store.listdir(posixpath.dirname(path)) == ["last.pt"]

    def test_check_writable_leaves_nothing(self, store):
        existed = store.exists(store.prefix)
        store.check_writable()
        assert store.exists(store.prefix) == existed
        if existed:
            assert store.listdir(store.prefix) == []


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


class TestS3Store(StoreContract):
    """s3:// through s3fs against moto's S3 server; credentials and the endpoint only from the
    environment (tests/_s3.py)."""

    @pytest.fixture
    def store(self, s3_url):
        return Store.create(s3_url)

    def test_is_an_s3fs_object_store(self, store):
        import s3fs
        assert type(store) is FilesystemStore and store.object_store
        assert isinstance(store.filesystem.handler.fs, s3fs.S3FileSystem)
        assert store.storage_options == {} and store.url.startswith("s3://")

    def test_s3a_is_the_same_store(self, s3_url):
        store = Store.create(s3_url.replace("s3://", "s3a://"))
        store.write_bytes_atomic(store.join("a"), b"1")
        assert Store.create(s3_url).read_bytes(store.join("a")) == b"1"
        assert store.to_spark_path(store.join("a")).startswith("s3a://")

    def test_makedirs_creates_no_bucket(self, s3_endpoint):
        import s3fs
        name = f"absent-{uuid.uuid4().hex[:12]}"
        store = Store.create(f"s3://{name}/root")
        store.makedirs(store.join("x", "y"))
        assert not s3fs.S3FileSystem(skip_instance_cache=True).exists(name)

    def test_missing_bucket_is_not_writable(self, s3_endpoint):
        url = f"s3://absent-{uuid.uuid4().hex[:12]}/root"
        with pytest.raises(InvalidArgumentError) as err:
            Store.create(url).check_writable()
        msg = str(err.value)
        assert msg.startswith(f"the store {url} is not writable: writing ")
        assert "bucket" in msg and "Fix: check that the bucket or container exists" in msg
        assert "testing" not in msg  # no credential in the message

    def test_storage_options_reach_s3fs_and_travel_pickled(self, s3_endpoint):
        bucket = make_bucket()
        store = Store.create(f"s3://{bucket}/opts", endpoint_url=s3_endpoint)
        store.write_bytes_atomic(store.join("f"), b"x")
        clone = pickle.loads(pickle.dumps(store))
        assert clone.storage_options == {"endpoint_url": s3_endpoint}
        assert clone.read_bytes(store.join("f")) == b"x"


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

    def test_is_fsspec_backed_object_store(self, store):
        assert type(store) is FilesystemStore
        assert isinstance(store.filesystem, pafs.PyFileSystem)
        assert store.object_store

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


def test_local_store_not_writable(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    store = Store.create(str(tmp_path / "file" / "store"))
    with pytest.raises(InvalidArgumentError) as err:
        store.check_writable()
    msg = str(err.value)
    assert msg.startswith(f"the store file://{tmp_path}/file/store is not writable: writing ")
    assert "Fix: create the directory, or give a path this user can write" in msg


@pytest.mark.parametrize("url, package", [
    ("gs://bucket/store", "gcsfs"),
    ("abfss://container@account.dfs.core.windows.net/store", "adlfs"),
    ("az://container/store", "adlfs"),
])
def test_object_store_without_its_driver_names_the_package(url, package):
    try:
        __import__(package)
    except ImportError:
        pass
    else:
        pytest.skip(f"{package} is installed")
    with pytest.raises(InvalidArgumentError, match=f"Fix: pip install {package} on the driver "
                                                   f"and on every executor"):
        Store.create(url)


def test_hdfs_without_libhdfs_or_a_jvm_says_what_to_set(tmp_path, monkeypatch):
    monkeypatch.setenv("JAVA_HOME", str(tmp_path))  # no JVM there
    monkeypatch.setenv("ARROW_LIBHDFS_DIR", str(tmp_path))  # nor libhdfs
    with pytest.raises(InvalidArgumentError) as err:
        Store.create("hdfs://namenode:8020/store")
    msg = str(err.value)
    assert msg.startswith("cannot open the store 'hdfs://namenode:8020/store' with pyarrow's "
                          "HadoopFileSystem: ")
    assert "JAVA_HOME" in msg and "ARROW_LIBHDFS_DIR" in msg and "hadoop classpath" in msg


def test_bad_urls():
    with pytest.raises(InvalidArgumentError):
        Store.create("")
    with pytest.raises(InvalidArgumentError, match="file:///abs/path"):
        Store.create("file://somehost/x")
    with pytest.raises(InvalidArgumentError, match="cannot open store URL"):
        Store.create("nosuchscheme-xyz://bucket/x")


def test_hdfs_store_takes_horovods_arguments():
    """Horovod's HDFSStore(prefix_path, host, port, user, kerb_ticket): the URL it opens,
    and without a JVM/libhdfs here, the error that says what to set."""
    from spark_hvd.estimators import HDFSStore
    from spark_hvd.estimators.store import hdfs_url

    assert hdfs_url("/user/me/runs", "nn", 8020, user="me") == \
        "hdfs://nn:8020/user/me/runs?user=me"
    assert hdfs_url("hdfs://nn/runs", kerb_ticket="/tmp/k") == "hdfs://nn/runs?kerb_ticket=/tmp/k"
    assert hdfs_url("runs") == "hdfs://default/runs"
    with pytest.raises(InvalidArgumentError, match="hdfs://"):
        hdfs_url("s3://bucket/runs")
    with pytest.raises(InvalidArgumentError, match="libhdfs"):
        HDFSStore("/runs", driver="libhdfs3")
    with pytest.raises(InvalidArgumentError, match="JAVA_HOME"):
        HDFSStore("/user/me/runs", host="127.0.0.1", port=1)
