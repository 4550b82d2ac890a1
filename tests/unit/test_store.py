"""estimators.store: one contract, run against LocalStore, an fsspec memory store and the
object stores on emulators on 127.0.0.1: S3 (moto's server, tests/_s3.py), GCS
(gcp-storage-emulator, tests/_gcs.py) and Azure Blob (Azurite, tests/_azure.py)."""

import importlib
import pickle
import posixpath
import sys
import uuid

import pyarrow.fs as pafs
import pytest

from _azure import ACCOUNT, ACCOUNT_KEY, az_url, azure_endpoint  # noqa: F401 (fixtures)
from _azure import connection_string as azure_connection_string
from _emulators import bucket_name
from _gcs import gcs_endpoint, gs_url  # noqa: F401 (fixtures)
from _s3 import s3_endpoint, s3_url  # noqa: F401 (fixtures)
from estimators.store import DBFSLocalStore, FilesystemStore, LocalStore, Store
from spark_hvd.exceptions import InvalidArgumentError

STALE = "." + "{}." + "0" * 32 + ".tmp"  # a temporary of write_bytes_atomic, by name
DEAD = "http://127.0.0.1:1"  # no server: an endpoint that leads nowhere


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


class ObjectStoreContract(StoreContract):
    """StoreContract on an object store's emulator, and what object stores add: the scheme's
    fsspec driver, no bucket created, a missing bucket's error, storage options that reach the
    driver and travel pickled.  Subclasses name the scheme, its driver and their emulator's
    fixtures (tests/_s3.py, _gcs.py, _azure.py)."""

    scheme = driver = None  # "s3", "s3fs.S3FileSystem"
    endpoint_fixture = url_fixture = None  # "s3_endpoint", "s3_url"
    secret = None  # the environment's credential, never in an error message (None: anonymous)
    elsewhere = {}  # environment variables that send the driver to no server (DEAD)

    @staticmethod
    def options(endpoint):
        """Storage options that send the driver to ``endpoint``."""
        return {"endpoint_url": endpoint}

    @pytest.fixture
    def endpoint(self, request):
        """The emulator's URL, with the environment pointing at it."""
        return request.getfixturevalue(self.endpoint_fixture)

    @pytest.fixture
    def url(self, request):
        """The URL of a new bucket's ``store`` directory."""
        return request.getfixturevalue(self.url_fixture)

    @pytest.fixture
    def store(self, url):
        return Store.create(url)

    def test_is_an_fsspec_object_store_of_the_scheme(self, store):
        module, _, name = self.driver.rpartition(".")
        assert type(store) is FilesystemStore and store.object_store
        assert isinstance(store.filesystem.handler.fs,
                          getattr(importlib.import_module(module), name))
        assert store.storage_options == {} and store.url.startswith(f"{self.scheme}://")

    def test_makedirs_creates_no_bucket(self, endpoint):
        name = bucket_name("absent")
        store = Store.create(f"{self.scheme}://{name}/root")
        store.makedirs(store.join("x", "y"))
        assert not store.filesystem.handler.fs.exists(name)

    def test_missing_bucket_is_not_writable(self, endpoint):
        url = f"{self.scheme}://{bucket_name('absent')}/root"
        with pytest.raises(InvalidArgumentError) as err:
            Store.create(url).check_writable()
        msg = str(err.value)
        assert msg.startswith(f"the store {url} is not writable: writing ")
        assert "Fix: check that the bucket or container exists" in msg
        assert self.secret is None or self.secret not in msg

    def test_storage_options_reach_the_driver_and_travel_pickled(self, endpoint, url,
                                                                   monkeypatch):
        for name, value in self.elsewhere.items():
            monkeypatch.setenv(name, value)  # only the options lead to the emulator now
        store = Store.create(url, **self.options(endpoint))
        store.write_bytes_atomic(store.join("f"), b"x")
        clone = pickle.loads(pickle.dumps(store))
        assert clone.storage_options == self.options(endpoint)
        assert clone.read_bytes(store.join("f")) == b"x"


class TestS3Store(ObjectStoreContract):
    """s3:// through s3fs against moto's S3 server; credentials and the endpoint only from the
    environment (tests/_s3.py)."""

    scheme, driver, secret = "s3", "s3fs.S3FileSystem", "testing"
    endpoint_fixture, url_fixture = "s3_endpoint", "s3_url"
    elsewhere = {"AWS_ENDPOINT_URL": DEAD}

    def test_s3a_is_the_same_store(self, s3_url):
        store = Store.create(s3_url.replace("s3://", "s3a://"))
        store.write_bytes_atomic(store.join("a"), b"1")
        assert Store.create(s3_url).read_bytes(store.join("a")) == b"1"
        assert store.to_spark_path(store.join("a")).startswith("s3a://")


class TestGcsStore(ObjectStoreContract):
    """gs:// through gcsfs against gcp-storage-emulator, anonymous, the endpoint only from the
    environment (tests/_gcs.py)."""

    scheme, driver = "gs", "gcsfs.GCSFileSystem"
    endpoint_fixture, url_fixture = "gcs_endpoint", "gs_url"
    elsewhere = {"STORAGE_EMULATOR_HOST": DEAD}


class TestAzureStore(ObjectStoreContract):
    """az:// and abfss:// through adlfs against Azurite, with Azurite's development account
    from the environment's connection string (tests/_azure.py)."""

    scheme, driver, secret = "az", "adlfs.AzureBlobFileSystem", ACCOUNT_KEY
    endpoint_fixture, url_fixture = "azure_endpoint", "az_url"
    elsewhere = {"AZURE_STORAGE_CONNECTION_STRING": azure_connection_string(DEAD)}

    @staticmethod
    def options(endpoint):
        return {"connection_string": azure_connection_string(endpoint)}

    def test_abfss_url_is_the_same_store(self, az_url):
        container = az_url.split("/")[2]
        abfss_url = f"abfss://{container}@{ACCOUNT}.dfs.core.windows.net/store"
        store = Store.create(abfss_url)
        assert store.prefix == f"{container}/store"
        store.write_bytes_atomic(store.join("a"), b"1")
        assert Store.create(az_url).read_bytes(store.join("a")) == b"1"
        assert store.to_spark_path(store.join("a")) == abfss_url + "/a"


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
    ("s3://bucket/store", "s3fs"),
    ("gs://bucket/store", "gcsfs"),
    ("abfss://container@account.dfs.core.windows.net/store", "adlfs"),
    ("az://container/store", "adlfs"),
])
def test_object_store_without_its_driver_names_the_package(url, package, monkeypatch):
    """The drivers are installed here: the test hides the package (``import`` fails) and
    fsspec's record of the class it already loaded for the scheme."""
    from fsspec.registry import _registry
    monkeypatch.setitem(sys.modules, package, None)
    monkeypatch.delitem(_registry, url.split(":")[0], raising=False)
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
