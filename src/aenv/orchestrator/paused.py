"""`PausedStateKeeper`: paused sandboxes' state copied to the snapshot repository, so that a
paused sandbox survives the loss of its local files, not only a server restart.

After a pause the manager calls `persist_later()`: the driver's paused-state directories
(`PausedStateDriver.paused_state`: for a container, the CRIU image and the writable layer)
are pushed in the background, under `paused-<sandbox>-<name>`, starting 1 s after the pause,
so the pause itself does not wait for the upload. A resume calls `ensure_local()` first: an upload still running is
cancelled (the local copy is there and about to be used), and any directory missing locally
is pulled back. After a resume or a kill, `forget_later()` deletes the entries. At start-up,
`persist_later()` again for every paused sandbox whose upload never finished.

Local copies are bounded (`local_budget_bytes`, config `snapshot.paused_cache_mb`): once a
paused sandbox's state is in the repository, its checkpoint image is a cache entry, and the
images of the sandboxes paused longest ago are dropped locally while their total exceeds the
budget (a resume pulls the image back). An idle sandbox's image is ~10 MiB, but ~1.7 MiB of
new chunks in the repository (the rest is shared): without the bound 10 000 paused sandboxes
would need ~107 GB of local disk, with it ~17 GB of repository. A dropped image is first
renamed away (atomic: a resume sees it whole or not at all), then deleted.

Owns: the repository entries named `paused-*` and its upload tasks. Must not touch: sandbox
records (the manager's), the local directories other than filling missing ones.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import shutil
import time
from pathlib import Path

from aenv.errors import AenvError, ErrorCode
from aenv.runtime.base import PausedStateDriver, RuntimeHandle
from aenv.storage.repository.repository import Repository
from aenv.storage.usage import allocated_bytes

log = logging.getLogger("aenv.orchestrator")
PREFIX = "paused-"
PERSIST_DELAY_S = 1.0


def entry_name(sandbox_id: str, name: str) -> str:
    return f"{PREFIX}{sandbox_id}-{name}"


class PausedStateKeeper:
    def __init__(self, repository: Repository, local_budget_bytes: int = 0) -> None:
        self.repository = repository
        self.local_budget_bytes = local_budget_bytes  # 0: local copies are never dropped
        self._uploads: dict[str, asyncio.Task[None]] = {}
        self._deletes: set[asyncio.Task[None]] = set()
        # Paused sandboxes whose state is in the repository and whose image is still local:
        # sandbox id -> (the image directory, its bytes), oldest first. Only these may have
        # their image dropped; a resume or a kill takes them out first.
        self._droppable: collections.OrderedDict[str, tuple[Path, int]] = (
            collections.OrderedDict())
        self._droppable_bytes = 0

    def persist_later(self, driver: PausedStateDriver, handle: RuntimeHandle) -> None:
        """Upload the paused state of `handle` in the background (what is there already is
        skipped: a restarted server calls this for every paused sandbox)."""
        sid = handle.sandbox_id
        self._cancel(sid)
        task = asyncio.get_running_loop().create_task(
            self._persist(sid, driver.paused_state(handle)), name=f"aenv-persist-{sid}")
        self._uploads[sid] = task
        task.add_done_callback(lambda t: self._finished(sid, t))

    async def _persist(self, sid: str, state: dict[str, Path]) -> None:
        # A pause soon followed by a resume (a common rhythm) uploads nothing: the upload
        # starts after a grace period, and a resume cancels it.
        await asyncio.sleep(PERSIST_DELAY_S)
        started = time.monotonic()
        stored = 0
        for name, path in state.items():
            key = entry_name(sid, name)
            if await self.repository.exists(key):
                continue
            if not path.is_dir():
                raise AenvError(ErrorCode.NOT_FOUND, f"{path} is missing")
            stored += (await self.repository.push(key, path)).bytes_uploaded
        log.info("paused sandbox %s is in the repository (%d bytes uploaded, %.2f s)", sid,
                 stored, time.monotonic() - started)
        if self.local_budget_bytes > 0:
            image = next((p for n, p in state.items() if n.endswith("-image")), None)
            if image is not None and image.is_dir():
                size = await asyncio.to_thread(allocated_bytes, image)
                self._not_droppable(sid)
                self._droppable[sid] = (image, size)
                self._droppable_bytes += size
                await self._drop_over_budget()

    def _not_droppable(self, sid: str) -> None:
        entry = self._droppable.pop(sid, None)
        if entry is not None:
            self._droppable_bytes -= entry[1]

    async def _drop_over_budget(self) -> None:
        """Drop the local images of the sandboxes paused longest ago while the local copies
        of stored states exceed the budget."""
        while self._droppable_bytes > self.local_budget_bytes and self._droppable:
            sid, (image, size) = self._droppable.popitem(last=False)
            self._droppable_bytes -= size
            trash = image.with_name(image.name + ".dropped")
            try:
                image.rename(trash)  # atomic: a resume sees the image whole or missing
            except OSError as exc:
                log.warning("paused sandbox %s: could not drop its local image: %s", sid, exc)
                continue
            await asyncio.to_thread(shutil.rmtree, trash, True)
            log.info("paused sandbox %s: local image dropped (%d bytes; it is in the "
                     "repository)", sid, size)

    def _finished(self, sid: str, task: asyncio.Task[None]) -> None:
        if self._uploads.get(sid) is task:
            del self._uploads[sid]
        if not task.cancelled() and task.exception() is not None:
            # Not fatal: the sandbox is paused on local disk; the next start-up retries.
            exc = task.exception()
            log.error("paused sandbox %s: copying its state to the repository failed: %s", sid,
                      exc.message if isinstance(exc, AenvError) else repr(exc))

    def _cancel(self, sid: str) -> None:
        task = self._uploads.pop(sid, None)
        if task is not None:
            task.cancel()

    async def ensure_local(self, driver: PausedStateDriver, handle: RuntimeHandle) -> None:
        """Before a resume: every directory of the paused state is on local disk, pulled
        from the repository where it is missing. AenvError(NOT_FOUND) when neither has it."""
        sid = handle.sandbox_id
        self._cancel(sid)
        self._not_droppable(sid)
        state = driver.paused_state(handle)
        missing = {name: path for name, path in state.items() if not path.exists()}
        if not missing:
            return
        await driver.prepare_paused_state(handle)
        for name, path in missing.items():
            key = entry_name(sid, name)
            if not await self.repository.exists(key):
                raise AenvError(ErrorCode.NOT_FOUND,
                                f"sandbox {sid}: its paused state ({path}) is gone from this "
                                "node and was never stored in the repository")
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()  # an empty placeholder (prepare_paused_state): pull replaces it
            stats = await self.repository.pull(key, path)
            log.info("sandbox %s: paused state %s pulled from the repository (%d bytes, "
                     "%.2f s)", sid, name, stats.bytes_total, stats.seconds)

    def forget_later(self, driver: PausedStateDriver, handle: RuntimeHandle) -> None:
        """The paused state of `handle` is no longer needed (resumed, or killed): delete its
        entries in the background (their chunks go at the repository's next gc)."""
        sid = handle.sandbox_id
        self._cancel(sid)
        self._not_droppable(sid)
        try:
            keys = [entry_name(sid, name) for name in driver.paused_state(handle)]
        except AenvError:
            return  # not a paused handle: nothing was stored
        task = asyncio.get_running_loop().create_task(self._delete(keys))
        self._deletes.add(task)
        task.add_done_callback(self._deletes.discard)

    async def _delete(self, keys: list[str]) -> None:
        for key in keys:
            with contextlib.suppress(AenvError):  # never uploaded, or only partly
                await self.repository.delete(key)

    async def close(self) -> None:
        """Stop uploads (a restart resumes them) and finish deletes."""
        for task in self._uploads.values():
            task.cancel()
        await asyncio.gather(*self._uploads.values(), *self._deletes, return_exceptions=True)
