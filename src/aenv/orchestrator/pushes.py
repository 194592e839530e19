"""Snapshots reach the repository in the background: `create_snapshot()` returns once the
capture is done and its image is in the node's local cache, not after the upload.

A snapshot of a setup that wrote 50 000 files took ~40 s to return while its image and sealed
layer were chunked into the repository, though the capture itself (the parent frozen) takes
~0.1 s. Now the manager lists the snapshot as soon as it is captured (usable on this node at
once: its image is pinned in the local cache, its sealed layer on disk) and hands it to a
`SnapshotPusher`, which pushes one snapshot at a time, in order: a later snapshot of the same
sandbox then finds the earlier one's chunks and stores only what changed. Until its push is
done a snapshot's record says `in_repository=False` (and the API shows no `storedBytes`); a
push cut short by a restart is started again at the next start, a failed one retried.

Owns: the push tasks, and the cache pin that keeps a not-yet-pushed image (the only copy).
Must not touch: template records (the manager writes them, through `on_pushed`), sandboxes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from aenv.errors import AenvError, ErrorCode
from aenv.faults import crash_point
from aenv.storage.repository.cache import LocalCache

log = logging.getLogger("aenv.pushes")

RETRY_S = 30.0  # a failed push (repository down, disk error) is tried again this much later


@dataclass(frozen=True)
class PendingPush:
    """What goes to the repository for one snapshot: its image (in the local cache) and the
    sealed layers it stacks on that the repository may lack, as (repository key, path)."""

    snapshot_id: str
    layers: tuple[tuple[str, Path], ...]


class SnapshotPusher:
    def __init__(self, cache: LocalCache,
                 on_pushed: Callable[[str, int, int], Awaitable[None]],
                 retry_s: float = RETRY_S) -> None:
        self.cache = cache
        self.retry_s = retry_s
        self._on_pushed = on_pushed  # (snapshot id, bytes in all, bytes new in the repository)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._one_at_a_time = asyncio.Lock()

    def start(self, push: PendingPush) -> None:
        """Push in the background. The image must already be in the cache; it stays pinned
        until the push is done (or cancelled)."""
        if push.snapshot_id in self._tasks:
            return
        self.cache.pin(push.snapshot_id)
        task = asyncio.create_task(self._push(push), name=f"aenv-push-{push.snapshot_id}")
        self._tasks[push.snapshot_id] = task

    async def cancel(self, snapshot_id: str) -> None:
        """Stop a snapshot's push (it is being deleted); its uploaded chunks are garbage for
        the repository's gc."""
        task = self._tasks.get(snapshot_id)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def close(self) -> None:
        """Stop every push; the records still say `in_repository=False`, so the next start
        pushes them again."""
        for snapshot_id in list(self._tasks):
            await self.cancel(snapshot_id)

    async def _push(self, push: PendingPush) -> None:
        try:
            while True:
                try:
                    async with self._one_at_a_time:
                        size, stored = await self._upload(push)
                    await self._on_pushed(push.snapshot_id, size, stored)
                    log.info("snapshot %s: in the repository (%d bytes, %d new)",
                             push.snapshot_id, size, stored)
                    return
                except (AenvError, OSError) as exc:
                    message = exc.message if isinstance(exc, AenvError) else str(exc)
                    log.error("snapshot %s: push to the repository failed (again in %.0f s): %s",
                              push.snapshot_id, self.retry_s, message)
                await asyncio.sleep(self.retry_s)
        finally:
            self._tasks.pop(push.snapshot_id, None)
            self.cache.unpin(push.snapshot_id)

    async def _upload(self, push: PendingPush) -> tuple[int, int]:
        repository = self.cache.repository
        size = stored = 0
        # The image last: a snapshot in the repository has its layers there too.
        for key, path in (*push.layers, (push.snapshot_id, self.cache.path(push.snapshot_id))):
            if key == push.snapshot_id:
                crash_point("push:layers")
            if await repository.exists(key):
                continue  # pushed before a restart (or by an earlier snapshot: a shared layer)
            try:
                pushed = await repository.push(key, path)
            except AenvError as exc:
                if exc.code is not ErrorCode.CONFLICT:  # pushed meanwhile by another snapshot
                    raise
                continue
            size, stored = size + pushed.bytes_total, stored + pushed.bytes_uploaded
        return size, stored
