"""Fixtures for the snapshot repository: a real S3-compatible server (moto, in-process threaded
server on a loopback port) and a repository per backend (posix_fs, s3)."""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from aenv.storage.repository import BlobStore, PosixBlobStore, Repository
from aenv.storage.repository.s3 import S3BlobStore

BUCKET = "aenv-snapshots"
REGION = "eu-central-1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE",
                                            "AWS_SHARED_CREDENTIALS_FILE")}
    # Credentials come from boto3's usual chain; the environment is the simplest source here.
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_CONFIG_FILE="/dev/null", AWS_SHARED_CREDENTIALS_FILE="/dev/null")
    os.environ.pop("AWS_SESSION_TOKEN", None)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name=REGION).create_bucket(
        Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION})  # type: ignore[typeddict-item]
    yield endpoint
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def make_store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> BlobStore:
    if kind == "posix_fs":
        return PosixBlobStore(tmp_path / "repository")
    endpoint = request.getfixturevalue("s3_endpoint")
    # A fresh prefix per test keeps tests independent inside one bucket.
    return S3BlobStore(endpoint, BUCKET, f"t-{secrets.token_hex(4)}/snapshots", REGION)


@pytest.fixture(params=["posix_fs", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    return make_store(request.param, tmp_path, request)


@pytest.fixture
async def repo(store: BlobStore) -> AsyncIterator[Repository]:
    r = Repository(store, concurrency=8)
    yield r
    r.close()
