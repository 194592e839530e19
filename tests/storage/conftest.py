"""Fixtures for the snapshot repository: a repository per backend (posix_fs, and s3 on the
real S3-compatible server of the top-level conftest)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aenv.storage.repository import BlobStore, PosixBlobStore, Repository
from aenv.storage.repository.s3 import S3BlobStore


def make_store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> BlobStore:
    if kind == "posix_fs":
        return PosixBlobStore(tmp_path / "repository")
    s3 = request.getfixturevalue("s3_server")
    # A fresh prefix per test keeps tests independent inside one bucket.
    return S3BlobStore(s3.endpoint, s3.bucket, f"t-{secrets.token_hex(4)}/snapshots", s3.region)


@pytest.fixture(params=["posix_fs", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    return make_store(request.param, tmp_path, request)


@pytest.fixture
async def repo(store: BlobStore) -> AsyncIterator[Repository]:
    r = Repository(store, concurrency=8)
    yield r
    r.close()
