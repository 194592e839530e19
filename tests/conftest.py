"""Shared fixtures: a real `aenv serve` process on a private AENV_HOME, driven over HTTP, and a
real S3-compatible server.

The base template layer is built once per machine into AENV_TEST_LAYER_CACHE (default
/var/cache/aenv-test/layers) and linked into each test home (`aenv.devserver.prepare_home`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from sandbox_helpers import runtime_env

from aenv.devserver import S3Server, ServerProcess, free_port, sdk_server


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """One server for the whole session; tests must clean up the sandboxes they create."""
    with sdk_server(extra_env=runtime_env(AENV_SANDBOX_MAX_SANDBOXES="200")) as srv:
        yield srv


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A real S3-compatible server (moto's, threaded, on a loopback port) with one bucket.
    Credentials reach boto3 through its usual chain: the environment."""
    from moto.server import ThreadedMotoServer

    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
             "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}
    saved = {k: os.environ.get(k) for k in (*creds, "AWS_SESSION_TOKEN")}
    os.environ.update(creds)
    os.environ.pop("AWS_SESSION_TOKEN", None)
    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    s3 = S3Server(f"http://127.0.0.1:{port}", "aenv-snapshots", "eu-central-1")
    import boto3

    boto3.client("s3", endpoint_url=s3.endpoint, region_name=s3.region).create_bucket(
        Bucket=s3.bucket,
        CreateBucketConfiguration={"LocationConstraint": s3.region})  # type: ignore[typeddict-item]
    yield s3
    moto.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
