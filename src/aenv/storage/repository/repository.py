"""The durable snapshot repository: push a directory as a snapshot, pull it back, collect garbage.

Owns: turning a snapshot directory (CRIU images + sealed filesystem layer + small files) into
deduplicated chunks plus a manifest, and back; the visibility rule (a snapshot exists iff its
manifest exists, and the manifest is written only after every blob it names is durable); the
push/gc coordination markers. Must not touch: live sandbox workspaces (callers hand us a sealed
directory and a target path), the local cache's bookkeeping (see `cache.py`), CRIU itself.

Manifests are self-contained (each lists every chunk of its snapshot), so a snapshot never
depends on its parent: deleting the parent cannot break a child. `parent_id` is recorded and
used only as a hint to skip existence checks for chunks the parent already stored.

GC safety: `push` writes `pending/<id>.<token>` before it checks any chunk and removes it at
the end; `gc` writes `locks/gc` and then looks for fresh pending markers (skipping deletion if
any). A marker names the process that wrote it (host, boot, pid and start time): one whose
writer is known dead (same host and boot, that process gone) is a push a `kill -9` cut short,
and gc deletes it at once rather than waiting `marker_ttl_s` (6 h) with gc held off. Each side writes its own marker before reading the other's, so with a strongly consistent
store (posix, S3 since 2020) at least one of them sees the other: gc can never delete a chunk
that a push has decided to reuse.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import contextlib
import ctypes
import functools
import json
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from aenv.errors import AenvError, ErrorCode, invalid, not_found
from aenv.faults import crash_point
from aenv.storage.repository.blobstore import BlobStore
from aenv.storage.repository.chunking import DEFAULT_CHUNKING, Chunking, iter_chunks
from aenv.storage.repository.manifest import (
    Entry,
    Manifest,
    check_snapshot_id,
    manifest_name,
    scan,
)

T = TypeVar("T")
Progress = Callable[[int, int], None]  # (bytes chunked so far, bytes in the snapshot)

GC_LOCK = "locks/gc"


@dataclass
class PushStats:
    bytes_total: int = 0  # logical size of all regular files
    bytes_uploaded: int = 0  # bytes actually sent to the store (after compression)
    bytes_new: int = 0  # logical size of the chunks the store did not have
    chunks_total: int = 0
    chunks_new: int = 0
    files: int = 0
    seconds: float = 0.0


@dataclass
class PullStats:
    bytes_total: int = 0
    bytes_fetched: int = 0  # logical bytes of the distinct chunks fetched
    chunks_total: int = 0
    chunks_fetched: int = 0
    files: int = 0
    seconds: float = 0.0


@dataclass
class GcStats:
    manifests: int = 0
    blobs_kept: int = 0
    blobs_deleted: int = 0
    skipped: str | None = None  # why nothing was deleted, if so
    seconds: float = 0.0
    stale_markers: int = 0  # pending markers of pushes that died with their server


def _syncfs(path: Path) -> None:
    """Flush one filesystem (cheaper than an fsync per file for trees of many small files)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syncfs(fd) != 0:
            os.sync()
    except (OSError, AttributeError):
        os.sync()
    finally:
        os.close(fd)


def _open_rb(path: Path) -> BinaryIO:
    return path.open("rb")


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks since boot): with the pid, a process's identity."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
        return int(raw.rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def marker_owner() -> dict[str, Any]:
    """Who writes a pending marker: this process, identified across pid reuse and reboots."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot": _boot_id(), "pid": pid,
            "start": _start_time(pid)}


def owner_is_dead(owner: dict[str, Any]) -> bool:
    """Whether a marker's writer is known to be gone: on this host, since this boot, its
    process no longer runs (another host's or an older boot's: not known, False)."""
    if owner.get("host") != socket.gethostname() or owner.get("boot") != _boot_id():
        return False
    pid = owner.get("pid")
    return not isinstance(pid, int) or _start_time(pid) != owner.get("start")


class Repository:
    def __init__(self, store: BlobStore, *, chunking: Chunking = DEFAULT_CHUNKING,
                 concurrency: int = 8, marker_ttl_s: float = 6 * 3600, gc_wait_s: float = 300) -> None:
        self.store = store
        self.chunking = chunking
        self.concurrency = concurrency
        self.marker_ttl_s = marker_ttl_s  # older markers are leftovers of crashed processes
        self.gc_wait_s = gc_wait_s
        # Our own threads: S3 round trips block, and the loop's default executor (cpu+4 threads)
        # is shared with the rest of the server.
        self._executor = concurrent.futures.ThreadPoolExecutor(concurrency + 2, thread_name_prefix="aenv-repo")

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    async def _run(self, fn: Callable[..., T], *args: Any,
                   track: set[concurrent.futures.Future[Any]] | None = None) -> T:
        fut = self._executor.submit(functools.partial(fn, *args))
        if track is not None:
            track.add(fut)
            fut.add_done_callback(track.discard)
        return await asyncio.wrap_future(fut)

    @staticmethod
    async def _settle(tasks: set[asyncio.Task[None]], track: set[concurrent.futures.Future[Any]]) -> None:
        """After a failure: stop the tasks, then wait for worker threads they already started.

        Cancelling an asyncio task does not stop a running thread; without this, a failed push
        would return while its threads still write blobs, and a failed pull while they still
        write into the staging directory being removed."""
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        running = [asyncio.wrap_future(f) for f in list(track)]
        if running:
            await asyncio.wait(running)

    @property
    def description(self) -> str:
        return self.store.description

    # ---- reading -------------------------------------------------------------------------

    async def exists(self, snapshot_id: str) -> bool:
        return await self._run(self.store.get_meta, manifest_name(snapshot_id)) is not None

    async def list(self) -> builtins.list[str]:
        metas = await self._run(self.store.list_meta, "manifests")
        return sorted(m.name.removeprefix("manifests/").removesuffix(".json") for m in metas
                      if m.name.endswith(".json"))

    async def manifest(self, snapshot_id: str) -> Manifest:
        data = await self._run(self.store.get_meta, manifest_name(snapshot_id))
        if data is None:
            raise not_found(f"snapshot {snapshot_id} is not in repository {self.description}")
        return Manifest.from_bytes(data, self.description, snapshot_id)

    # ---- push ----------------------------------------------------------------------------

    async def push(self, snapshot_id: str, directory: Path, parent_id: str | None = None,
                   progress: Progress | None = None) -> PushStats:
        """Store `directory` as snapshot `snapshot_id`. Visible only once complete.

        Snapshots are immutable: pushing an existing id is a CONFLICT. If anything fails
        (including `progress` raising), no manifest is written; uploaded chunks stay as
        garbage for `gc`.
        """
        check_snapshot_id(snapshot_id)
        directory = Path(directory)
        if not directory.is_dir():
            raise invalid(f"push {snapshot_id}: {directory} is not a directory")
        if await self.exists(snapshot_id):
            raise AenvError(ErrorCode.CONFLICT,
                            f"snapshot {snapshot_id} already exists in {self.description}")
        started = time.monotonic()
        marker = f"pending/{snapshot_id}.{secrets.token_hex(4)}"
        await self._run(self.store.put_meta, marker,
                        json.dumps({"at": time.time(), "owner": marker_owner()}).encode())
        try:
            await self._wait_for_gc()
            known: set[str] = set()
            if parent_id is not None:
                known = (await self.manifest(parent_id)).digests()
            stats = PushStats()
            entries = await self._run(lambda: list(scan(directory)))
            stats.bytes_total = sum(e.size for e, _ in entries if e.type == "file")
            await self._upload_files(entries, known, stats, progress)
            manifest = Manifest(snapshot_id=snapshot_id, parent_id=parent_id,
                                entries=[e for e, _ in entries], chunking=self.chunking.as_dict())
            stats.bytes_total = manifest.bytes_total  # files may differ from the scan's stat
            crash_point("repository:chunks")
            # Written last: blobs are durable by now (each put is atomic and synced).
            await self._run(self.store.put_meta, manifest_name(snapshot_id), manifest.to_bytes())
            stats.seconds = time.monotonic() - started
            return stats
        finally:
            with contextlib.suppress(Exception):
                await self._run(self.store.delete_meta, marker)

    async def _writer_died(self, marker: str) -> bool:
        raw = await self._run(self.store.get_meta, marker)
        try:
            owner = json.loads(raw or b"{}").get("owner")
        except (ValueError, AttributeError):
            return False
        return isinstance(owner, dict) and owner_is_dead(owner)

    async def _wait_for_gc(self) -> None:
        deadline = time.monotonic() + self.gc_wait_s
        while True:
            locks = await self._run(self.store.list_meta, "locks")
            if not any(m.name == GC_LOCK and time.time() - m.mtime < self.marker_ttl_s for m in locks):
                return
            if time.monotonic() > deadline:
                raise AenvError(ErrorCode.UNAVAILABLE,
                                f"repository {self.description}: garbage collection still running")
            await asyncio.sleep(0.5)

    async def _upload_files(self, entries: builtins.list[tuple[Entry, Path]], known: set[str],
                            stats: PushStats, progress: Progress | None) -> None:
        sem = asyncio.Semaphore(self.concurrency)  # bounds chunks held in memory, too
        tasks: set[asyncio.Task[None]] = set()
        track: set[concurrent.futures.Future[Any]] = set()
        decided = set(known)  # chunks already present or being uploaded by this push
        failures: builtins.list[Exception] = []  # raised by the producer loop, not lost in a task
        done_bytes = 0

        async def upload(digest: str, data: bytes) -> None:
            try:
                if not await self._run(self.store.has, digest, track=track):
                    stored = await self._run(self.store.put, digest, data, track=track)
                    stats.bytes_uploaded += stored
                    stats.bytes_new += len(data)
                    stats.chunks_new += 1
            except Exception as exc:  # noqa: BLE001 - handed to the producer, which re-raises
                failures.append(exc)
            finally:
                sem.release()

        try:
            for entry, path in entries:
                if entry.type != "file":
                    continue
                stats.files += 1
                f = await self._run(_open_rb, path)
                try:
                    gen = iter_chunks(f, self.chunking)
                    entry.chunks = []
                    while (item := await self._run(next, gen, None)) is not None:
                        digest, data = item
                        entry.chunks.append((digest, len(data)))
                        stats.chunks_total += 1
                        done_bytes += len(data)
                        if progress is not None:
                            progress(done_bytes, stats.bytes_total)
                        if failures:
                            raise failures[0]  # surface an upload failure now, not at the end
                        if digest in decided:
                            continue
                        decided.add(digest)
                        await sem.acquire()
                        task = asyncio.create_task(upload(digest, data))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                finally:
                    await self._run(f.close)
                entry.size = sum(n for _, n in entry.chunks)
            await asyncio.gather(*tasks)
            if failures:
                raise failures[0]
        except BaseException:
            await self._settle(tasks, track)
            raise

    # ---- pull ----------------------------------------------------------------------------

    async def pull(self, snapshot_id: str, into: Path) -> PullStats:
        """Materialise a snapshot at `into` (must not exist, or be an empty directory).

        Builds in a sibling staging directory and renames it into place, so `into` either
        holds the whole verified snapshot or is left as it was."""
        started = time.monotonic()
        manifest = await self.manifest(snapshot_id)
        into = Path(into)
        if into.exists() and (not into.is_dir() or any(into.iterdir())):
            raise AenvError(ErrorCode.CONFLICT, f"pull {snapshot_id}: {into} exists and is not empty")
        into.parent.mkdir(parents=True, exist_ok=True)
        staging = into.parent / f".{into.name}.pull-{secrets.token_hex(4)}"
        stats = PullStats(bytes_total=manifest.bytes_total)
        try:
            locations = await self._run(self._make_tree, manifest, staging, stats)
            await self._fetch_chunks(locations, stats)
            await self._run(self._finish_tree, manifest, staging)
            await self._run(os.replace, staging, into)
        except BaseException:
            await asyncio.shield(self._run(shutil.rmtree, staging, True))
            raise
        stats.seconds = time.monotonic() - started
        return stats

    def _make_tree(self, manifest: Manifest, staging: Path,
                   stats: PullStats) -> dict[str, builtins.list[tuple[Path, int]]]:
        """Create every entry (files sized but empty); return where each chunk must go."""
        staging.mkdir(mode=0o700)
        locations: dict[str, builtins.list[tuple[Path, int]]] = {}
        for e in manifest.entries:
            path = staging if e.path == "." else staging / e.path
            if e.type == "dir":
                if e.path != ".":
                    path.mkdir(mode=0o700)  # final mode in _finish_tree, after children exist
            elif e.type == "file":
                stats.files += 1
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, e.size)  # holes stay holes: zero chunks are not written
                finally:
                    os.close(fd)
                offset = 0
                for digest, length in e.chunks:
                    locations.setdefault(digest, []).append((path, offset))
                    offset += length
                    stats.chunks_total += 1
            elif e.type == "symlink":
                os.symlink(e.target, path)
            elif e.type == "hardlink":
                os.link(staging / e.target, path)
            elif e.type in ("chardev", "blockdev", "fifo"):
                import stat as st

                kind = {"chardev": st.S_IFCHR, "blockdev": st.S_IFBLK, "fifo": st.S_IFIFO}[e.type]
                os.mknod(path, kind | 0o600, e.rdev)
            else:
                raise invalid(f"snapshot {manifest.snapshot_id}: unknown entry type {e.type!r}")
        return locations

    async def _fetch_chunks(self, locations: dict[str, builtins.list[tuple[Path, int]]],
                            stats: PullStats) -> None:
        queue = list(locations.items())

        def write(data: bytes, where: builtins.list[tuple[Path, int]]) -> None:
            if data == bytes(len(data)):
                return  # the file was ftruncated to size: this range already reads as zeros
            for path, offset in where:
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.pwrite(fd, data, offset)
                finally:
                    os.close(fd)

        async def worker() -> None:
            while queue:
                digest, where = queue.pop()
                data = await self._run(self.store.get, digest, track=track)  # verified, or raises
                await self._run(write, data, where, track=track)
                stats.chunks_fetched += 1
                stats.bytes_fetched += len(data)

        track: set[concurrent.futures.Future[Any]] = set()
        workers = {asyncio.create_task(worker()) for _ in range(self.concurrency)}
        try:
            await asyncio.gather(*workers)
        except BaseException:
            await self._settle(workers, track)
            raise

    def _finish_tree(self, manifest: Manifest, staging: Path) -> None:
        """Owners, modes, xattrs and times, deepest first so directory mtimes stick."""
        import base64

        as_root = os.geteuid() == 0
        for e in reversed(manifest.entries):
            if e.type == "hardlink":
                continue
            path = staging if e.path == "." else staging / e.path
            if as_root:  # only root can give files away; others keep their own uid
                os.lchown(path, e.uid, e.gid)
            if e.type != "symlink":
                os.chmod(path, e.mode)  # after chown, which clears setuid/setgid bits
            for name, value in e.xattrs.items():
                os.setxattr(path, name, base64.b64decode(value), follow_symlinks=False)
            os.utime(path, ns=(e.mtime_ns, e.mtime_ns), follow_symlinks=False)
        _syncfs(staging)  # the rename that follows must not expose unwritten data after a crash

    # ---- delete / gc ---------------------------------------------------------------------

    async def delete(self, snapshot_id: str) -> None:
        """Make a snapshot invisible. Its chunks go at the next `gc` unless others share them."""
        if not await self.exists(snapshot_id):
            raise not_found(f"snapshot {snapshot_id} is not in repository {self.description}")
        await self._run(self.store.delete_meta, manifest_name(snapshot_id))

    async def gc(self) -> GcStats:
        """Delete chunks no manifest references. Skips (and says why) while pushes run."""
        started = time.monotonic()
        stats = GcStats()
        await self._run(self.store.put_meta, GC_LOCK, json.dumps({"at": time.time()}).encode())
        try:
            markers = await self._run(self.store.list_meta, "pending")
            pending = [m for m in markers if time.time() - m.mtime < self.marker_ttl_s
                       and not await self._writer_died(m.name)]
            # Markers past their time are of pushes that died with their server (kill -9):
            # gc already ignores them; they go, so that none is left for good.
            for marker in markers:
                if marker not in pending:
                    with contextlib.suppress(Exception):
                        await self._run(self.store.delete_meta, marker.name)
                        stats.stale_markers += 1
            if pending:
                stats.skipped = f"{len(pending)} push(es) in progress"
                return stats
            referenced: set[str] = set()
            for snapshot_id in await self.list():
                referenced |= (await self.manifest(snapshot_id)).digests()
                stats.manifests += 1
            for digest in await self._run(lambda: list(self.store.list())):
                if digest in referenced:
                    stats.blobs_kept += 1
                else:
                    await self._run(self.store.delete, digest)
                    stats.blobs_deleted += 1
            clean_tmp = getattr(self.store, "clean_tmp", None)
            if clean_tmp is not None:
                await self._run(clean_tmp, self.marker_ttl_s)
        finally:
            with contextlib.suppress(Exception):
                await self._run(self.store.delete_meta, GC_LOCK)
            stats.seconds = time.monotonic() - started
        return stats
