"""`posix_fs` backend: the repository is a directory (local disk or a shared filesystem).

Owns: the directory layout of a posix repository and atomic writes into it:
  blobs/<2 hex>/<64 hex>   encoded chunk (codec byte + payload)
  meta/<name>              manifests (meta/manifests/<id>.json) and push/gc markers
  tmp/                     in-flight writes; renamed into place when complete
Must not touch: anything outside `root`; the meaning of blobs or manifests.

Atomicity: write to tmp/ on the same filesystem, fsync the file, rename, fsync the directory,
so a reader (or a crash) sees either nothing or the whole object.
"""

from __future__ import annotations

import builtins
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from aenv.storage.repository.blobstore import BlobStoreBase, MetaInfo, check_meta_name


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PosixBlobStore(BlobStoreBase):
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._blobs = self.root / "blobs"
        self._meta = self.root / "meta"
        self._tmp = self.root / "tmp"
        # Blobs are checkpoint images (process memory, envd tokens) and writable layers:
        # the servers' alone (they run as root), on a local or a shared filesystem.
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.root.chmod(0o700)
        for d in (self._blobs, self._meta, self._tmp):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)

    @property
    def description(self) -> str:
        return f"posix_fs:{self.root}"

    def blob_path(self, digest: str) -> Path:
        return self._blobs / digest[:2] / digest

    def _atomic_write(self, final: Path, data: bytes) -> None:
        tmp = self._tmp / f"{final.name}.{secrets.token_hex(6)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(final.parent)

    def _raw_has(self, digest: str) -> bool:
        return self.blob_path(digest).exists()

    def _raw_put(self, digest: str, stored: bytes) -> None:
        self._atomic_write(self.blob_path(digest), stored)

    def _raw_get(self, digest: str) -> bytes | None:
        try:
            return self.blob_path(digest).read_bytes()
        except FileNotFoundError:
            return None

    def delete(self, digest: str) -> None:
        self.blob_path(digest).unlink(missing_ok=True)

    def list(self) -> Iterator[str]:
        for sub in sorted(self._blobs.iterdir()):
            if sub.is_dir():
                for blob in sorted(sub.iterdir()):
                    yield blob.name

    def put_meta(self, name: str, data: bytes) -> None:
        self._atomic_write(self._meta / check_meta_name(name), data)

    def get_meta(self, name: str) -> bytes | None:
        try:
            return (self._meta / check_meta_name(name)).read_bytes()
        except FileNotFoundError:
            return None

    def list_meta(self, prefix: str) -> builtins.list[MetaInfo]:
        base = self._meta / check_meta_name(prefix.rstrip("/"))
        if not base.is_dir():
            return []
        out = []
        for p in sorted(base.iterdir()):
            try:
                out.append(MetaInfo(str(p.relative_to(self._meta)), p.stat().st_mtime))
            except FileNotFoundError:  # deleted while listing
                continue
        return out

    def delete_meta(self, name: str) -> None:
        (self._meta / check_meta_name(name)).unlink(missing_ok=True)

    def clean_tmp(self, older_than_s: float) -> int:
        """Remove leftovers of writers that crashed mid-write. Returns how many."""
        import time

        removed = 0
        cutoff = time.time() - older_than_s
        for p in self._tmp.iterdir():
            try:
                if p.stat().st_mtime < cutoff:
                    p.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        return removed
