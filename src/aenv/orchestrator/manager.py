"""`SandboxManager`: every lifecycle operation, serialised per sandbox, recorded durably.

The manager is the only writer of sandbox records. Each operation takes the sandbox's lock,
checks the state machine (`SandboxState`), calls the runtime driver, then commits the new
record. A background sweeper enforces TTLs.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import shutil
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

from aenv.config import Config
from aenv.errors import AenvError, ErrorCode, invalid, not_found
from aenv.orchestrator.ids import new_access_token, new_client_id, new_sandbox_id
from aenv.orchestrator.models import (
    CreateRequest,
    ListQuery,
    SandboxRecord,
    SandboxState,
    TemplateRecord,
)
from aenv.orchestrator.store import Store
from aenv.runtime.base import (
    PausableDriver,
    ReadyShape,
    ResourceUsage,
    RuntimeDriver,
    RuntimeHandle,
    SandboxSpec,
    SnapshotDriver,
)
from aenv.storage.layout import Layout
from aenv.storage.repository import LocalCache

log = logging.getLogger("aenv.orchestrator")

SWEEP_INTERVAL_S = 0.5
PAUSE_RETRY_S = 30  # a sandbox whose pause failed at expiry is tried again this much later
MAX_FORK = 100  # children per fork call (the API limit; 16 is the case we optimise)


def utcnow() -> datetime:
    return datetime.now(UTC)


class SandboxManager:
    def __init__(self, config: Config, layout: Layout, store: Store, driver: RuntimeDriver,
                 ensure_templates: Callable[[], Awaitable[None]] | None = None,
                 snapshots: LocalCache | None = None) -> None:
        self.config = config
        self.layout = layout
        self.store = store
        self.driver = driver
        self._ensure_templates = ensure_templates
        self._records: dict[str, SandboxRecord] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._creating = 0
        self._stop_listeners: list[Callable[[str], None]] = []
        # Snapshots live in the durable repository; `snapshots` is the bounded local cache in
        # front of it (None: snapshots stay local only, in layout.snapshots_dir).
        self.snapshots = snapshots

    # ---------------------------------------------------------------- start / stop
    async def start(self) -> None:
        self.layout.ensure()
        if self._ensure_templates is not None:
            await self._ensure_templates()
        await self.driver.start()
        self._configure_ready_pool()
        for rec in list(self.store.iter_sandboxes()):
            await self._reattach(rec)
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="aenv-ttl-sweeper")

    def _configure_ready_pool(self) -> None:
        """Drivers with a ready pool keep sandboxes of the default template's shape started
        (with internet access, the API's default), exactly as `create()` would ask for."""
        set_shapes = getattr(self.driver, "set_ready_shapes", None)
        tpl = self.store.find_template(self.config.sandbox.template)
        if set_shapes is None or tpl is None:
            return
        set_shapes([ReadyShape(
            lower_layers=tuple(self.layout.layer(layer) for layer in tpl.layers),
            cpu_count=tpl.cpu_count, memory_mb=tpl.memory_mb,
            pids_max=self.config.sandbox.pids_max, allow_internet_access=True,
            envd_port=self.config.sandbox.envd_port, default_user=tpl.default_user)])

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except asyncio.CancelledError:
                pass
        await self.driver.close()

    async def _reattach(self, rec: SandboxRecord) -> None:
        if rec.state is SandboxState.PAUSED:
            self._records[rec.sandbox_id] = rec
            return
        handle = RuntimeHandle(rec.runtime, rec.sandbox_id, rec.handle)
        alive = rec.state is SandboxState.RUNNING and await self.driver.attach(handle)
        if alive:
            self._records[rec.sandbox_id] = rec
            return
        log.warning("sandbox %s (%s) did not survive the restart; removing its record",
                    rec.sandbox_id, rec.state)
        await self.driver.destroy(handle)
        self.store.delete_sandbox(rec.sandbox_id)

    # ---------------------------------------------------------------- queries
    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def get(self, sandbox_id: str) -> SandboxRecord:
        rec = self._records.get(sandbox_id)
        if rec is None:
            raise not_found(f"sandbox {sandbox_id} not found")
        return rec

    def find_template(self, id_or_name: str) -> TemplateRecord:
        tpl = self.store.find_template(id_or_name)
        if tpl is None:
            raise not_found(f"template '{id_or_name}' not found")
        return tpl

    def list_sandboxes(self, query: ListQuery) -> tuple[list[SandboxRecord], str | None]:
        if query.limit < 1 or query.limit > 1000:
            raise invalid("limit must be between 1 and 1000")
        template_id = None
        if query.template:
            tpl = self.store.find_template(query.template)
            template_id = tpl.template_id if tpl else query.template
        items = [
            r for r in self._records.values()
            if (query.states is None or r.state.api_state in query.states)
            and all(r.metadata.get(k) == v for k, v in query.metadata.items())
            and (template_id is None or r.template_id == template_id)
            and (query.started_after is None or r.started_at > query.started_after)
        ]
        items.sort(key=lambda r: (r.started_at, r.sandbox_id), reverse=query.order_desc)
        if query.next_token:
            cursor = _decode_cursor(query.next_token)
            if query.order_desc:
                items = [r for r in items if (r.started_at.isoformat(), r.sandbox_id) < cursor]
            else:
                items = [r for r in items if (r.started_at.isoformat(), r.sandbox_id) > cursor]
        page = items[: query.limit]
        token = _encode_cursor(page[-1]) if len(items) > query.limit else None
        return page, token

    # ---------------------------------------------------------------- lifecycle
    def _check_timeout(self, timeout_s: int) -> None:
        if timeout_s <= 0:
            raise invalid(f"timeout must be a positive number of seconds, got {timeout_s}")
        if timeout_s > self.config.sandbox.max_timeout_s:
            raise invalid(f"timeout {timeout_s}s exceeds the maximum of "
                          f"{self.config.sandbox.max_timeout_s}s")

    async def create(self, req: CreateRequest) -> SandboxRecord:
        self._check_timeout(req.timeout_s)
        for name, bag in (("metadata", req.metadata), ("envVars", req.env_vars)):
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in bag.items()):
                raise invalid(f"{name} must map strings to strings")
        tpl = self.find_template(req.template)
        if len(self._records) + self._creating >= self.config.sandbox.max_sandboxes:
            raise AenvError(ErrorCode.RESOURCE_EXHAUSTED,
                            f"node is at its limit of {self.config.sandbox.max_sandboxes} sandboxes")
        now = utcnow()
        rec = SandboxRecord(
            sandbox_id=new_sandbox_id(), template_id=tpl.template_id, client_id=new_client_id(),
            state=SandboxState.CREATING, started_at=now,
            end_at=now + timedelta(seconds=req.timeout_s), cpu_count=tpl.cpu_count,
            memory_mb=tpl.memory_mb, disk_size_mb=tpl.disk_size_mb,
            envd_access_token=new_access_token(), metadata=dict(req.metadata),
            env_vars={**tpl.env_vars, **req.env_vars}, alias=tpl.names[0] if tpl.names else None,
            auto_pause=req.auto_pause, auto_resume=req.auto_resume,
            allow_internet_access=req.allow_internet_access, runtime=self.driver.name,
        )
        if tpl.allow_internet_access is not None:
            rec.allow_internet_access = tpl.allow_internet_access  # a copy keeps its network
        spec = self._spec(rec, tpl)
        self._creating += 1
        try:
            if tpl.image is not None:
                async with self._image(tpl.image) as images:
                    handle = await self._snapshot_driver().restore(spec, images, tpl.image_token)
            else:
                handle = await self.driver.create(spec)
        finally:
            self._creating -= 1
        rec.handle = handle.data
        rec.state = SandboxState.RUNNING
        # The TTL counts from when the sandbox is usable, not from when it was asked for.
        rec.end_at = utcnow() + timedelta(seconds=req.timeout_s)
        self._records[rec.sandbox_id] = rec
        self.store.put_sandbox(rec)
        return rec

    def _spec(self, rec: SandboxRecord, tpl: TemplateRecord) -> SandboxSpec:
        return SandboxSpec(
            sandbox_id=rec.sandbox_id,
            lower_layers=tuple(self.layout.layer(layer) for layer in tpl.layers),
            workspace=self.layout.workspace(rec.sandbox_id),
            cpu_count=rec.cpu_count, memory_mb=rec.memory_mb,
            pids_max=self.config.sandbox.pids_max, env_vars=rec.env_vars,
            envd_access_token=rec.envd_access_token, default_user=tpl.default_user,
            default_workdir=tpl.default_workdir,
            allow_internet_access=rec.allow_internet_access,
            envd_port=self.config.sandbox.envd_port,
        )

    def on_stop_serving(self, listener: Callable[[str], None]) -> None:
        """Call `listener(sandbox_id)` whenever a sandbox stops serving traffic (paused or
        killed), so that holders of connections into it (the proxy's pool) drop them."""
        self._stop_listeners.append(listener)

    def _stopped_serving(self, sandbox_id: str) -> None:
        for listener in self._stop_listeners:
            listener(sandbox_id)

    def _handle(self, rec: SandboxRecord) -> RuntimeHandle:
        return RuntimeHandle(rec.runtime, rec.sandbox_id, rec.handle)

    def _commit(self, rec: SandboxRecord) -> SandboxRecord:
        self._records[rec.sandbox_id] = rec
        self.store.put_sandbox(rec)
        return rec

    async def kill(self, sandbox_id: str) -> None:
        async with self._lock(sandbox_id):
            rec = self.get(sandbox_id)
            self._commit(replace(rec, state=SandboxState.KILLING))
            self._stopped_serving(sandbox_id)
            try:
                await self.driver.destroy(self._handle(rec))
            finally:
                self._records.pop(sandbox_id, None)
                self._locks.pop(sandbox_id, None)
                self.store.delete_sandbox(sandbox_id)

    async def set_timeout(self, sandbox_id: str, timeout_s: int) -> SandboxRecord:
        self._check_timeout(timeout_s)
        async with self._lock(sandbox_id):
            rec = self.get(sandbox_id)
            return self._commit(replace(rec, end_at=utcnow() + timedelta(seconds=timeout_s)))

    async def connect(self, sandbox_id: str, timeout_s: int) -> tuple[SandboxRecord, bool]:
        """E2B connect: extend a running sandbox's TTL (never shorten it); resume a paused one.
        Returns the record and whether it was resumed."""
        self._check_timeout(timeout_s)
        async with self._lock(sandbox_id):
            rec = self.get(sandbox_id)
            if rec.state is SandboxState.PAUSED:
                return await self._resume_locked(rec, timeout_s), True
            if rec.state is not SandboxState.RUNNING:
                raise AenvError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} is {rec.state.value}")
            end = max(rec.end_at, utcnow() + timedelta(seconds=timeout_s))
            return self._commit(replace(rec, end_at=end)), False

    async def pause(self, sandbox_id: str) -> None:
        async with self._lock(sandbox_id):
            rec = self.get(sandbox_id)
            if rec.state is SandboxState.PAUSED:
                raise AenvError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} is already paused")
            if rec.state is not SandboxState.RUNNING:
                raise AenvError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} is {rec.state.value}")
            if not isinstance(self.driver, PausableDriver):
                raise AenvError(ErrorCode.NOT_SUPPORTED,
                                f"pause is not supported by the {rec.runtime} runtime yet")
            self._commit(replace(rec, state=SandboxState.PAUSING))
            self._stopped_serving(sandbox_id)
            try:
                handle = await self.driver.pause(self._handle(rec))
            except BaseException:
                # A failed checkpoint leaves the sandbox running (CRIU resumes it).
                self._commit(rec)
                raise
            self._commit(replace(rec, state=SandboxState.PAUSED, handle=handle.data))

    async def _resume_locked(self, rec: SandboxRecord, timeout_s: int) -> SandboxRecord:
        if not isinstance(self.driver, PausableDriver):
            raise AenvError(ErrorCode.NOT_SUPPORTED,
                            f"resume is not supported by the {rec.runtime} runtime yet")
        spec = self._spec(rec, self.find_template(rec.template_id))
        self._commit(replace(rec, state=SandboxState.RESUMING))
        try:
            handle = await self.driver.resume(self._handle(rec), spec)
        except BaseException:
            self._commit(rec)  # still paused: its image is intact
            raise
        return self._commit(replace(rec, state=SandboxState.RUNNING, handle=handle.data,
                                    end_at=utcnow() + timedelta(seconds=timeout_s)))

    # ---------------------------------------------------------------- snapshots and forks
    def _snapshot_driver(self) -> SnapshotDriver:
        if not isinstance(self.driver, SnapshotDriver):
            raise AenvError(ErrorCode.NOT_SUPPORTED,
                            f"snapshots are not supported by the {self.driver.name} runtime")
        return self.driver

    @contextlib.asynccontextmanager
    async def _image(self, image: str) -> AsyncIterator[Path]:
        """A snapshot image on local disk for the duration of a restore: from the local cache
        (pulled from the repository when it is not there), pinned against eviction."""
        if self.snapshots is None or image.startswith("/"):
            yield Path(image)  # local-only image (forks)
            return
        async with self.snapshots.use(image) as path:
            yield path

    async def snapshot(self, sandbox_id: str, name: str | None = None) -> TemplateRecord:
        """Capture a running sandbox (paused only while it is frozen) as a template that new
        sandboxes start from, by id or name. The snapshot is in the repository (durable)
        before it is listed."""
        tpl = await self._capture(sandbox_id, name)
        if self.snapshots is not None:
            images = Path(tpl.image or "")
            try:
                pushed = await self.snapshots.repository.push(tpl.template_id, images)
                await self.snapshots.adopt(tpl.template_id, images)
                tpl.size_bytes, tpl.stored_bytes = pushed.bytes_total, pushed.bytes_uploaded
                log.info("snapshot %s of %s: %d bytes, %d new in the repository (%.2f s)",
                         tpl.template_id, sandbox_id, pushed.bytes_total, pushed.bytes_uploaded,
                         pushed.seconds)
            except BaseException:
                await asyncio.to_thread(shutil.rmtree, images, True)
                raise
            tpl.image = tpl.template_id
        self.store.put_template(tpl)
        return tpl

    async def _capture(self, sandbox_id: str, name: str | None) -> TemplateRecord:
        """Checkpoint a running sandbox into a local image; the record is not stored."""
        driver = self._snapshot_driver()
        if name is not None and self.store.find_template(name) is not None:
            raise AenvError(ErrorCode.CONFLICT, f"a template or snapshot named '{name}' exists")
        async with self._lock(sandbox_id):
            rec = self.get(sandbox_id)
            if rec.state is not SandboxState.RUNNING:
                raise AenvError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} is {rec.state.value}")
            source = self.find_template(rec.template_id)
            snapshot_id = "snap" + new_sandbox_id()[4:]
            images = self.layout.snapshot(snapshot_id)
            try:
                await driver.snapshot(self._handle(rec), images)
            except BaseException:
                await asyncio.to_thread(shutil.rmtree, images, True)
                raise
        tpl = TemplateRecord(
            template_id=snapshot_id, names=[name] if name else [], layers=source.layers,
            cpu_count=rec.cpu_count, memory_mb=rec.memory_mb, disk_size_mb=rec.disk_size_mb,
            default_user=source.default_user, default_workdir=source.default_workdir,
            env_vars=dict(rec.env_vars), created_at=utcnow(), image=str(images),
            image_token=rec.envd_access_token, source_sandbox=sandbox_id,
            allow_internet_access=rec.allow_internet_access)
        return tpl

    def list_snapshots(self, sandbox_id: str | None = None, name: str | None = None
                       ) -> list[TemplateRecord]:
        return [t for t in self.store.iter_templates() if t.image is not None
                and (sandbox_id is None or t.source_sandbox == sandbox_id)
                and (name is None or name in t.names)]

    async def delete_template(self, id_or_name: str) -> None:
        tpl = self.find_template(id_or_name)
        if tpl.image is None and tpl.template_id == "base":
            raise AenvError(ErrorCode.CONFLICT, "the base template cannot be deleted")
        self.store.delete_template(tpl.template_id)
        if tpl.image is None:
            return
        if tpl.image.startswith("/"):
            await asyncio.to_thread(shutil.rmtree, tpl.image, True)
        elif self.snapshots is not None:
            if tpl.image in self.snapshots and not self.snapshots.is_pinned(tpl.image):
                await self.snapshots.evict(tpl.image)
            await self.snapshots.repository.delete(tpl.image)

    async def fork(self, sandbox_id: str, count: int, timeout_s: int | None
                   ) -> list[SandboxRecord | AenvError]:
        """`count` independent children of a running sandbox, each with the parent's memory,
        processes, files, environment and limits. The parent is paused only while it is
        captured. One child failing does not affect the others or the parent."""
        if not 1 <= count <= MAX_FORK:
            raise invalid(f"count must be between 1 and {MAX_FORK}, got {count}")
        parent = self.get(sandbox_id)
        timeout = timeout_s if timeout_s is not None else max(
            1, int((parent.end_at - utcnow()).total_seconds()))
        self._check_timeout(timeout)
        # The fork's image is local and short-lived: no trip through the repository.
        tpl = await self._capture(sandbox_id, None)
        self.store.put_template(tpl)
        try:
            results = await asyncio.gather(*[
                self.create(CreateRequest(template=tpl.template_id, timeout_s=timeout,
                                          metadata=dict(parent.metadata),
                                          auto_pause=parent.auto_pause,
                                          auto_resume=parent.auto_resume))
                for _ in range(count)], return_exceptions=True)
        finally:
            await self.delete_template(tpl.template_id)
        out: list[SandboxRecord | AenvError] = []
        for result in results:
            if isinstance(result, SandboxRecord | AenvError):
                out.append(result)
            elif isinstance(result, Exception):
                log.error("fork child of %s failed: %r", sandbox_id, result)
                out.append(AenvError(ErrorCode.INTERNAL, f"fork failed: {type(result).__name__}"))
            else:
                raise result
        for child in out:  # children are records of their own, not of the fork's image
            if isinstance(child, SandboxRecord):
                child.template_id = parent.template_id
                child.alias = parent.alias
                self._commit(child)
        return out

    async def metrics(self, sandbox_id: str) -> tuple[datetime, ResourceUsage]:
        rec = self.get(sandbox_id)
        if rec.state is not SandboxState.RUNNING:
            raise AenvError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} is not running")
        return utcnow(), await self.driver.stats(self._handle(rec))

    async def open_port(self, sandbox_id: str, port: int) -> socket.socket:
        """A connection to `port` inside a running sandbox (the proxy's way in)."""
        rec = self.get(sandbox_id)
        if rec.state is SandboxState.PAUSED and rec.auto_resume:
            async with self._lock(sandbox_id):
                rec = self.get(sandbox_id)
                if rec.state is SandboxState.PAUSED:
                    rec = await self._resume_locked(rec, self.config.sandbox.timeout_s)
        if rec.state is not SandboxState.RUNNING:
            raise AenvError(ErrorCode.UNAVAILABLE, f"sandbox {sandbox_id} is {rec.state.api_state}")
        return await self.driver.connect(self._handle(rec), port)

    def running_ids(self) -> list[str]:
        return [r.sandbox_id for r in self._records.values() if r.state is SandboxState.RUNNING]

    # ---------------------------------------------------------------- TTL
    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            now = utcnow()
            expired = [r.sandbox_id for r in self._records.values()
                       if r.state is SandboxState.RUNNING and r.end_at <= now]
            for sandbox_id in expired:
                try:
                    await self._expire(sandbox_id)
                except Exception:  # one bad sandbox must not stop the sweeper
                    log.exception("expiring sandbox %s failed", sandbox_id)

    async def _expire(self, sandbox_id: str) -> None:
        rec = self._records.get(sandbox_id)
        if rec is None or rec.end_at > utcnow():
            return
        if rec.auto_pause:
            try:
                await self.pause(sandbox_id)
                log.info("sandbox %s expired and was paused", sandbox_id)
                return
            except AenvError as exc:
                if exc.code is not ErrorCode.NOT_SUPPORTED:
                    # Keep it running (nothing is lost) and try again later rather than on
                    # every sweep: a failed checkpoint costs the host a CRIU run each time.
                    async with self._lock(sandbox_id):
                        current = self._records.get(sandbox_id)
                        if current is not None and current.state is SandboxState.RUNNING:
                            self._commit(replace(current, end_at=utcnow() + timedelta(
                                seconds=PAUSE_RETRY_S)))
                    log.error("sandbox %s expired but could not be paused (retrying in %d s): %s",
                              sandbox_id, PAUSE_RETRY_S, exc.message)
                    return
                log.warning("sandbox %s expired; its runtime cannot pause, so it is killed",
                            sandbox_id)
        await self.kill(sandbox_id)
        log.info("sandbox %s expired and was killed", sandbox_id)


def _encode_cursor(rec: SandboxRecord) -> str:
    raw = json.dumps([rec.started_at.isoformat(), rec.sandbox_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(token: str) -> tuple[str, str]:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        started, sandbox_id = json.loads(raw)
        return str(started), str(sandbox_id)
    except (ValueError, TypeError):
        raise invalid("nextToken is not a token this server issued") from None
