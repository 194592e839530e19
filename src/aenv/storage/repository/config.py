"""The `[snapshot]` configuration section and the factory that turns it into a repository.

Owns: validating snapshot settings and choosing a backend. Must not touch: the global config
loader (`aenv.config` embeds `SnapshotConfig` as `Config.snapshot`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aenv.errors import invalid
from aenv.storage.repository.blobstore import BlobStore

BACKENDS = ("posix_fs", "s3")


@dataclass
class SnapshotConfig:
    backend: str = "posix_fs"  # "posix_fs" (a directory, may be a shared filesystem) or "s3"
    path: str | None = None  # posix_fs root; None means $home/repository
    s3_endpoint: str | None = None  # e.g. https://s3.eu-west-1.amazonaws.com or http://minio:9000
    s3_bucket: str | None = None
    s3_prefix: str | None = None  # key prefix inside the bucket; None or "" means the bucket root
    s3_region: str | None = None  # required for s3: signatures depend on it, never guessed
    cache_gb: int = 10  # local runtime cache of materialised snapshots, GiB (LRU beyond this)
    # Paused sandboxes' checkpoint images kept locally once they are in the repository, MiB:
    # beyond it the oldest are dropped locally and a resume pulls them back (0: all kept).
    paused_cache_mb: int = 20480
    max_sealed_layers: int = 8  # sealed layers a stack may hold before they are compacted
    # Every this many seconds the server deletes chunks no snapshot references any more
    # (deleted snapshots, resumed or killed paused sandboxes, interrupted uploads); 0: never.
    gc_interval_s: int = 600
    # A snapshot push that failed (repository unreachable, disk error) is tried again this
    # many seconds later, for as long as it takes; the snapshot is usable on its node meanwhile.
    push_retry_s: int = 30

    @property
    def cache_bytes(self) -> int:
        return int(self.cache_gb) * (1 << 30)

    def validate(self) -> None:
        """Raise AenvError(invalid_argument) naming the missing or bad key."""
        if self.backend not in BACKENDS:
            raise invalid(f"config snapshot.backend: {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if int(self.cache_gb) < 0:
            raise invalid("config snapshot.cache_gb: must be >= 0")
        if int(self.max_sealed_layers) < 1:
            raise invalid("config snapshot.max_sealed_layers: must be >= 1")
        if self.backend == "s3":
            missing = [
                f"snapshot.{key}"
                for key in ("s3_endpoint", "s3_bucket", "s3_region")
                if not getattr(self, key)
            ]
            if missing:
                raise invalid(
                    "config: the s3 snapshot backend needs "
                    + ", ".join(missing)
                    + " (endpoint, bucket and region must be given explicitly)"
                )


def open_blob_store(cfg: SnapshotConfig, home: Path) -> BlobStore:
    """The configured backend. Validates first, so a bad config fails before any I/O."""
    cfg.validate()
    if cfg.backend == "s3":
        from aenv.storage.repository.s3 import S3BlobStore  # boto3 is imported only when used

        assert cfg.s3_endpoint and cfg.s3_bucket and cfg.s3_region  # validate() checked
        return S3BlobStore(cfg.s3_endpoint, cfg.s3_bucket, cfg.s3_prefix or "", cfg.s3_region)
    from aenv.storage.repository.posix import PosixBlobStore

    return PosixBlobStore(Path(cfg.path) if cfg.path else home / "repository")
