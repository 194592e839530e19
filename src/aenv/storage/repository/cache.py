"""The bounded local runtime cache of materialised snapshots.

Owns: `<root>/<snapshot_id>/` directories pulled from (or adopted into) the cache, their LRU
order, pins and eviction. Must not touch: the repository's contents (it only reads through
`Repository.pull`), live sandbox workspaces (a sandbox restores *from* a cached directory; if
it needs to write, it copies or overlays it), anything outside `root`.

The three layers of state stay apart: live workspaces (elsewhere), the durable repository, and
this cache, which may be wiped at any time while nothing is pinned: `ensure_local` notices a
missing directory and pulls again. LRU order survives restarts through directory mtimes
(touched on every use).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from aenv.errors import AenvError, ErrorCode
from aenv.storage.repository.manifest import check_snapshot_id
from aenv.storage.repository.repository import Repository
from aenv.storage.usage import apparent_bytes


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes: int = 0  # logical bytes of cached snapshots
    entries: int = 0
    pinned: int = 0
    max_bytes: int = 0


class LocalCache:
    def __init__(self, root: Path, max_bytes: int, repository: Repository) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.repository = repository
        self._sizes: dict[str, int] = {}
        self._last_used: dict[str, float] = {}
        self._pins: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._stats = CacheStats(max_bytes=max_bytes)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.root.chmod(0o700)  # materialised checkpoint images: process memory, tokens
        self._load()

    def _load(self) -> None:
        for p in self.root.iterdir():
            if p.name.startswith("."):  # staging/trash of a crashed pull or eviction
                shutil.rmtree(p, ignore_errors=True)
            elif p.is_dir():
                self._sizes[p.name] = apparent_bytes(p)
                self._last_used[p.name] = p.stat().st_mtime

    def path(self, snapshot_id: str) -> Path:
        return self.root / check_snapshot_id(snapshot_id)

    def stats(self) -> CacheStats:
        s = self._stats
        s.bytes = sum(self._sizes.values())
        s.entries = len(self._sizes)
        s.pinned = sum(1 for n in self._pins.values() if n > 0)
        return CacheStats(**vars(s))

    def pin(self, snapshot_id: str) -> None:
        """Never evict this snapshot until unpinned (reference-counted)."""
        self._pins[snapshot_id] = self._pins.get(snapshot_id, 0) + 1

    def unpin(self, snapshot_id: str) -> None:
        n = self._pins.get(snapshot_id, 0) - 1
        if n < 0:
            raise AenvError(ErrorCode.INTERNAL, f"cache: unpin of unpinned snapshot {snapshot_id}")
        if n == 0:
            del self._pins[snapshot_id]
        else:
            self._pins[snapshot_id] = n

    def is_pinned(self, snapshot_id: str) -> bool:
        return self._pins.get(snapshot_id, 0) > 0

    def __contains__(self, snapshot_id: str) -> bool:
        return snapshot_id in self._sizes and self.path(snapshot_id).is_dir()

    def _touch(self, snapshot_id: str) -> None:
        now = time.time()
        self._last_used[snapshot_id] = now
        try:
            os.utime(self.path(snapshot_id), (now, now))
        except FileNotFoundError:
            pass

    async def ensure_local(self, snapshot_id: str, *, pin: bool = False) -> Path:
        """The snapshot's local directory: a cache hit, or a pull from the repository.

        With `pin`, the snapshot is pinned before eviction runs (caller must `unpin`)."""
        path = self.path(snapshot_id)
        lock = self._locks.setdefault(snapshot_id, asyncio.Lock())
        async with lock:  # one pull per snapshot even if many sandboxes ask at once
            if snapshot_id in self._sizes and not path.is_dir():
                self._forget(snapshot_id)  # the cache directory was wiped under us
            if snapshot_id in self._sizes:
                self._stats.hits += 1
            else:
                self._stats.misses += 1
                stats = await self.repository.pull(snapshot_id, path)  # staged + renamed
                self._sizes[snapshot_id] = stats.bytes_total
            self._touch(snapshot_id)
            if pin:
                self.pin(snapshot_id)
        await self._evict(keep=snapshot_id)
        return path

    @asynccontextmanager
    async def use(self, snapshot_id: str) -> AsyncIterator[Path]:
        """`async with cache.use(id) as path:` — pinned for the duration of the block."""
        path = await self.ensure_local(snapshot_id, pin=True)
        try:
            yield path
        finally:
            self.unpin(snapshot_id)

    async def adopt(self, snapshot_id: str, directory: Path) -> Path:
        """Move a freshly made snapshot directory into the cache (same filesystem: a rename)."""
        path = self.path(snapshot_id)
        if snapshot_id in self:
            raise AenvError(ErrorCode.CONFLICT, f"cache: snapshot {snapshot_id} is already cached")
        size = await asyncio.to_thread(apparent_bytes, directory)
        await asyncio.to_thread(os.replace, directory, path)
        self._sizes[snapshot_id] = size
        self._touch(snapshot_id)
        await self._evict(keep=snapshot_id)
        return path

    def _forget(self, snapshot_id: str) -> None:
        self._sizes.pop(snapshot_id, None)
        self._last_used.pop(snapshot_id, None)

    async def _evict(self, keep: str | None = None) -> None:
        """Remove least-recently-used unpinned snapshots until under `max_bytes`."""
        while sum(self._sizes.values()) > self.max_bytes:
            candidates = [s for s in self._sizes
                          if s != keep and not self.is_pinned(s) and not self._locks_busy(s)]
            if not candidates:
                return  # everything left is pinned or in use: over the limit beats breaking a sandbox
            victim = min(candidates, key=lambda s: self._last_used.get(s, 0.0))
            await self.evict(victim)

    def _locks_busy(self, snapshot_id: str) -> bool:
        lock = self._locks.get(snapshot_id)
        return lock is not None and lock.locked()

    async def evict(self, snapshot_id: str) -> None:
        """Drop one snapshot from the cache (refused while pinned)."""
        if self.is_pinned(snapshot_id):
            raise AenvError(ErrorCode.CONFLICT, f"cache: snapshot {snapshot_id} is pinned")
        path = self.path(snapshot_id)
        self._forget(snapshot_id)
        self._stats.evictions += 1
        # Rename first (atomic, instant) so a concurrent ensure_local never sees half a tree.
        trash = self.root / f".evict-{snapshot_id}-{time.monotonic_ns()}"
        try:
            os.replace(path, trash)
        except FileNotFoundError:
            return
        await asyncio.to_thread(shutil.rmtree, trash, True)
