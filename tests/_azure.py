"""An Azure Blob API on 127.0.0.1 for the object-store tests: Azurite's blob service.

``make test`` installs Azurite from npm into ``.venv/azurite`` (the Makefile's
``STAMP_AZURITE`` rule).  ``azure_endpoint`` (module scope) starts ``azurite-blob`` from there
on an ephemeral port, with its data in a temporary directory and its telemetry off, and
points the environment adlfs reads at it: ``AZURE_STORAGE_CONNECTION_STRING`` with Azurite's
well-known development account, and none of adlfs's other credential variables, so nothing
can reach a real account.  With a connection string adlfs sends ``az://`` and
``abfss://container@account.dfs.core.windows.net`` URLs alike to its endpoint.  ``az_url``
is a fresh container's ``az://`` URL per test.
"""

import os
import re
import subprocess
import time

import pytest

from _emulators import environment, new_bucket

AZURITE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       ".venv", "azurite", "node_modules", ".bin", "azurite-blob")
ACCOUNT = "devstoreaccount1"
# Azurite's built-in development account key: public, accepted by Azurite alone.
ACCOUNT_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
               "KBHBeksoGMGw==")
UNSET = ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN",
         "AZURE_STORAGE_CLIENT_ID", "AZURE_STORAGE_CLIENT_SECRET", "AZURE_STORAGE_TENANT_ID",
         "AZURE_STORAGE_ANON")
LISTENING = re.compile(r"successfully listens on (http://\S+)")


def connection_string(endpoint):
    return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
            f"BlobEndpoint={endpoint}/{ACCOUNT};")


def _listening_url(proc, log, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if match := LISTENING.search(log.read_text()):
            return match.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"azurite-blob did not start (exit status {proc.poll()}):\n"
                       f"{log.read_text()}")


@pytest.fixture(scope="module")
def azure_endpoint(tmp_path_factory):
    """The blob endpoint of an Azurite server, with the driver's environment pointing at
    it."""
    pytest.importorskip("adlfs")
    if not os.access(AZURITE, os.X_OK):
        pytest.fail(f"Azurite is not installed: {AZURITE} is missing. `make test` installs it "
                    f"(the Makefile's STAMP_AZURITE rule: npm install --prefix .venv/azurite "
                    f"azurite@AZURITE_VERSION).", pytrace=False)
    workdir = tmp_path_factory.mktemp("azurite")
    log = workdir / "azurite.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [AZURITE, "--blobHost", "127.0.0.1", "--blobPort", "0", "--location", str(workdir),
             "--silent", "--skipApiVersionCheck", "--disableTelemetry"],
            cwd=workdir, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        endpoint = _listening_url(proc, log)
        with environment({"AZURE_STORAGE_CONNECTION_STRING": connection_string(endpoint)},
                         UNSET):
            yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def az_url(azure_endpoint):
    """``az://<a new container>/store``."""
    import adlfs
    return f"az://{new_bucket(adlfs.AzureBlobFileSystem)}/store"
