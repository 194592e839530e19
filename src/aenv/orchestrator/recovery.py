"""Crash recovery: at start, every operation a dead server left half-done is rolled forward or
back, from what its record says and what is on disk; while running, what no record owns is
swept away periodically.

Every multi-step operation writes its intent before its first side effect (the record's
state: creating, pausing, resuming, killing; a fork's template marked transient), so after a
`kill -9` the records say what was in flight (docs/reliability.md has the table):

| record state | found | becomes |
|---|---|---|
| creating | anything the create made | destroyed, record deleted |
| killing | anything left | destroyed, record deleted |
| running | a criu left dumping it, its cgroup frozen | criu stopped, thawed, running |
| pausing, processes alive | (the dump was cut short) | thawed, running |
| pausing, processes gone | a complete image | paused |
| pausing, processes gone | no complete image | destroyed, reason kept (cannot happen but for a crash inside criu's last step) |
| resuming | processes of a half-done restore | those killed, root unmounted, paused |
| running, child of a transient template | (its fork never returned) | destroyed |
| transient template | (a fork's capture) | deleted with its image |
| a build sandbox (metadata `aenv.build`) | (its build, kept in memory, is gone) | destroyed |
| (none) | a workspace, cgroup, slot | destroyed (`RecoverableDriver.sweep`) |

Partial snapshot images (no template names them) are deleted; sealed layers no template or
sandbox uses go with the manager's layer collection; pushes and paused-state uploads that
did not finish start again (pushes.py, paused.py).

Owns: deciding what each record needs after a crash. Must not touch: the driver's kernel
resources other than through `RecoverableDriver`; the repository.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from aenv.errors import AenvError
from aenv.orchestrator.models import SandboxRecord, SandboxState
from aenv.orchestrator.store import Store
from aenv.runtime.base import RecoverableDriver, RuntimeDriver, RuntimeHandle
from aenv.storage.layout import Layout

log = logging.getLogger("aenv.recovery")

# Metadata of template build sandboxes (builds/builder.py sets it): a build's state is in
# memory, so after a restart nothing will ever use its sandbox again.
BUILD_METADATA_KEY = "aenv.build"


@dataclass
class RecoveryReport:
    """What a start-up recovery did (logged, and returned for tests)."""

    thawed_or_settled: list[str] = field(default_factory=list)
    rolled_back_to_running: list[str] = field(default_factory=list)
    rolled_forward_to_paused: list[str] = field(default_factory=list)
    rolled_back_to_paused: list[str] = field(default_factory=list)
    destroyed: dict[str, str] = field(default_factory=dict)  # sandbox id -> why
    orphans: list[str] = field(default_factory=list)
    templates_deleted: list[str] = field(default_factory=list)
    images_deleted: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = [f"{len(v)} {k.replace('_', ' ')}" for k, v in vars(self).items() if v]
        return ", ".join(parts) if parts else "nothing to do"


def _handle(rec: SandboxRecord) -> RuntimeHandle:
    return RuntimeHandle(rec.runtime, rec.sandbox_id, rec.handle)


class Recovery:
    def __init__(self, store: Store, layout: Layout,
                 runtime: Callable[[str], Awaitable[RuntimeDriver]]) -> None:
        self.store = store
        self.layout = layout
        self._runtime = runtime

    async def _driver(self, rec: SandboxRecord) -> RuntimeDriver | None:
        try:
            return await self._runtime(rec.runtime)
        except AenvError as exc:
            log.error("sandbox %s: runtime %s unavailable, left as it is: %s", rec.sandbox_id,
                      rec.runtime, exc.message)
            return None

    async def _destroy(self, rec: SandboxRecord, driver: RuntimeDriver, why: str,
                       report: RecoveryReport) -> None:
        log.warning("sandbox %s (%s): %s; destroying it", rec.sandbox_id, rec.state, why)
        self.store.put_sandbox(replace(rec, state=SandboxState.KILLING))
        try:
            await driver.destroy(_handle(rec))
        except AenvError as exc:
            log.error("sandbox %s: cleanup failed: %s", rec.sandbox_id, exc.message)
        self.store.delete_sandbox(rec.sandbox_id)
        report.destroyed[rec.sandbox_id] = why

    async def settle_records(self, remove_tree: Callable[[Path], None] = shutil.rmtree
                             ) -> RecoveryReport:
        """Bring every record to running or paused (or remove it), before re-attaching.
        `remove_tree` deletes a partial snapshot image (which may hold a sealed layer that
        only the driver can delete: a read-only subvolume)."""
        report = RecoveryReport()
        transient = {t.template_id for t in self.store.iter_templates() if t.transient}
        records = [(rec, driver) for rec in list(self.store.iter_sandboxes())
                   if (driver := await self._driver(rec)) is not None]
        # First, whatever a dead server left working on them (criu) stops, and frozen ones
        # are thawed: one pass per driver (one scan of the host's processes).
        in_flight = (SandboxState.RUNNING, SandboxState.PAUSING, SandboxState.RESUMING)
        for driver in {id(d): d for _, d in records}.values():
            if isinstance(driver, RecoverableDriver):
                report.thawed_or_settled += await driver.settle(
                    [_handle(r) for r, d in records if d is driver and r.state in in_flight])
        for rec, driver in records:
            recoverable = driver if isinstance(driver, RecoverableDriver) else None
            state = rec.state
            if state in (SandboxState.CREATING, SandboxState.KILLING):
                await self._destroy(rec, driver, f"its {'create' if state is SandboxState.CREATING else 'kill'} "
                                    "was cut short by a restart", report)
                continue
            if recoverable is None:
                continue  # as before: re-attached if alive, else removed (manager._reattach)
            if state is SandboxState.RUNNING and rec.template_id in transient:
                await self._destroy(rec, driver, "a child of a fork that never returned", report)
                continue
            if BUILD_METADATA_KEY in rec.metadata and state in (SandboxState.RUNNING,
                                                                 SandboxState.PAUSING):
                await self._destroy(rec, driver, "the sandbox of a template build that a "
                                    "restart ended", report)
                continue
            if state is SandboxState.PAUSING:
                if await driver.attach(_handle(rec)):
                    self.store.put_sandbox(replace(rec, state=SandboxState.RUNNING))
                    report.rolled_back_to_running.append(rec.sandbox_id)
                    log.warning("sandbox %s: its pause was cut short; running again",
                                rec.sandbox_id)
                    continue
                paused = recoverable.interrupted_pause(_handle(rec))
                if paused is not None:
                    self.store.put_sandbox(replace(rec, state=SandboxState.PAUSED,
                                                   handle=paused.data))
                    report.rolled_forward_to_paused.append(rec.sandbox_id)
                    log.warning("sandbox %s: its pause was cut short after the image was "
                                "complete; paused", rec.sandbox_id)
                    continue
                await self._destroy(rec, driver, "its pause was cut short and left no "
                                    "complete image", report)
                continue
            if state is SandboxState.RESUMING:
                await recoverable.abort_resume(_handle(rec))
                self.store.put_sandbox(replace(rec, state=SandboxState.PAUSED))
                report.rolled_back_to_paused.append(rec.sandbox_id)
                log.warning("sandbox %s: its resume was cut short; paused again",
                            rec.sandbox_id)
        await self._drop_transient_templates(report)
        await asyncio.to_thread(self._drop_partial_images, report, remove_tree)
        return report

    async def _drop_transient_templates(self, report: RecoveryReport) -> None:
        for tpl in list(self.store.iter_templates()):
            if not tpl.transient:
                continue
            self.store.delete_template(tpl.template_id)
            if tpl.image and tpl.image.startswith("/"):
                await asyncio.to_thread(shutil.rmtree, tpl.image, True)
            report.templates_deleted.append(tpl.template_id)
            log.warning("fork image %s of a fork cut short: deleted", tpl.template_id)

    def _drop_partial_images(self, report: RecoveryReport,
                             remove_tree: Callable[[Path], None]) -> None:
        """Snapshot image directories no template names: captures a crash cut short."""
        named = {Path(t.image).name for t in self.store.iter_templates()
                 if t.image and t.image.startswith("/")}
        root = self.layout.snapshots_dir
        if not root.is_dir():
            return
        for path in root.iterdir():
            if path.name not in named:
                try:
                    remove_tree(path)
                except (OSError, AenvError) as exc:
                    log.error("could not delete the partial snapshot image %s: %s", path, exc)
                    continue
                report.images_deleted.append(path.name)
                log.warning("snapshot image %s has no record (a capture cut short): deleted",
                            path.name)

    async def sweep(self, drivers: list[RuntimeDriver], known: Callable[[str], bool],
                    idle: list[SandboxRecord]) -> list[str]:
        """Orphans of every recoverable driver: sandboxes on disk that are not `known`;
        stale checkpoint images of the `idle` records."""
        destroyed: list[str] = []
        for driver in drivers:
            if not isinstance(driver, RecoverableDriver):
                continue
            handles = {r.sandbox_id: _handle(r) for r in idle if r.runtime == driver.name}
            destroyed += await driver.sweep(known, handles, self.layout.sandboxes_dir)
        return destroyed
