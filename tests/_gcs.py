"""A GCS JSON API on 127.0.0.1 for the object-store tests: gcp-storage-emulator.

``gcs_endpoint`` (module scope) starts the emulator, in memory, on an ephemeral port and
points the environment gcsfs reads at it: ``STORAGE_EMULATOR_HOST``, and Google credentials
that resolve to none (``GOOGLE_APPLICATION_CREDENTIALS`` names an absent file, which ends
google-auth's search before the gcloud config or a metadata server; ``NO_GCE_CHECK``), so
gcsfs falls back to anonymous requests and nothing can reach a real project.  The emulator
has no ``objects.moveTo``, which gcsfs renames with (it retries the 501 for half a minute,
then copies); the fixture adds it as a copy and a delete.  ``gs_url`` is a fresh bucket's
``gs://`` URL per test.
"""

from http import HTTPStatus

import pytest

from _emulators import environment, new_bucket

DUMMY_ENV = {
    "GOOGLE_APPLICATION_CREDENTIALS": "/nonexistent/spark_hvd-tests-gcp-credentials.json",
    "CLOUDSDK_CONFIG": "/nonexistent/spark_hvd-tests-gcloud",
    "NO_GCE_CHECK": "true",
}
UNSET = ("GOOGLE_CLOUD_PROJECT", "GCLOUD_PROJECT", "GCSFS_DEFAULT_PROJECT")
MOVE_TO = (r"^/storage/v1/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)"
           r"/moveTo/o/(?P<dest_object_id>.*[^/]+)$")


def _move_to(request, response, storage):
    """objects.moveTo within a bucket: the emulator's copy, then the source's delete."""
    from gcp_storage_emulator.handlers import objects
    request.params["dest_bucket_name"] = request.params["bucket_name"]
    objects.copy(request, response, storage)
    if response.status == HTTPStatus.OK:
        storage.delete_file(request.params["bucket_name"], request.params["object_id"])


@pytest.fixture(scope="module")
def gcs_endpoint():
    """The URL of a gcp-storage-emulator server, with the driver's environment pointing at
    it."""
    pytest.importorskip("gcsfs")
    server_mod = pytest.importorskip("gcp_storage_emulator.server")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server_mod, "HANDLERS", ((MOVE_TO, {"POST": _move_to}),) + server_mod.HANDLERS)
        server = server_mod.create_server("127.0.0.1", 0, in_memory=True)
        server.start()
        endpoint = f"http://127.0.0.1:{server._api._httpd.server_port}"  # the port it bound
        try:
            with environment(dict(DUMMY_ENV, STORAGE_EMULATOR_HOST=endpoint), UNSET):
                yield endpoint
        finally:
            server.stop()


def make_bucket(prefix="shvd"):
    """A new bucket on the emulator; its name."""
    import gcsfs
    return new_bucket(gcsfs.GCSFileSystem, prefix)


@pytest.fixture
def gs_url(gcs_endpoint):
    """``gs://<a new bucket>/store``."""
    return f"gs://{make_bucket()}/store"
