"""A real S3 API on 127.0.0.1 for the object-store tests: moto's server (``moto[server]``).

``s3_endpoint`` (module scope) starts ``ThreadedMotoServer`` on an ephemeral port and points
the usual AWS environment variables at it: dummy credentials, the endpoint
(``AWS_ENDPOINT_URL``, which botocore and so s3fs read) and no config files or instance
metadata, so nothing can reach a real account.  ``spark_s3_environment`` puts the same
variables into ``SparkContext.environment``, the environment Spark gives the Python workers
it starts from then on, so executors (and the ranks they start) find the same S3 as the
driver, through the same environment a cluster would give them.  ``s3_url`` is a fresh
bucket's ``s3://`` URL per test.
"""

import contextlib
import logging

import pytest

from _emulators import environment, new_bucket

DUMMY_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent/spark_hvd-tests-aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/spark_hvd-tests-aws-credentials",
    "AWS_EC2_METADATA_DISABLED": "true",
}
UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")


@pytest.fixture(scope="module")
def s3_endpoint():
    """The endpoint URL of a moto S3 server, with the driver's environment pointing at it."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        with environment(s3_env(endpoint), UNSET):
            yield endpoint
    finally:
        server.stop()


def s3_env(endpoint):
    return dict(DUMMY_ENV, AWS_ENDPOINT_URL=endpoint)


@contextlib.contextmanager
def spark_s3_environment(spark, endpoint):
    """``s3_env`` in the environment of the Python workers Spark starts inside the block."""
    env = spark.sparkContext.environment
    saved = {k: env.get(k) for k in s3_env(endpoint)}
    env.update(s3_env(endpoint))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v


def make_bucket(prefix="shvd"):
    """A new bucket on the moto server; its name."""
    import s3fs
    return new_bucket(s3fs.S3FileSystem, prefix)


@pytest.fixture
def s3_url(s3_endpoint):
    """``s3://<a new bucket>/store``."""
    return f"s3://{make_bucket()}/store"
