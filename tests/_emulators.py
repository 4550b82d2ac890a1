"""What the object-store emulators of tests/_s3.py, _gcs.py and _azure.py share: the driver's
environment pointed at one for a block, and new buckets."""

import contextlib
import uuid

import pytest


@contextlib.contextmanager
def environment(values, unset=()):
    """``os.environ`` with ``values`` set and the names in ``unset`` removed, inside the
    block."""
    with pytest.MonkeyPatch.context() as mp:
        for name in unset:
            mp.delenv(name, raising=False)
        for name, value in values.items():
            mp.setenv(name, value)
        yield


def bucket_name(prefix="shvd"):
    """A new bucket or container name (valid on S3, GCS and Azure)."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def new_bucket(filesystem, prefix="shvd"):
    """A new bucket or container, made by the fsspec class ``filesystem`` with what the
    environment gives it; its name."""
    name = bucket_name(prefix)
    filesystem(skip_instance_cache=True).mkdir(name)
    return name
