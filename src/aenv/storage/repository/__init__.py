"""Snapshot repository: durable, content-addressed snapshot storage plus a local LRU cache.

Owns: `src/aenv/storage/repository/**` — blob stores (posix_fs, s3), chunking, manifests,
push/pull/gc, and the bounded local cache of materialised snapshots. Must not touch: live
sandbox workspaces, CRIU, the database of sandbox records.

Typical use:
    store = open_blob_store(cfg.snapshot, cfg.home)
    repo = Repository(store)
    await repo.push("snap-1", image_dir, parent_id="snap-0")
    cache = LocalCache(layout.cache_dir / "snapshots", cfg.snapshot.cache_bytes, repo)
    async with cache.use("snap-1") as path: ...  # restore from `path`
"""

from aenv.storage.repository.blobstore import BlobStore, MetaInfo
from aenv.storage.repository.cache import CacheStats, LocalCache
from aenv.storage.repository.chunking import DEFAULT_CHUNKING, Chunking
from aenv.storage.repository.config import SnapshotConfig, open_blob_store
from aenv.storage.repository.errors import BlobCorrupted
from aenv.storage.repository.manifest import Entry, Manifest
from aenv.storage.repository.posix import PosixBlobStore
from aenv.storage.repository.repository import GcStats, PullStats, PushStats, Repository

__all__ = [
    "DEFAULT_CHUNKING", "BlobCorrupted", "BlobStore", "CacheStats", "Chunking", "Entry", "GcStats",
    "LocalCache", "Manifest", "MetaInfo", "PosixBlobStore", "PullStats", "PushStats", "Repository",
    "SnapshotConfig", "open_blob_store",
]
