"""`SandboxManager`: every lifecycle operation, serialised per sandbox, recorded durably.

The manager is the only writer of sandbox records. Each operation takes the sandbox's lock,
checks the state machine (`SandboxState`), calls the runtime driver, then commits the new
record. A background sweeper enforces TTLs. A monitor finds running sandboxes that died
(their process gone, `LivenessDriver`, checked every second; or envd not answering /health
for a while, every runtime) and removes them with the reason: a dead sandbox is never listed
as running, and asking for it answers 404 with why it is gone (E2B's shape: a sandbox that
died is not found), kept for the last `DEAD_REASONS_KEPT` of them.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import functools
import json
import logging
import shutil
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from aenv.config import Config
from aenv.errors import AenvError, ErrorCode, invalid, not_found
from aenv.faults import crash_point
from aenv.orchestrator import attachments
from aenv.orchestrator.events import (
    ENVD_LOG,
    LogEntry,
    LogQuery,
    SandboxEvents,
    parse_envd_log,
    read_tail,
)
from aenv.orchestrator.ids import new_access_token, new_client_id, new_sandbox_id
from aenv.orchestrator.models import (
    CreateRequest,
    ListQuery,
    SandboxRecord,
    SandboxState,
    TemplateRecord,
)
from aenv.orchestrator.paused import PausedStateKeeper
from aenv.orchestrator.pushes import PendingPush, SnapshotPusher
from aenv.orchestrator.recovery import Recovery, RecoveryReport
from aenv.orchestrator.store import Store
from aenv.runtime.base import (
    EgressDriver,
    FilesystemPauseDriver,
    LayerSealingDriver,
    LivenessDriver,
    PausableDriver,
    PausedStateDriver,
    ReadyShape,
    RecoverableDriver,
    ResourceUsage,
    RuntimeDriver,
    RuntimeHandle,
    SandboxSpec,
    SnapshotDriver,
)
from aenv.runtime.egress import EgressPolicy
from aenv.storage.layout import Layout
from aenv.storage.repository import LocalCache

log = logging.getLogger("aenv.orchestrator")

SWEEP_INTERVAL_S = 0.5
PAUSE_RETRY_S = 30  # a sandbox whose pause failed at expiry is tried again this much later
MAX_FORK = 100  # children per fork call (the API limit; 16 is the case we optimise)
SEAL_PREFIX = "seal-"  # layer ids of sealed writable layers (snapshots), owned by the manager
RUNTIME_METADATA_KEY = "aenv.runtime"  # metadata naming a sandbox's runtime (SDK clients)
DEAD_REASONS_KEPT = 1000  # why recently dead sandboxes are gone, for the 404s about them
ENVD_CHECKS_AT_ONCE = 8  # envd health checks in flight (each one a connection into a sandbox)
ENVD_CHECK_TIMEOUT_S = 5.0
# What no record owns (a sandbox a crashed create left, a stale checkpoint image, a network
# slot nobody uses) is looked for this often; and always at start.
SWEEP_ORPHANS_INTERVAL_S = 30.0
GC_FIRST_AFTER_S = 60.0  # the repository's first gc after a start


def utcnow() -> datetime:
    return datetime.now(UTC)


class ImageLayers(Protocol):
    """The node's cache of image layers (`aenv.images.pull.ImagePuller`): layers it may
    have evicted are fetched again before a sandbox starts on them."""

    async def ensure_layers(self, layers: list[str]) -> None: ...

    async def collect_layers(self) -> None: ...


class SandboxManager:
    def __init__(self, config: Config, layout: Layout, store: Store, driver: RuntimeDriver,
                 ensure_templates: Callable[[], Awaitable[None]] | None = None,
                 snapshots: LocalCache | None = None,
                 load_driver: Callable[[str], RuntimeDriver] | None = None,
                 images: ImageLayers | None = None,
                 events: SandboxEvents | None = None) -> None:
        self.config = config
        # Every sandbox's log of lifecycle events (GET /sandboxes/{id}/logs); in memory only
        # when the caller keeps none.
        self.events = events if events is not None else SandboxEvents(":memory:")
        self.images = images  # None: layers are never evicted, nothing to fetch again
        self.layout = layout
        self.store = store
        self.driver = driver  # the default runtime; others start on first use (load_driver)
        self._drivers: dict[str, RuntimeDriver] = {driver.name: driver}
        self._load_driver = load_driver
        self._drivers_lock = asyncio.Lock()
        self._ensure_templates = ensure_templates
        # Built-in templates made on first use (`code-interpreter-v1`): called with the name a
        # create asks for, before it is looked up; returns at once for names it does not own.
        self.template_provider: Callable[[str], Awaitable[None]] | None = None
        # Called after a sandbox booted afresh on its files (a resume without memory): runs
        # its template's start command again (aenv.builds). Its failure is logged, not raised.
        self.on_cold_boot: Callable[[SandboxRecord], Awaitable[None]] | None = None
        self._records: dict[str, SandboxRecord] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._repository_gc: asyncio.Task[None] | None = None
        self._creating = 0
        self._stop_listeners: list[Callable[[str], None]] = []
        # Snapshots live in the durable repository; `snapshots` is the bounded local cache in
        # front of it (None: snapshots stay local only, in layout.snapshots_dir).
        self.snapshots = snapshots
        self._pusher = (SnapshotPusher(snapshots, self._snapshot_pushed,
                                       config.snapshot.push_retry_s)
                        if snapshots is not None else None)
        # Paused sandboxes' state goes to the same repository (in the background).
        self._paused = (PausedStateKeeper(snapshots.repository,
                                          config.snapshot.paused_cache_mb << 20)
                        if snapshots is not None else None)
        # Sealed layers being made or used by a create that is not recorded yet: the layer
        # collector must not take them (layer id -> number of users).
        self._layers_in_flight: dict[str, int] = {}
        self._layer_locks: dict[str, asyncio.Lock] = {}
        # Sandboxes found dead (and removed) -> why, the oldest dropped first.
        self._dead: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._envd_unanswered_since: dict[str, float] = {}  # sandbox -> monotonic time
        self._monitors: list[asyncio.Task[None]] = []
        # Runtime name -> its driver if it is a LivenessDriver: asked every second per
        # sandbox, and a Protocol isinstance() costs ~10 us.
        self._liveness_drivers: dict[str, LivenessDriver | None] = {}
        self._recovery = Recovery(store, layout, self.runtime)
        self.last_recovery: RecoveryReport | None = None  # what the start-up recovery did
        # Sandbox ids of creates in flight (their record says creating): not orphans.
        self._creating_ids: set[str] = set()
        # E2B volumes (`orchestrator/volumes.py`), set by the server; None: not offered.
        self.volumes: attachments.Volumes | None = None

    # ---------------------------------------------------------------- start / stop
    async def start(self) -> None:
        self.layout.ensure()
        if self._ensure_templates is not None:
            await self._ensure_templates()
        await self.driver.start()
        self._configure_ready_pool()
        sealing = [d for d in self._drivers.values() if isinstance(d, LayerSealingDriver)]
        report = await self._recovery.settle_records(
            sealing[0].remove_layer if sealing else shutil.rmtree)
        for rec in list(self.store.iter_sandboxes()):
            await self._reattach(rec)
        report.orphans = await self._sweep_orphans(at_start=True)
        log.info("recovery at start: %s", report.summary())
        self.last_recovery = report
        await self._collect_layers()
        self._resume_pushes()
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="aenv-ttl-sweeper")
        self._monitors.append(asyncio.create_task(self._sweep_orphans_forever(),
                                                  name="aenv-orphan-sweeper"))
        if self.config.sandbox.liveness_interval_ms > 0:
            self._monitors.append(asyncio.create_task(self._liveness_forever(),
                                                      name="aenv-liveness"))
        if self.config.sandbox.envd_check_interval_s > 0:
            self._monitors.append(asyncio.create_task(self._envd_checks_forever(),
                                                      name="aenv-envd-health"))
        if self.snapshots is not None and self.config.snapshot.gc_interval_s > 0:
            self._repository_gc = asyncio.create_task(self._gc_forever(), name="aenv-repo-gc")

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
        if self._pusher is not None:
            await self._pusher.close()
        for task in (self._sweeper, self._repository_gc, *self._monitors):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._paused is not None:
            await self._paused.close()
        for driver in self._drivers.values():
            await driver.close()

    async def runtime(self, name: str | None) -> RuntimeDriver:
        """The runtime driver called `name` (None: the default), started on first use."""
        if name is None:
            return self.driver
        driver = self._drivers.get(name)
        if driver is not None:
            return driver
        if self._load_driver is None:
            raise invalid(f"runtime {name!r} is not available on this server")
        async with self._drivers_lock:
            driver = self._drivers.get(name)
            if driver is None:
                driver = self._load_driver(name)  # unknown names: invalid_argument
                await driver.start()
                self._drivers[name] = driver
                log.info("runtime %s started", name)
        return driver

    def _driver(self, rec: SandboxRecord) -> RuntimeDriver:
        driver = self._drivers.get(rec.runtime)
        if driver is None:
            raise AenvError(ErrorCode.UNAVAILABLE,
                            f"sandbox {rec.sandbox_id}: its runtime {rec.runtime!r} is not "
                            "running on this server")
        return driver

    async def _reattach(self, rec: SandboxRecord) -> None:
        try:
            driver = await self.runtime(rec.runtime)
        except AenvError as exc:
            # Kept as it is (nothing is deleted): operations on it say what is missing.
            log.error("sandbox %s: runtime %s unavailable: %s", rec.sandbox_id, rec.runtime,
                      exc.message)
            self._records[rec.sandbox_id] = rec
            return
        if rec.state is SandboxState.PAUSED:
            self._records[rec.sandbox_id] = rec
            self._persist_paused(rec, driver)  # an upload the last run did not finish
            return
        handle = RuntimeHandle(rec.runtime, rec.sandbox_id, rec.handle)
        alive = rec.state is SandboxState.RUNNING and await driver.attach(handle)
        if alive:
            self._records[rec.sandbox_id] = rec
            return
        log.warning("sandbox %s (%s) did not survive the restart; removing its record",
                    rec.sandbox_id, rec.state)
        await driver.destroy(handle)
        self.store.delete_sandbox(rec.sandbox_id)

    # ---------------------------------------------------------------- queries
    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def get(self, sandbox_id: str) -> SandboxRecord:
        rec = self._records.get(sandbox_id)
        if rec is None:
            reason = self._dead.get(sandbox_id)
            if reason is not None:
                raise _gone(sandbox_id, reason)
            raise not_found(f"sandbox {sandbox_id} not found")
        return rec

    def find_template(self, id_or_name: str) -> TemplateRecord:
        tpl = self.store.find_template(id_or_name)
        if tpl is None and ":" in id_or_name:  # name:tag (E2B's tags; `default` always)
            name, _, tag = id_or_name.rpartition(":")
            tagged = self.store.find_template(name)
            if tagged is not None and (tag == "default" or tag in tagged.tags):
                tpl = tagged
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
        if req.cpu_count is not None and req.cpu_count < 1 or \
                req.memory_mb is not None and req.memory_mb < 64:
            raise invalid("cpuCount must be >= 1 and memoryMB >= 64")
        for name, bag in (("metadata", req.metadata), ("envVars", req.env_vars)):
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in bag.items()):
                raise invalid(f"{name} must map strings to strings")
        if self.template_provider is not None:
            await self.template_provider(req.template)
        tpl = self.find_template(req.template)
        if tpl.runtime is not None and req.runtime not in (None, tpl.runtime):
            raise invalid(f"snapshot {tpl.template_id} was taken by the {tpl.runtime} runtime; "
                          f"it cannot start on {req.runtime}")
        driver = await self.runtime(tpl.runtime or req.runtime)
        if len(self._records) + self._creating >= self.config.sandbox.max_sandboxes:
            raise AenvError(ErrorCode.RESOURCE_EXHAUSTED,
                            f"node is at its limit of {self.config.sandbox.max_sandboxes} sandboxes")
        now = utcnow()
        t_start = time.monotonic()
        rec = SandboxRecord(
            sandbox_id=new_sandbox_id(), template_id=tpl.template_id, client_id=new_client_id(),
            state=SandboxState.CREATING, started_at=now,
            end_at=now + timedelta(seconds=req.timeout_s), cpu_count=req.cpu_count or tpl.cpu_count,
            memory_mb=req.memory_mb or tpl.memory_mb, disk_size_mb=tpl.disk_size_mb,
            envd_access_token=new_access_token(), metadata=dict(req.metadata),
            env_vars={**tpl.env_vars, **req.env_vars}, alias=tpl.names[0] if tpl.names else None,
            auto_pause=req.auto_pause, auto_resume=req.auto_resume,
            auto_pause_memory=req.auto_pause_memory,
            allow_internet_access=req.allow_internet_access, runtime=driver.name,
            layers=list(tpl.layers),
        )
        if tpl.allow_internet_access is not None:
            rec.allow_internet_access = tpl.allow_internet_access  # a copy keeps its network
        self._attach(rec, req, tpl, driver)
        spec = self._spec(rec, tpl)
        # The intent, before anything is made: a crash from here on is rolled back at start.
        rec.handle = {"workspace": str(spec.workspace)}
        self.store.put_sandbox(rec)
        crash_point("create:intent")
        self._creating += 1
        self._creating_ids.add(rec.sandbox_id)
        try:
            with self._layers_held(tpl.layers):
                if self.images is not None:
                    await self.images.ensure_layers(list(tpl.layers))
                if tpl.image is not None:
                    await self._ensure_sealed_layers(tpl.layers)
                    async with self._image(tpl.image) as images:
                        handle = await _snapshot_driver(driver).restore(spec, images,
                                                                         tpl.image_token)
                else:
                    handle = await driver.create(spec)
        except BaseException as exc:
            self.store.delete_sandbox(rec.sandbox_id)  # the driver cleaned up after itself
            self.events.record(rec.sandbox_id, "create_failed",
                               f"create from template {tpl.template_id} failed: "
                               f"{getattr(exc, 'message', type(exc).__name__)}", "error",
                               op="restore" if tpl.image is not None else "create",
                               error=getattr(getattr(exc, "code", None), "value", "internal"))
            raise
        finally:
            self._creating -= 1
            self._creating_ids.discard(rec.sandbox_id)
        crash_point("create:made")
        rec.handle = handle.data
        rec.state = SandboxState.RUNNING
        # The TTL counts from when the sandbox is usable, not from when it was asked for.
        rec.end_at = utcnow() + timedelta(seconds=req.timeout_s)
        self._records[rec.sandbox_id] = rec
        self.store.put_sandbox(rec)
        op = "restore" if tpl.image is not None else "create"
        self.events.record(rec.sandbox_id, "created",
                           f"sandbox created from {'snapshot' if tpl.image else 'template'} "
                           f"{tpl.template_id} on the {rec.runtime} runtime", op=op,
                           seconds=f"{time.monotonic() - t_start:.6f}",
                           templateID=tpl.template_id)
        return rec

    def _spec(self, rec: SandboxRecord, tpl: TemplateRecord) -> SandboxSpec:
        return SandboxSpec(
            sandbox_id=rec.sandbox_id,
            lower_layers=tuple(self.layout.layer(layer) for layer in rec.layers or tpl.layers),
            workspace=self.layout.workspace(rec.sandbox_id),
            cpu_count=rec.cpu_count, memory_mb=rec.memory_mb,
            pids_max=self.config.sandbox.pids_max, env_vars=rec.env_vars,
            envd_access_token=rec.envd_access_token, default_user=tpl.default_user,
            default_workdir=tpl.default_workdir,
            allow_internet_access=rec.allow_internet_access,
            envd_port=self.config.sandbox.envd_port, disk_size_mb=rec.disk_size_mb,
            egress=attachments.egress_of(rec.network) if rec.allow_internet_access else None,
            volumes=attachments.volume_specs(self.volumes, rec.volume_mounts),
        )

    def _attach(self, rec: SandboxRecord, req: CreateRequest, tpl: TemplateRecord,
                driver: RuntimeDriver) -> None:
        """A create's network config, traffic token and volume mounts, into `rec`. A copy of
        a snapshot keeps the snapshot's unless the create names its own; its image needs the
        snapshot's volumes, so those must stay mounted (more may be added)."""
        if req.network is not None or tpl.network is None:
            network, interface = attachments.create_network(req.network,
                                                            req.allow_internet_access)
            if tpl.allow_internet_access is None:
                rec.allow_internet_access = interface
            elif rec.allow_internet_access and not interface:
                # The snapshot's image has a network interface: deny-all on it instead.
                network = attachments.deny_all(network)
        else:
            network = dict(tpl.network)
            if not req.allow_internet_access and rec.allow_internet_access:
                network = attachments.deny_all(network)  # its allowOut still wins, as in E2B
        rec.network = network
        if network.get("allowPublicTraffic") is False:
            rec.traffic_access_token = new_access_token()
        mounts = attachments.resolve_mounts(self.volumes, req.volume_mounts)
        missing = [m for m in tpl.volume_mounts if m not in mounts]
        if missing and req.volume_mounts:
            raise invalid(f"snapshot {tpl.template_id} was taken with volume "
                          f"{missing[0]['name']} at {missing[0]['path']}: its copies mount it "
                          "there too")
        rec.volume_mounts = [*missing, *mounts]
        if (rec.allow_internet_access and attachments.egress_of(network) is not None
                and not isinstance(driver, EgressDriver)):
            raise AenvError(ErrorCode.NOT_SUPPORTED,
                            f"egress rules are not supported by the {driver.name} runtime")
        if rec.volume_mounts and not getattr(driver, "supports_volumes", False):
            raise AenvError(ErrorCode.NOT_SUPPORTED,
                            f"volumes are not supported by the {driver.name} runtime")

    async def update_network(self, sandbox_id: str, update: dict[str, Any]) -> SandboxRecord:
        """`PUT /sandboxes/{id}/network`: new egress rules, live on a running sandbox (one
        atomic change), on record for a paused one (its resume applies them)."""
        async with self._lock(sandbox_id):
            rec = self.get(sandbox_id)
            if not rec.allow_internet_access:
                raise AenvError(ErrorCode.CONFLICT,
                                f"sandbox {sandbox_id} was created without internet access "
                                "(it has no network interface): its egress cannot change")
            network = attachments.updated_network(rec.network, update)
            if rec.state is SandboxState.PAUSED:
                return self._commit(replace(rec, network=network))
            _require_state(rec, SandboxState.RUNNING)
            driver = self._driver(rec)
            if not isinstance(driver, EgressDriver):
                raise AenvError(ErrorCode.NOT_SUPPORTED,
                                f"egress rules are not supported by the {rec.runtime} runtime")
            policy = attachments.egress_of(network) or EgressPolicy()
            handle = await driver.set_egress(self._handle(rec), policy)
            return self._commit(replace(rec, network=network, handle=handle.data))

    def volume_users(self, volume_id: str) -> list[str]:
        """Sandboxes (any state) and snapshots that mount volume `volume_id`."""
        users = [r.sandbox_id for r in self.store.iter_sandboxes()
                 if any(m.get("volumeID") == volume_id for m in r.volume_mounts)]
        users += [f"snapshot {t.template_id}" for t in self.store.iter_templates()
                  if any(m.get("volumeID") == volume_id for m in t.volume_mounts)]
        return users

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

    def _keeps_paused_state(self, driver: RuntimeDriver
                            ) -> tuple[PausedStateKeeper, PausedStateDriver] | None:
        """The keeper and the driver, when this driver's paused state goes to the repository."""
        if self._paused is not None and isinstance(driver, PausedStateDriver):
            return self._paused, driver
        return None

    def _persist_paused(self, rec: SandboxRecord, driver: RuntimeDriver) -> None:
        if (keeping := self._keeps_paused_state(driver)) is not None:
            keeping[0].persist_later(keeping[1], self._handle(rec))

    def _forget_paused(self, rec: SandboxRecord, driver: RuntimeDriver) -> None:
        if (keeping := self._keeps_paused_state(driver)) is not None:
            keeping[0].forget_later(keeping[1], self._handle(rec))

    async def kill(self, sandbox_id: str, reason: str = "killed by request") -> None:
        async with self._lock(sandbox_id):
            rec = self.get(sandbox_id)
            self._commit(replace(rec, state=SandboxState.KILLING))
            self._stopped_serving(sandbox_id)
            if rec.state is SandboxState.PAUSED:
                self._forget_paused(rec, self._driver(rec))
            await self._keep_envd_log(rec)
            self.events.record(sandbox_id, "killed", f"sandbox killed ({reason})",
                               reason=reason, state=rec.state.value)
            try:
                await self._driver(rec).destroy(self._handle(rec))
            finally:
                self._records.pop(sandbox_id, None)
                self._locks.pop(sandbox_id, None)
                self.store.delete_sandbox(sandbox_id)
        await self._collect_layers()

    async def set_timeout(self, sandbox_id: str, timeout_s: int) -> SandboxRecord:
        self._check_timeout(timeout_s)
        async with self._lock(sandbox_id):
            rec = self.get(sandbox_id)
            return self._commit(replace(rec, end_at=utcnow() + timedelta(seconds=timeout_s)))

    async def connect(self, sandbox_id: str, timeout_s: int, memory: bool = True
                      ) -> tuple[SandboxRecord, bool]:
        """E2B connect: extend a running sandbox's TTL (never shorten it); resume a paused one
        (`memory=False`: boot it afresh on its files). Returns the record and whether it was
        resumed."""
        self._check_timeout(timeout_s)
        async with self._lock(sandbox_id):
            rec = self.get(sandbox_id)
            if rec.state is SandboxState.PAUSED:
                return await self._resume_locked(rec, timeout_s, memory), True
            _require_state(rec, SandboxState.RUNNING)
            await self._require_alive_locked(rec)
            end = max(rec.end_at, utcnow() + timedelta(seconds=timeout_s))
            return self._commit(replace(rec, end_at=end)), False

    async def adopt_paused(self, rec: SandboxRecord) -> SandboxRecord:
        """Take over a sandbox another node paused (aenv.cluster: that node is dead or
        draining). Its paused state is in the shared repository; the next connect resumes it
        here, pulling that state back. `rec.handle` must name this node's paths. CONFLICT if
        this node knows the id already; NOT_SUPPORTED if its runtime keeps no paused state
        in the repository."""
        if rec.state is not SandboxState.PAUSED:
            raise AenvError(ErrorCode.CONFLICT, f"sandbox {rec.sandbox_id} is not paused")
        async with self._lock(rec.sandbox_id):
            if rec.sandbox_id in self._records:
                raise AenvError(ErrorCode.CONFLICT,
                                f"sandbox {rec.sandbox_id} is already on this node")
            if self._keeps_paused_state(await self.runtime(rec.runtime)) is None:
                raise AenvError(ErrorCode.NOT_SUPPORTED,
                                f"the {rec.runtime} runtime cannot resume another node's sandbox")
            self.find_template(rec.template_id)
            self._dead.pop(rec.sandbox_id, None)
            return self._commit(rec)

    async def drop_moved(self, sandbox_id: str) -> None:
        """Forget this node's copy of a paused sandbox that another node adopted meanwhile
        (aenv.cluster): its local files go, its paused state in the repository stays (the
        adopting node resumes from it)."""
        async with self._lock(sandbox_id):
            rec = self.get(sandbox_id)
            _require_state(rec, SandboxState.PAUSED)
            try:
                await self._driver(rec).destroy(self._handle(rec))
            finally:
                self._records.pop(sandbox_id, None)
                self._locks.pop(sandbox_id, None)
                self.store.delete_sandbox(sandbox_id)

    async def pause(self, sandbox_id: str, memory: bool = True, reason: str = "by request"
                    ) -> None:
        """Pause a running sandbox: its processes and memory to disk (`memory`), or only its
        writable layer (`memory=False`: the resume boots it afresh on those files)."""
        async with self._lock(sandbox_id):
            rec = self.get(sandbox_id)
            if rec.state is SandboxState.PAUSED:
                raise AenvError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} is already paused")
            _require_state(rec, SandboxState.RUNNING)
            driver = self._driver(rec)
            if not isinstance(driver, PausableDriver):
                raise AenvError(ErrorCode.NOT_SUPPORTED,
                                f"pause is not supported by the {rec.runtime} runtime yet")
            if not memory and not isinstance(driver, FilesystemPauseDriver):
                raise AenvError(ErrorCode.NOT_SUPPORTED, "a filesystem-only pause is not "
                                f"supported by the {rec.runtime} runtime")
            await self._require_alive_locked(rec)
            t0 = time.monotonic()
            # The intent names the mode: a filesystem pause cut short after the kill is
            # rolled forward (its files are all there is to keep), not lost.
            self._commit(replace(rec, state=SandboxState.PAUSING, handle=(
                rec.handle if memory else {**rec.handle, "pausing": "filesystem"})))
            crash_point("pause:intent")
            self._stopped_serving(sandbox_id)
            t1 = time.monotonic()
            try:
                if memory:
                    handle = await driver.pause(self._handle(rec))
                else:
                    assert isinstance(driver, FilesystemPauseDriver)
                    handle = await driver.pause_filesystem(self._handle(rec))
            except AenvError as exc:
                # A failed checkpoint leaves the sandbox running (CRIU resumes it), unless
                # it failed because the sandbox had died.
                self.events.record(sandbox_id, "pause_failed", f"pause failed: {exc.message}",
                                   "error", op="pause", error=exc.code.value)
                self._commit(rec)
                await self._require_alive_locked(rec)
                await self._rescue_after_failed_checkpoint(rec, driver)
                raise
            except BaseException:
                self._commit(rec)
                raise
            t2 = time.monotonic()
            crash_point("pause:dumped")
            paused = self._commit(replace(rec, state=SandboxState.PAUSED, handle=handle.data))
            log.info("sandbox %s paused in %.1f ms (runtime %.1f ms)", sandbox_id,
                     (time.monotonic() - t0) * 1e3, (t2 - t1) * 1e3)
            mode = "full" if memory else "filesystem"
            self.events.record(sandbox_id, "paused", f"sandbox paused ({mode}, {reason})",
                               op="pause", mode=mode, reason=reason,
                               seconds=f"{time.monotonic() - t0:.6f}")
            self._persist_paused(paused, driver)

    async def _rescue_after_failed_checkpoint(self, rec: SandboxRecord,
                                              driver: RuntimeDriver) -> None:
        """After a failed pause or snapshot (lock held, `rec` running): a criu killed while
        its parasite code was inside the sandbox's processes can leave them hung, alive but
        never answering. Such a sandbox is not left listed as running: envd is asked at
        once, and if it does not answer, its processes go and it is paused keeping its
        files (a filesystem pause; the resume boots it afresh), the reason in its log."""
        why = "no answer"
        try:
            if await self._check_envd(rec, asyncio.Semaphore(1)):
                return
        except (AenvError, OSError, TimeoutError) as exc:
            why = str(exc.message if isinstance(exc, AenvError) else exc) or type(exc).__name__
        if not isinstance(driver, FilesystemPauseDriver):
            return  # the health checks report it dead if it stays silent
        log.error("sandbox %s stopped answering after a failed checkpoint (%s): pausing it "
                  "with its files only", rec.sandbox_id, why)
        handle = await driver.pause_filesystem(self._handle(rec))
        self._commit(replace(rec, state=SandboxState.PAUSED, handle=handle.data))
        self.events.record(rec.sandbox_id, "paused",
                           "sandbox paused (filesystem): its processes stopped answering "
                           "after a failed checkpoint", "error", op="pause", mode="filesystem")

    async def _resume_locked(self, rec: SandboxRecord, timeout_s: int, memory: bool = True
                             ) -> SandboxRecord:
        """Resume a paused sandbox: restore its memory, or (`memory=False`, or paused without
        memory) boot it afresh on its writable layer: the start command runs again."""
        driver = self._driver(rec)
        if not isinstance(driver, PausableDriver):
            raise AenvError(ErrorCode.NOT_SUPPORTED,
                            f"resume is not supported by the {rec.runtime} runtime yet")
        cold = not memory or pause_mode(rec) == "filesystem"
        if cold and not isinstance(driver, FilesystemPauseDriver):
            raise AenvError(ErrorCode.NOT_SUPPORTED, "a resume without memory is not "
                            f"supported by the {rec.runtime} runtime")
        t0 = time.monotonic()
        tpl = self.find_template(rec.template_id)
        spec = self._spec(rec, tpl)
        layers = list(rec.layers or tpl.layers)
        self._commit(replace(rec, state=SandboxState.RESUMING))
        crash_point("resume:intent")
        t1 = time.monotonic()
        try:
            with self._layers_held(layers):
                # What a node that lost its local files needs back: the template's layers
                # (image layers, sealed layers) and the paused state itself.
                if self.images is not None:
                    await self.images.ensure_layers(layers)
                await self._ensure_sealed_layers(layers)
                if (keeping := self._keeps_paused_state(driver)) is not None:
                    await keeping[0].ensure_local(keeping[1], self._handle(rec))
                if cold:
                    assert isinstance(driver, FilesystemPauseDriver)
                    handle = await driver.boot_paused(self._handle(rec), spec)
                else:
                    handle = await driver.resume(self._handle(rec), spec)
        except BaseException as exc:
            self.events.record(rec.sandbox_id, "resume_failed",
                               f"resume failed: {getattr(exc, 'message', type(exc).__name__)}",
                               "error", op="resume")
            self._commit(rec)  # still paused: its image is intact
            self._persist_paused(rec, driver)  # if its upload was cancelled for this resume
            raise
        crash_point("resume:restored")
        self._forget_paused(rec, driver)
        t2 = time.monotonic()
        paused = self._handle(rec)
        rec = self._commit(replace(rec, state=SandboxState.RUNNING, handle=handle.data,
                                   end_at=utcnow() + timedelta(seconds=timeout_s)))
        if isinstance(driver, RecoverableDriver):
            driver.release_paused(paused)  # the resume is on record: its image can go
        log.info("sandbox %s resumed in %.1f ms (runtime %.1f ms)", rec.sandbox_id,
                 (time.monotonic() - t0) * 1e3, (t2 - t1) * 1e3)
        if cold and self.on_cold_boot is not None:
            try:
                await self.on_cold_boot(rec)
            except (AenvError, OSError) as exc:
                self.events.record(rec.sandbox_id, "start_failed", "the template's start "
                                   f"command failed after the boot: {exc}", "warn")
        how = "booted afresh on its files" if cold else "memory restored"
        self.events.record(rec.sandbox_id, "resumed", f"sandbox resumed ({how})", op="resume",
                           mode="filesystem" if cold else "full",
                           seconds=f"{time.monotonic() - t0:.6f}")
        return rec

    # ---------------------------------------------------------------- snapshots and forks

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
        sandboxes start from, by id or name. Listed as soon as it is captured: its image goes
        into the local cache (pinned) and, with every sealed layer it stacks on, to the
        repository in the background (`orchestrator/pushes.py`; `in_repository` says when)."""
        t0 = time.monotonic()
        tpl = await self._capture(sandbox_id, name)
        self.events.record(sandbox_id, "snapshot", f"snapshot {tpl.template_id} taken",
                           op="snapshot", snapshotID=tpl.template_id,
                           seconds=f"{time.monotonic() - t0:.6f}")
        with self._layers_held(tpl.layers):
            if self.snapshots is not None:
                images = Path(tpl.image or "")
                self.snapshots.pin(tpl.template_id)  # no eviction between adopt and the push
                try:
                    await self.snapshots.adopt(tpl.template_id, images)
                except BaseException:
                    await asyncio.to_thread(shutil.rmtree, images, True)
                    raise
                finally:
                    self.snapshots.unpin(tpl.template_id)
                tpl.image, tpl.in_repository = tpl.template_id, False
            self.store.put_template(tpl)
            crash_point("snapshot:recorded")
            if not tpl.in_repository:
                self._push_in_background(tpl)
        return tpl

    def _push_in_background(self, tpl: TemplateRecord) -> None:
        """Hand a snapshot not yet in the repository to the pusher (it pins the image)."""
        assert self._pusher is not None and tpl.image is not None
        layers = tuple((_layer_key(layer), self.layout.layer(layer)) for layer in tpl.layers
                       if layer.startswith(SEAL_PREFIX))
        self._pusher.start(PendingPush(tpl.image, layers))

    async def _snapshot_pushed(self, snapshot_id: str, size: int, stored: int) -> None:
        tpl = self.store.find_template(snapshot_id)
        if tpl is not None:
            self.store.put_template(replace(tpl, size_bytes=size, stored_bytes=stored,
                                            in_repository=True))

    def _resume_pushes(self) -> None:
        """Pushes a restart cut short start again (the image is still in the local cache)."""
        if self._pusher is None or self.snapshots is None:
            return
        for tpl in self.store.iter_templates():
            if tpl.in_repository or tpl.image is None:
                continue
            if tpl.image in self.snapshots:
                self._push_in_background(tpl)
            else:
                log.error("snapshot %s was never pushed to the repository and its image is "
                          "gone from the local cache: it cannot be used", tpl.template_id)

    async def _capture(self, sandbox_id: str, name: str | None) -> TemplateRecord:
        """Checkpoint a running sandbox into a local image; the record is not stored. Its
        writable layer, sealed, becomes a layer of the returned template (held in flight:
        the caller stores the template or lets the layer go)."""
        if name is not None and self.store.find_template(name) is not None:
            raise AenvError(ErrorCode.CONFLICT, f"a template or snapshot named '{name}' exists")
        async with self._lock(sandbox_id):
            rec = self.get(sandbox_id)
            _require_state(rec, SandboxState.RUNNING)
            await self._require_alive_locked(rec)
            driver = _snapshot_driver(self._driver(rec))
            source = self.find_template(rec.template_id)
            layers = list(rec.layers or source.layers)
            snapshot_id = "snap" + new_sandbox_id()[4:]
            images = self.layout.snapshot(snapshot_id)
            try:
                await driver.snapshot(self._handle(rec), images)
            except BaseException as exc:
                # The image may hold the sealed layer: a read-only subvolume on btrfs.
                remove = (driver.remove_layer if isinstance(driver, LayerSealingDriver)
                          else functools.partial(shutil.rmtree, ignore_errors=True))
                with contextlib.suppress(OSError, AenvError):
                    await asyncio.to_thread(remove, images)
                if isinstance(exc, AenvError):
                    await self._rescue_after_failed_checkpoint(rec, self._driver(rec))
                raise
        crash_point("snapshot:dumped")
        if isinstance(driver, LayerSealingDriver):
            sealed = driver.sealed_layer(images)
            if sealed is not None:
                root = SEAL_PREFIX + snapshot_id
                self._hold_layers([root])
                try:
                    path = await asyncio.to_thread(driver.adopt_sealed, sealed,
                                                   self.layout.layer(root))
                    layer = path.relative_to(self.layout.layers_dir).as_posix()
                    layers = await self._compact(driver, [layer, *layers], snapshot_id)
                finally:
                    self._release_layers([root])
        tpl = TemplateRecord(
            template_id=snapshot_id, names=[name] if name else [], layers=layers,
            cpu_count=rec.cpu_count, memory_mb=rec.memory_mb, disk_size_mb=rec.disk_size_mb,
            default_user=source.default_user, default_workdir=source.default_workdir,
            env_vars=dict(rec.env_vars), created_at=utcnow(), image=str(images),
            image_token=rec.envd_access_token, source_sandbox=sandbox_id,
            allow_internet_access=rec.allow_internet_access, runtime=rec.runtime,
            network=dict(rec.network), volume_mounts=list(rec.volume_mounts))
        return tpl

    # ---------------------------------------------------------------- sealed layers
    async def _compact(self, driver: LayerSealingDriver, layers: list[str], snapshot_id: str
                       ) -> list[str]:
        """Past `snapshot.max_sealed_layers` sealed layers on top of a stack (a chain of
        snapshots of restored snapshots), merge them into one, so that the depth of an
        overlay stack (and the cost of every lookup in it) stays bounded."""
        sealed = [layer for layer in layers if layer.startswith(SEAL_PREFIX)]
        if len(sealed) <= self.config.snapshot.max_sealed_layers:
            return layers
        merged = f"{SEAL_PREFIX}{snapshot_id}-merged"
        self._hold_layers([merged])
        try:
            await asyncio.to_thread(driver.merge_layers,
                                    [self.layout.layer(layer) for layer in sealed],
                                    self.layout.layer(merged))
        finally:
            self._release_layers([merged])
        log.info("snapshot %s: compacted %d sealed layers into %s", snapshot_id, len(sealed),
                 merged)
        return [merged, *[layer for layer in layers if not layer.startswith(SEAL_PREFIX)]]

    def _hold_layers(self, layers: list[str]) -> None:
        for layer in map(_layer_root, layers):
            self._layers_in_flight[layer] = self._layers_in_flight.get(layer, 0) + 1

    def _release_layers(self, layers: list[str]) -> None:
        for layer in map(_layer_root, layers):
            left = self._layers_in_flight.get(layer, 0) - 1
            if left > 0:
                self._layers_in_flight[layer] = left
            else:
                self._layers_in_flight.pop(layer, None)

    @contextlib.contextmanager
    def _layers_held(self, layers: list[str]) -> Iterator[None]:
        self._hold_layers(layers)
        try:
            yield
        finally:
            self._release_layers(layers)

    async def _ensure_sealed_layers(self, layers: list[str]) -> None:
        """Sealed layers of a snapshot that are not on local disk (the node's cache was
        wiped, or the snapshot was made on another node) come from the repository."""
        for layer in layers:
            path = self.layout.layer(layer)
            if not layer.startswith(SEAL_PREFIX) or path.exists():
                continue
            if self.snapshots is None:
                raise not_found(f"layer {layer} is missing and there is no repository")
            async with self._layer_locks.setdefault(layer, asyncio.Lock()):
                if not path.exists():
                    stats = await self.snapshots.repository.pull(_layer_key(layer), path)
                    log.info("layer %s pulled from the repository (%d bytes, %.2f s)", layer,
                             stats.bytes_total, stats.seconds)

    def layers_in_use(self) -> set[str]:
        """Layer directories no cache may evict: those of every sandbox on record (running,
        paused or in transition), of operations in flight, and of the default template
        (a driver's ready pool runs sandboxes on it before any record exists)."""
        used = set(self._layers_in_flight)
        for rec in self._records.values():
            layers = rec.layers
            if not layers:
                tpl = self.store.find_template(rec.template_id)
                layers = tpl.layers if tpl is not None else []
            used.update(_layer_root(layer) for layer in layers)
        default = self.store.find_template(self.config.sandbox.template)
        if default is not None:
            used.update(_layer_root(layer) for layer in default.layers)
        return used

    async def _collect_layers(self) -> None:
        """Remove local sealed layers that no template, sandbox or operation uses any more
        (and let the image layer cache evict cold layers)."""
        if self.images is not None:
            try:
                await self.images.collect_layers()
            except (OSError, AenvError) as exc:
                log.warning("image layer cache eviction failed: %s", exc)
        drivers = [d for d in self._drivers.values() if isinstance(d, LayerSealingDriver)]
        if not drivers or not self.layout.layers_dir.is_dir():
            return
        driver = drivers[0]
        used = self.layers_in_use()
        used.update(_layer_root(layer) for tpl in self.store.iter_templates()
                    for layer in tpl.layers)
        for path in self.layout.layers_dir.glob(SEAL_PREFIX + "*"):
            if path.name not in used:
                try:
                    await asyncio.to_thread(driver.remove_layer, path)
                except (OSError, AenvError) as exc:
                    log.warning("could not remove unused layer %s: %s", path.name, exc)

    def list_snapshots(self, sandbox_id: str | None = None, name: str | None = None
                       ) -> list[TemplateRecord]:
        return [t for t in self.store.iter_templates() if t.image is not None
                and not t.transient
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
            if self._pusher is not None:
                await self._pusher.cancel(tpl.image)
            if tpl.image in self.snapshots and not self.snapshots.is_pinned(tpl.image):
                await self.snapshots.evict(tpl.image)
            repository = self.snapshots.repository
            if await repository.exists(tpl.image):
                await repository.delete(tpl.image)
            # Its sealed layers leave the repository with the last snapshot that stacks on them.
            still_used = {layer for t in self.store.iter_templates() for layer in t.layers}
            for layer in tpl.layers:
                if (layer.startswith(SEAL_PREFIX) and layer not in still_used
                        and await repository.exists(_layer_key(layer))):
                    await repository.delete(_layer_key(layer))
        await self._collect_layers()

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
        # The fork's image is local and short-lived: no trip through the repository. Its
        # sealed layer stays as long as a child runs on it.
        t0 = time.monotonic()
        tpl = await self._capture(sandbox_id, None)
        tpl.transient = True  # deleted below; by the recovery at start if we crash first
        self.store.put_template(tpl)
        crash_point("fork:captured")
        t1 = time.monotonic()
        try:
            results = await asyncio.gather(*[
                self.create(CreateRequest(template=tpl.template_id, timeout_s=timeout,
                                          metadata=dict(parent.metadata),
                                          auto_pause=parent.auto_pause,
                                          auto_resume=parent.auto_resume,
                                          auto_pause_memory=parent.auto_pause_memory))
                for _ in range(count)], return_exceptions=True)
        finally:
            t2 = time.monotonic()
            crash_point("fork:children")
            await self.delete_template(tpl.template_id)
        log.info("fork of %s: captured in %.1f ms, %d children in %.1f ms, cleanup %.1f ms",
                 sandbox_id, (t1 - t0) * 1e3, count, (t2 - t1) * 1e3,
                 (time.monotonic() - t2) * 1e3)
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
                self.events.record(child.sandbox_id, "forked_from",
                                   f"sandbox forked from {sandbox_id}", parentID=sandbox_id)
        made = sum(isinstance(c, SandboxRecord) for c in out)
        self.events.record(sandbox_id, "forked", f"sandbox forked into {made} of {count} "
                           "children", "info" if made == count else "warn", op="fork",
                           seconds=f"{time.monotonic() - t0:.6f}",
                           children=",".join(c.sandbox_id for c in out
                                             if isinstance(c, SandboxRecord)))
        return out

    # ---------------------------------------------------------------- logs
    def _envd_log_root(self, rec: SandboxRecord) -> Path | None:
        """Where a container sandbox's root filesystem writes (its upper): envd's log is in
        it, readable while the sandbox runs or is paused. None for VMs (their disk)."""
        workspace = rec.handle.get("workspace")
        if rec.runtime != "container" or not workspace:
            return None
        return Path(workspace) / "upper"

    async def _keep_envd_log(self, rec: SandboxRecord) -> None:
        """Before a sandbox's files go: the end of its envd log into its event log."""
        root = self._envd_log_root(rec)
        if root is not None:
            since = int(rec.started_at.timestamp() * 1000)
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self.events.keep_envd_log, rec.sandbox_id, root, since)

    async def logs(self, sandbox_id: str, query: LogQuery) -> list[LogEntry]:
        """A sandbox's log: its lifecycle events and envd's lines (read from the sandbox while
        it exists, kept from its last moments once it is gone), as E2B pages it. Sandboxes
        gone for longer than the log keeps anything are not found."""
        rec = self._records.get(sandbox_id)
        live: list[LogEntry] = []
        if rec is not None:
            root = self._envd_log_root(rec)
            if root is not None:
                text = await asyncio.to_thread(read_tail, root / ENVD_LOG)
                live = parse_envd_log(text, sandbox_id, int(rec.started_at.timestamp() * 1000))
        elif not self.events.known(sandbox_id):
            self.get(sandbox_id)  # raises: not found (or gone, with why)
        return self.events.query(sandbox_id, query, live)

    async def metrics(self, sandbox_id: str) -> tuple[datetime, ResourceUsage]:
        rec = self.get(sandbox_id)
        if rec.state is not SandboxState.RUNNING:
            raise AenvError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} is not running")
        return utcnow(), await self._driver(rec).stats(self._handle(rec))

    async def open_port(self, sandbox_id: str, port: int) -> socket.socket:
        """A connection to `port` inside a running sandbox (the proxy's way in)."""
        rec = self.get(sandbox_id)
        if rec.state is SandboxState.PAUSED and pause_mode(rec) == "filesystem":
            # As in E2B: traffic does not resume a sandbox whose memory is gone.
            raise AenvError(ErrorCode.UNAVAILABLE, f"sandbox {sandbox_id} is paused without "
                            "its memory: resume it with connect")
        if rec.state is SandboxState.PAUSED and rec.auto_resume:
            async with self._lock(sandbox_id):
                rec = self.get(sandbox_id)
                if rec.state is SandboxState.PAUSED:
                    rec = await self._resume_locked(rec, self.config.sandbox.timeout_s)
        if rec.state is not SandboxState.RUNNING:
            raise AenvError(ErrorCode.UNAVAILABLE, f"sandbox {sandbox_id} is {rec.state.api_state}")
        try:
            return await self._driver(rec).connect(self._handle(rec), port)
        except AenvError as exc:
            if exc.code is ErrorCode.UNAVAILABLE and (reason := self._exit_reason(rec)):
                await self._bury(rec, reason)
                raise _gone(sandbox_id, reason) from None
            raise

    def running_ids(self) -> list[str]:
        return [r.sandbox_id for r in self._records.values() if r.state is SandboxState.RUNNING]

    def state_counts(self) -> dict[str, int]:
        """Sandboxes on this node by state (creates in flight count as creating)."""
        counts = {state.value: 0 for state in SandboxState}
        for rec in self._records.values():
            counts[rec.state.value] += 1
        counts[SandboxState.CREATING.value] += self._creating
        return counts

    # ---------------------------------------------------------------- dead sandboxes
    def _exit_reason(self, rec: SandboxRecord) -> str | None:
        """Why a sandbox on record as running is not, as its driver sees it (None: alive,
        or the driver cannot tell)."""
        if rec.runtime not in self._liveness_drivers:
            driver = self._drivers.get(rec.runtime)
            if driver is None:
                return None
            self._liveness_drivers[rec.runtime] = (
                driver if isinstance(driver, LivenessDriver) else None)
        liveness = self._liveness_drivers[rec.runtime]
        if liveness is None:
            return None
        try:
            return liveness.exit_reason(self._handle(rec))
        except (AenvError, OSError) as exc:
            log.warning("sandbox %s: liveness check failed: %s", rec.sandbox_id, exc)
            return None

    async def _require_alive_locked(self, rec: SandboxRecord) -> None:
        """Before (and after a failed) operation on a running sandbox, with its lock held:
        a sandbox that died is removed and the caller gets the 404 saying why."""
        reason = self._exit_reason(rec)
        if reason is not None:
            await self._bury_locked(rec, reason)
            raise _gone(rec.sandbox_id, reason)

    async def _bury_locked(self, rec: SandboxRecord, reason: str) -> None:
        """Remove a running sandbox that died: its record, whatever the driver still holds
        for it (cgroups, network slot, workspace), and keep why for the 404s about it."""
        sandbox_id = rec.sandbox_id
        log.warning("sandbox %s died: %s; removing it", sandbox_id, reason)
        self._dead[sandbox_id] = reason
        while len(self._dead) > DEAD_REASONS_KEPT:
            self._dead.popitem(last=False)
        self._envd_unanswered_since.pop(sandbox_id, None)
        # Gone for every caller from now on (404 with the reason), not "paused" while the
        # cleanup runs; the stored record (killing) lets a restarted server finish it.
        self._records.pop(sandbox_id, None)
        self.store.put_sandbox(replace(rec, state=SandboxState.KILLING))
        self._stopped_serving(sandbox_id)
        await self._keep_envd_log(rec)
        self.events.record(sandbox_id, "died", f"sandbox died: {reason}", "error",
                           reason=reason)
        t0 = time.monotonic()
        try:
            await self._driver(rec).destroy(self._handle(rec))
        except AenvError as exc:
            log.error("sandbox %s: cleanup after its death failed: %s", sandbox_id, exc.message)
        finally:
            self._locks.pop(sandbox_id, None)
            self.store.delete_sandbox(sandbox_id)
        log.info("sandbox %s: cleaned up after its death in %.1f ms", sandbox_id,
                 (time.monotonic() - t0) * 1e3)

    async def _bury(self, seen: SandboxRecord, reason: str | None) -> bool:
        """`_bury_locked` for a sandbox found dead without its lock: re-checked under it (an
        operation may have paused, resumed or killed it meanwhile: then its record is not
        the one `seen` any more). `reason` None: ask the driver."""
        sandbox_id = seen.sandbox_id
        async with self._lock(sandbox_id):
            rec = self._records.get(sandbox_id)
            if rec is None or rec.state is not SandboxState.RUNNING or rec.handle != seen.handle:
                return False
            reason = reason if reason is not None else self._exit_reason(rec)
            if reason is None:
                return False
            await self._bury_locked(rec, reason)
        return True

    def _idle_running(self) -> list[SandboxRecord]:
        """Running sandboxes no operation holds right now (a snapshot freezes a sandbox
        while its record says running; its lock tells)."""
        return [r for r in self._records.values() if r.state is SandboxState.RUNNING
                and not (r.sandbox_id in self._locks and self._locks[r.sandbox_id].locked())]

    async def _liveness_forever(self) -> None:
        interval = self.config.sandbox.liveness_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            buried = False
            for rec in self._idle_running():
                try:
                    reason = self._exit_reason(rec)
                    if reason is not None:
                        buried = await self._bury(rec, None) or buried
                except Exception:  # one bad sandbox must not stop the monitor
                    log.exception("liveness check of sandbox %s failed", rec.sandbox_id)
            if buried:
                await self._collect_layers()

    async def _envd_checks_forever(self) -> None:
        interval = self.config.sandbox.envd_check_interval_s
        limit = asyncio.Semaphore(ENVD_CHECKS_AT_ONCE)
        while True:
            await asyncio.sleep(interval)
            running = self._idle_running()
            ids = {r.sandbox_id for r in running}
            for gone in set(self._envd_unanswered_since) - ids:
                del self._envd_unanswered_since[gone]
            results = await asyncio.gather(*[self._check_envd(rec, limit) for rec in running],
                                           return_exceptions=True)
            buried = False
            for rec, answered in zip(running, results, strict=True):
                if answered is True:
                    self._envd_unanswered_since.pop(rec.sandbox_id, None)
                    continue
                since = self._envd_unanswered_since.setdefault(rec.sandbox_id, time.monotonic())
                silent = time.monotonic() - since
                if silent < self.config.sandbox.envd_unanswered_s:
                    continue
                # Its process may be gone (the driver knows why) or alive but hung.
                reason = self._exit_reason(rec) or (
                    f"envd has not answered health checks for {silent:.0f} s ({answered!r})")
                buried = await self._bury(rec, reason) or buried
            if buried:
                await self._collect_layers()

    async def _check_envd(self, rec: SandboxRecord, limit: asyncio.Semaphore) -> bool:
        """One `GET /health` to the sandbox's envd, as the proxy reaches it; True if it
        answered 2xx in time. Raises (the failure, for the reason) otherwise."""
        async with limit:
            sock = await self._driver(rec).connect(self._handle(rec),
                                                   self.config.sandbox.envd_port)
            loop = asyncio.get_running_loop()
            try:
                async with asyncio.timeout(ENVD_CHECK_TIMEOUT_S):
                    await loop.sock_sendall(sock, b"GET /health HTTP/1.1\r\nHost: envd\r\n"
                                                  b"Connection: close\r\n\r\n")
                    head = await loop.sock_recv(sock, 64)
            finally:
                sock.close()
        parts = head.split(b" ", 2)
        if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].startswith(b"2"):
            return True
        raise AenvError(ErrorCode.UNAVAILABLE, f"envd answered {head[:32]!r}")

    # ---------------------------------------------------------------- orphans
    async def _sweep_orphans(self, at_start: bool = False) -> list[str]:
        """Destroy what no record owns. At start (nothing in flight) also drop checkpoint
        images no record names; later a pause or resume may be making or using one whose
        record does not say so yet, so that cleanup is left to the operations themselves."""
        def known(sandbox_id: str) -> bool:
            return (sandbox_id in self._records or sandbox_id in self._creating_ids
                    or self.store.get_sandbox(sandbox_id) is not None)

        idle = [r for r in self._records.values()
                if r.state in (SandboxState.RUNNING, SandboxState.PAUSED)] if at_start else []
        destroyed = await self._recovery.sweep(list(self._drivers.values()), known, idle)
        if destroyed:
            log.warning("destroyed %d sandboxes that had no record: %s", len(destroyed),
                        ", ".join(destroyed))
        return destroyed

    async def _sweep_orphans_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_ORPHANS_INTERVAL_S)
            try:
                await self._sweep_orphans()
            except Exception:  # the next round tries again
                log.exception("orphan sweep failed")

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

    async def _gc_forever(self) -> None:
        assert self.snapshots is not None
        # The first one soon after a start: what a crash left (chunks of pushes cut short,
        # their markers) should not wait a whole interval, which a server restarted more
        # often than that would never reach.
        delay = min(GC_FIRST_AFTER_S, self.config.snapshot.gc_interval_s)
        while True:
            await asyncio.sleep(delay)
            delay = self.config.snapshot.gc_interval_s
            try:
                stats = await self.snapshots.repository.gc()
            except Exception:  # the repository may be unreachable for a while
                log.exception("repository gc failed")
                continue
            log.info("repository gc: %d chunks deleted, %d kept, %d markers of dead pushes "
                     "removed%s", stats.blobs_deleted, stats.blobs_kept, stats.stale_markers,
                     f" (skipped: {stats.skipped})" if stats.skipped else "")

    async def _expire(self, sandbox_id: str) -> None:
        rec = self._records.get(sandbox_id)
        if rec is None or rec.end_at > utcnow():
            return
        self.events.record(sandbox_id, "expired", "sandbox timeout reached: "
                           + ("pausing it" if rec.auto_pause else "killing it"))
        if rec.auto_pause:
            try:
                await self.pause(sandbox_id, memory=rec.auto_pause_memory, reason="timeout")
                log.info("sandbox %s expired and was paused", sandbox_id)
                return
            except AenvError as exc:
                if exc.code is ErrorCode.NOT_FOUND:
                    return  # it had died: removed with its reason (see _bury_locked)
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
        await self.kill(sandbox_id, reason="timeout")
        log.info("sandbox %s expired and was killed", sandbox_id)


def pause_mode(rec: SandboxRecord) -> str | None:
    """E2B's `pauseMode` of a paused sandbox: `full` (memory kept) or `filesystem`."""
    if rec.state is not SandboxState.PAUSED:
        return None
    return "filesystem" if rec.handle.get("fs_paused") else "full"


def _require_state(rec: SandboxRecord, state: SandboxState) -> None:
    """AenvError(CONFLICT) unless the sandbox is in `state`: the operation's precondition."""
    if rec.state is not state:
        raise AenvError(ErrorCode.CONFLICT, f"sandbox {rec.sandbox_id} is {rec.state.value}")


def _gone(sandbox_id: str, reason: str) -> AenvError:
    return not_found(f"sandbox {sandbox_id} not found: it stopped running ({reason})")


def _snapshot_driver(driver: RuntimeDriver) -> SnapshotDriver:
    if not isinstance(driver, SnapshotDriver):
        raise AenvError(ErrorCode.NOT_SUPPORTED,
                        f"snapshots are not supported by the {driver.name} runtime")
    return driver


def _layer_root(layer: str) -> str:
    """The directory of layers_dir a layer id lives in (a sealed layer's id can name a
    directory inside it: `seal-<snapshot>/upper`)."""
    return layer.split("/", 1)[0]


def _layer_key(layer: str) -> str:
    """The repository entry holding a sealed layer."""
    return "layer-" + _layer_root(layer)


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
