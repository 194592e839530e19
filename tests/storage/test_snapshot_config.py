"""The [snapshot] configuration section and backend selection."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.errors import AenvError, ErrorCode
from aenv.storage.repository import PosixBlobStore, SnapshotConfig, open_blob_store
from aenv.storage.repository.s3 import S3BlobStore


def test_default_is_posix_under_home(tmp_path: Path) -> None:
    cfg = SnapshotConfig()
    assert cfg.cache_bytes == 10 << 30
    store = open_blob_store(cfg, tmp_path)
    assert isinstance(store, PosixBlobStore) and store.root == tmp_path / "repository"
    other = open_blob_store(SnapshotConfig(path=str(tmp_path / "shared")), tmp_path)
    assert isinstance(other, PosixBlobStore) and other.root == tmp_path / "shared"


def test_s3_needs_endpoint_bucket_and_region(tmp_path: Path) -> None:
    cfg = SnapshotConfig(backend="s3", s3_endpoint="http://127.0.0.1:9", s3_bucket="b")
    with pytest.raises(AenvError) as exc:
        open_blob_store(cfg, tmp_path)
    assert exc.value.code is ErrorCode.INVALID_ARGUMENT
    assert "snapshot.s3_region" in exc.value.message
    assert "snapshot.s3_bucket" not in exc.value.message
    with pytest.raises(AenvError, match="snapshot.s3_endpoint, snapshot.s3_bucket, snapshot.s3_region"):
        SnapshotConfig(backend="s3").validate()
    with pytest.raises(AenvError, match="snapshot.backend"):
        SnapshotConfig(backend="ftp").validate()
    cfg.s3_region = "eu-central-1"
    cfg.s3_prefix = "/team-a/"
    store = open_blob_store(cfg, tmp_path)  # no I/O yet: a client only
    assert isinstance(store, S3BlobStore) and store.prefix == "team-a/"
