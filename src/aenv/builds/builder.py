"""Template builds: E2B's build pipeline, run in a build sandbox and kept as a snapshot.

Owns: the state of template builds (requested templates, builds, their logs and status, the
uploaded build-context archives under `cache/build-files/<template>/<hash>.tar`) and the
pipeline of one build: a sandbox from the base (`fromTemplate`, or `fromImage`: an existing
template of that name, else pulled with `ImagePuller`), each step through the sandbox's envd
(RUN as the current USER in the current WORKDIR with ENV and ARG; COPY/ADD from an uploaded
archive; ENV/ARG/WORKDIR/USER change the build state), `startCmd` in the background, `readyCmd`
polled until it exits 0, then `SandboxManager.snapshot` of the sandbox, stored as the
template (its id and names, the final USER/WORKDIR/ENV as its defaults): sandboxes created
from it are restores of the running sandbox, start command included. The build sandbox is
always killed; a failed build leaves no template (a rebuild's previous template stays).
Must not touch: sandbox lifecycle beyond `SandboxManager`'s public methods; image layers
(`images/`); HTTP (`api/templates.py` shapes the answers).

Build cache: every built template records what its snapshot is the result of (a chain of
sha256 keys: the base, then each step's type, arguments and files hash; then the start and
ready commands) and the build state at its end, in `cache/build-cache.json`. A new build whose
steps begin with the whole chain of a template's build starts its build sandbox from that
template (a restore) and runs only the steps after it: the steps whose inputs did not change
are not run again (logged `CACHED`). A build with exactly the same inputs as the template it
rebuilds runs nothing. A template whose build ran a start command serves only as an exact
match (its snapshot holds the running start command). `force` (the SDK's
`skip_cache`) runs every step; a step's `force` (the SDK's `skip_cache()` before it) runs it
and all that follow.

A built template records its start and ready commands: when one of its sandboxes boots
afresh on its files (a resume without memory, `SandboxManager.on_cold_boot`), `start_again`
runs the start command again and polls the ready command.

Build state is in memory: a restart forgets builds (not the templates they made, nor the
build cache).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import posixpath
import re
import secrets
import shlex
import shutil
import string
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aenv.builds.context import Owner, place
from aenv.builds.envd_client import SandboxEnvd
from aenv.config import Config
from aenv.errors import AenvError, ErrorCode, invalid, not_found
from aenv.images.pull import ImagePuller
from aenv.orchestrator.manager import SandboxManager
from aenv.orchestrator.models import CreateRequest, SandboxRecord, TemplateRecord
from aenv.orchestrator.recovery import BUILD_METADATA_KEY as BUILD_SANDBOX_KEY
from aenv.storage.layout import Layout

log = logging.getLogger("aenv.builds")

READY_TIMEOUT_S = 300.0  # readyCmd must succeed within this long of the start command
READY_INTERVAL_S = 0.5
READY_CHECK_TIMEOUT_S = 30.0  # one run of readyCmd
COLD_READY_TIMEOUT_S = 60.0  # readyCmd after a sandbox of the template booted afresh
MAX_CONCURRENT_BUILDS = 2  # more wait (status "waiting")
MAX_LOG_ENTRIES = 50_000  # per build; later lines are counted, not kept
BUILD_SANDBOX_TTL_S = 6 * 3600
REASON_LOG_TAIL = 20
KEEP_BUILDS = 10  # per template, in memory
# metadata of build sandboxes: "<template>/<build>" (destroyed by the recovery at start)
BUILD_METADATA_KEY = BUILD_SANDBOX_KEY
STEP_TYPES = frozenset({"RUN", "ENV", "ARG", "WORKDIR", "USER", "COPY", "ADD"})
_HASH = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
_ID_ALPHABET = string.ascii_lowercase + string.digits


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass
class LogEntry:
    timestamp: datetime
    level: str  # debug | info | warn | error
    message: str
    step: str | None = None


@dataclass
class Step:
    type: str
    args: list[str] = field(default_factory=list)
    files_hash: str | None = None
    force: bool = False  # run it (and every step after it) whatever the build cache holds


@dataclass
class BuildSpec:
    """What `POST /v2/templates/{id}/builds/{build}` asks for."""
    from_image: str | None = None
    from_template: str | None = None
    steps: list[Step] = field(default_factory=list)
    start_cmd: str | None = None
    ready_cmd: str | None = None
    registry_credentials: bool = False
    force: bool = False  # run every step: the build cache is not used


@dataclass
class Build:
    build_id: str
    template_id: str
    cpu_count: int
    memory_mb: int
    created_at: datetime
    status: str = "waiting"  # waiting | building | ready | error
    updated_at: datetime | None = None
    finished_at: datetime | None = None
    logs: list[LogEntry] = field(default_factory=list)
    dropped_logs: int = 0
    reason: dict[str, Any] | None = None
    task: asyncio.Task[None] | None = None


@dataclass
class BuildTemplate:
    """A template as the build API knows it: requested (maybe never built) or built."""
    template_id: str
    names: list[str]
    tags: list[str]
    created_at: datetime
    builds: list[Build] = field(default_factory=list)


class BuildFailed(Exception):
    def __init__(self, step: str, message: str) -> None:
        super().__init__(message)
        self.step = step
        self.message = message


@dataclass
class _State:
    """The build state the steps change."""
    user: str
    workdir: str | None
    env: dict[str, str] = field(default_factory=dict)
    args: dict[str, str] = field(default_factory=dict)

    def run_env(self) -> dict[str, str]:
        return {**self.args, **self.env}  # ENV wins over ARG, as in Docker


def _key(previous: str, item: object) -> str:
    return hashlib.sha256(f"{previous}\n{json.dumps(item, sort_keys=True)}".encode()).hexdigest()


def cache_keys(base: TemplateRecord, spec: BuildSpec) -> tuple[list[str], str]:
    """The build's chain: [base key, key after step 1, ...] and the key of the whole build
    (the start and ready commands too). A base that was rebuilt has other layers: other keys."""
    keys = [_key("base", [base.template_id, base.image, base.layers,
                          base.created_at.isoformat() if base.created_at else None])]
    for step in spec.steps:
        keys.append(_key(keys[-1], [step.type, step.args, step.files_hash]))
    return keys, _key(keys[-1], ["finalize", spec.start_cmd, spec.ready_cmd])


@dataclass
class CacheHit:
    template_id: str  # the template whose snapshot is the state after `steps` steps
    steps: int
    exact: bool  # the same build entirely (start and ready commands too)
    state: _State


class BuildCache:
    """What each built template's snapshot is the result of (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: dict[str, dict[str, Any]] = {}
        with contextlib.suppress(OSError, ValueError):
            loaded = json.loads(path.read_text())
            if isinstance(loaded, dict):
                self._entries = {k: v for k, v in loaded.items() if isinstance(v, dict)}

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(4)}")
        tmp.write_text(json.dumps(self._entries))
        os.replace(tmp, self.path)

    def put(self, tpl: TemplateRecord, keys: list[str], final: str, state: _State,
            started: bool) -> None:
        self._entries[tpl.template_id] = {
            "keys": keys, "final": final, "started": started,
            "created": tpl.created_at.isoformat() if tpl.created_at else None,
            "state": {"user": state.user, "workdir": state.workdir, "env": state.env,
                      "args": state.args}}
        self._save()

    def forget(self, template_id: str) -> None:
        if self._entries.pop(template_id, None) is not None:
            self._save()

    def lookup(self, find: Callable[[str], TemplateRecord | None], keys: list[str],
               final: str, usable_steps: int) -> CacheHit | None:
        """The template to start from: the longest whole chain that begins ours (at most
        `usable_steps` steps), the exact build first. Entries of templates that were deleted
        or rebuilt since are dropped."""
        best: CacheHit | None = None
        for template_id, entry in list(self._entries.items()):
            tpl = find(template_id)
            created = tpl.created_at.isoformat() if tpl is not None and tpl.created_at else None
            if tpl is None or tpl.image is None or created != entry.get("created"):
                self.forget(template_id)
                continue
            theirs = entry.get("keys")
            if not isinstance(theirs, list) or not theirs:
                continue
            steps = len(theirs) - 1
            if steps > usable_steps or theirs != keys[:len(theirs)]:
                continue
            exact = steps == len(keys) - 1 and entry.get("final") == final
            if entry.get("started") and not exact:
                continue  # its snapshot runs a start command the rest would run under
            raw = entry.get("state") or {}
            hit = CacheHit(template_id, steps, exact, _State(
                user=str(raw.get("user") or tpl.default_user), workdir=raw.get("workdir"),
                env=dict(raw.get("env") or {}), args=dict(raw.get("args") or {})))
            if best is None or (hit.exact, hit.steps) > (best.exact, best.steps):
                best = hit
        return best


def split_name(name: str) -> tuple[str, list[str]]:
    """`name[:tag]` -> (name, [tag])."""
    base, sep, tag = name.rpartition(":")
    if sep and tag and "/" not in tag:
        return base, [tag]
    return name, []


def _new_id(prefix: str) -> str:
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(20 - len(prefix)))


class TemplateBuilds:
    """Build state of one server and the pipeline that runs builds."""

    def __init__(self, config: Config, layout: Layout, manager: SandboxManager,
                 puller: ImagePuller) -> None:
        self.config = config
        self.layout = layout
        self.manager = manager
        self.puller = puller
        self.files_dir = layout.cache_dir / "build-files"
        self.cache = BuildCache(layout.cache_dir / "build-cache.json")
        manager.on_cold_boot = self.start_again
        self.templates: dict[str, BuildTemplate] = {}
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_BUILDS)
        self.ready_timeout_s = READY_TIMEOUT_S

    async def close(self) -> None:
        tasks = [b.task for t in self.templates.values() for b in t.builds
                 if b.task is not None and not b.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---------------------------------------------------------------- templates
    def request(self, name: str, tags: list[str], cpu_count: int | None,
                memory_mb: int | None) -> tuple[BuildTemplate, Build]:
        """`POST /v3/templates`: the template called `name` (a new one, or the one that has
        that name: a rebuild replaces it) and a new build of it, waiting for its steps."""
        alias, name_tags = split_name(name)
        if not _NAME.match(alias):
            raise invalid(f"invalid template name {alias!r}: lowercase letters, digits, "
                          "'.', '_', '-', at most 128")
        tags = [*name_tags, *tags] or ["default"]
        current = self._find(alias)
        if current is None:
            existing = self.manager.store.find_template(alias)
            if existing is not None and existing.image is None:
                raise AenvError(ErrorCode.CONFLICT,
                                f"'{alias}' is a template that was not built ({_kind(existing)}); "
                                "pick another name")
            template_id = existing.template_id if existing is not None else _new_id("")
            current = self.templates.setdefault(template_id, BuildTemplate(
                template_id=template_id, names=[alias], tags=tags, created_at=utcnow()))
        current.tags = tags
        if cpu_count is not None and cpu_count < 1 or memory_mb is not None and memory_mb < 64:
            raise invalid("cpuCount must be >= 1 and memoryMB >= 64")
        defaults = self.config.sandbox
        build = Build(build_id=_new_id("bld"), template_id=current.template_id,
                      cpu_count=cpu_count or defaults.cpu_count,
                      memory_mb=memory_mb or defaults.memory_mb, created_at=utcnow())
        current.builds.append(build)
        finished = [b for b in current.builds[:-1] if b.task is None or b.task.done()]
        for old in finished[:max(0, len(current.builds) - KEEP_BUILDS)]:
            current.builds.remove(old)  # the oldest finished builds (and their logs) go
        return current, build

    def _find(self, id_or_name: str) -> BuildTemplate | None:
        found = self.templates.get(id_or_name)
        if found is not None:
            return found
        return next((t for t in self.templates.values() if id_or_name in t.names), None)

    def template(self, id_or_name: str) -> BuildTemplate:
        """A template known to the build API: requested here, or any stored template."""
        found = self._find(id_or_name)
        if found is not None:
            return found
        tpl = self.manager.find_template(id_or_name)  # not_found when unknown
        return BuildTemplate(template_id=tpl.template_id, names=list(tpl.names),
                             tags=["default"], created_at=tpl.created_at or utcnow())

    def build(self, template_id: str, build_id: str) -> Build:
        tpl = self._find(template_id)
        build = next((b for b in tpl.builds if b.build_id == build_id), None) if tpl else None
        if build is None:
            raise not_found(f"build {build_id} of template {template_id} not found")
        return build

    async def delete(self, id_or_name: str) -> None:
        """Delete a template: cancel its running build, forget its build state and uploaded
        files, delete its stored template (if it was built)."""
        pending = self._find(id_or_name)
        stored = self.manager.store.find_template(id_or_name)
        if pending is None and stored is None:
            raise not_found(f"template '{id_or_name}' not found")
        if pending is not None:
            for build in pending.builds:
                if build.task is not None and not build.task.done():
                    build.task.cancel()
                    with contextlib.suppress(BaseException):
                        await build.task
            self.templates.pop(pending.template_id, None)
            await asyncio.to_thread(shutil.rmtree, self.files_dir / pending.template_id, True)
        if stored is not None and (pending is None or stored.template_id == pending.template_id):
            await self.manager.delete_template(stored.template_id)
            self.cache.forget(stored.template_id)

    # ---------------------------------------------------------------- build context files
    def files_path(self, template_id: str, files_hash: str) -> Path:
        if not _HASH.match(files_hash):
            raise invalid("the files hash must be 64 lowercase hex digits (sha256)")
        self.template(template_id)
        return self.files_dir / template_id / f"{files_hash}.tar"

    async def receive_files(self, template_id: str, files_hash: str,
                            chunks: AsyncIterator[bytes]) -> None:
        path = self.files_path(template_id, files_hash)
        await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        try:
            f = await asyncio.to_thread(tmp.open, "wb")
            try:
                async for chunk in chunks:
                    await asyncio.to_thread(f.write, chunk)
            finally:
                f.close()
            await asyncio.to_thread(tmp.replace, path)
        finally:
            await asyncio.to_thread(tmp.unlink, True)

    # ---------------------------------------------------------------- builds
    def start(self, template_id: str, build_id: str, spec: BuildSpec) -> Build:
        """Start the build in the background. One build per template at a time."""
        build = self.build(template_id, build_id)
        tpl = self.template(template_id)
        if any(b.task is not None and not b.task.done() for b in tpl.builds):
            raise AenvError(ErrorCode.CONFLICT, f"template {template_id} is being built already")
        if build.task is not None:
            raise AenvError(ErrorCode.CONFLICT, f"build {build_id} was started already")
        for i, step in enumerate(spec.steps, 1):
            if step.type not in STEP_TYPES:
                raise invalid(f"step {i}: unknown type {step.type!r} "
                              f"(supported: {', '.join(sorted(STEP_TYPES))})")
        if spec.from_image and spec.from_template:
            raise invalid("give fromImage or fromTemplate, not both")
        build.task = asyncio.create_task(self._run(tpl, build, spec),
                                         name=f"aenv-build-{template_id}-{build_id}")
        return build

    def _log(self, build: Build, message: str, step: str | None = None,
             level: str = "info") -> None:
        if len(build.logs) >= MAX_LOG_ENTRIES:
            build.dropped_logs += 1
            return
        build.logs.append(LogEntry(utcnow(), level, message, step))

    async def _run(self, tpl: BuildTemplate, build: Build, spec: BuildSpec) -> None:
        step = "base"
        try:
            async with self._slots:
                build.status, build.updated_at = "building", utcnow()
                self._log(build, f"Building template {tpl.template_id} ({', '.join(tpl.names)}), "
                          f"build {build.build_id}")

                def at(name: str) -> None:
                    nonlocal step
                    step = name

                await self._pipeline(tpl, build, spec, at)
            build.status = "ready"
            self._log(build, "Build finished: template is ready", "finalize")
        except asyncio.CancelledError:
            self._fail(build, step, "the build was cancelled")
            raise
        except BuildFailed as exc:
            self._fail(build, exc.step, exc.message)
        except AenvError as exc:
            self._fail(build, step, exc.message)
        except Exception as exc:
            log.exception("build %s of %s failed", build.build_id, tpl.template_id)
            self._fail(build, step, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            build.updated_at = build.finished_at = utcnow()

    def _fail(self, build: Build, step: str, message: str) -> None:
        build.status = "error"
        self._log(build, message, step, "error")
        build.reason = {"message": message, "step": step,
                        "logEntries": [log_entry_body(e) for e in build.logs[-REASON_LOG_TAIL:]]}

    async def _base(self, build: Build, spec: BuildSpec) -> TemplateRecord:
        if spec.from_template:
            self._log(build, f"FROM template {spec.from_template}", "base")
            return self.manager.find_template(spec.from_template)
        image = spec.from_image or self.config.sandbox.template
        existing = self.manager.store.find_template(image)
        if existing is not None:
            self._log(build, f"FROM {image} (template {existing.template_id})", "base")
            return existing
        if spec.registry_credentials:
            self._log(build, "fromImageRegistry credentials are not used: the server's "
                      "images.credentials / images.auth_file apply", "base", "warn")
        self._log(build, f"FROM {image}: pulling the image", "base")

        def progress(event: dict[str, Any]) -> None:
            if event.get("type") == "resolved":
                self._log(build, f"resolved {event.get('image')} {event.get('digest')}", "base")
            elif event.get("type") == "layer" and event.get("state") in ("done", "exists"):
                self._log(build, f"layer {str(event.get('digest'))[7:19]}: {event['state']}",
                          "base")

        return await self.puller.pull(image, None, False, progress)

    async def _pipeline(self, tpl: BuildTemplate, build: Build, spec: BuildSpec,
                        at: Callable[[str], None]) -> None:
        base = await self._base(build, spec)
        keys, final = cache_keys(base, spec)
        total = len(spec.steps)
        forced = next((i - 1 for i, step in enumerate(spec.steps, 1) if step.force), total)
        hit = None if spec.force else self.cache.lookup(self.manager.store.find_template, keys,
                                                        final, forced)
        state = _State(user=base.default_user, workdir=base.default_workdir)
        if spec.force:
            self._log(build, "Build cache not used (force)", "base")
        if hit is not None:
            state = hit.state
            for i, step in enumerate(spec.steps[:hit.steps], 1):
                self._log(build, f"CACHED [{i}/{total}] {_describe(step)}", str(i))
            if hit.exact and hit.template_id == tpl.template_id:
                self._log(build, "Nothing changed since the template's last build: it is "
                          "kept as it is", "finalize")
                current = self.manager.find_template(tpl.template_id)
                now = utcnow().isoformat()
                self.manager.store.put_template(replace(current, tags={
                    **current.tags, **{t: now for t in tpl.tags if t != "default"}}))
                return
        timeout = min(BUILD_SANDBOX_TTL_S, self.config.sandbox.max_timeout_s)
        sandbox = await self.manager.create(CreateRequest(
            template=hit.template_id if hit is not None else base.template_id,
            timeout_s=timeout, auto_pause=False,
            metadata={BUILD_METADATA_KEY: f"{tpl.template_id}/{build.build_id}"}))
        self._log(build, f"Build sandbox {sandbox.sandbox_id} started"
                  + (f" from the build cache (template {hit.template_id})" if hit else ""),
                  "base")
        envd = SandboxEnvd(self.manager.open_port, sandbox.sandbox_id, sandbox.envd_access_token,
                           self.config.sandbox.envd_port)
        try:
            for i, step in enumerate(spec.steps, 1):
                if hit is not None and i <= hit.steps:
                    continue
                at(str(i))
                self._log(build, f"[{i}/{total}] {_describe(step)}", str(i))
                await self._step(build, envd, state, step, str(i))
            at("finalize")
            if hit is not None and hit.exact:
                pass  # the snapshot it starts from runs the start command already
            elif spec.start_cmd:
                self._log(build, f"Start command: {spec.start_cmd}", "finalize")
                await envd.start(spec.start_cmd, user=state.user, cwd=state.workdir,
                                 envs=state.env)
            if spec.ready_cmd and not (hit is not None and hit.exact):
                await self._wait_ready(build, envd, state, spec.ready_cmd)
            self._log(build, "Snapshotting the build sandbox", "finalize")
            snap = await self.manager.snapshot(sandbox.sandbox_id, None)
            try:
                installed = await self._install(tpl, replace(
                    snap, start_cmd=spec.start_cmd, ready_cmd=spec.ready_cmd), base, state,
                    build)
                self.cache.put(installed, keys, final, state, bool(spec.start_cmd))
            except BaseException:
                if self.manager.store.find_template(snap.template_id) is not None:
                    with contextlib.suppress(AenvError):
                        await self.manager.delete_template(snap.template_id)
                raise
        finally:
            await envd.aclose()
            with contextlib.suppress(AenvError):
                await self.manager.kill(sandbox.sandbox_id)

    async def start_again(self, rec: SandboxRecord) -> None:
        """A sandbox of a built template booted afresh (a resume without memory): its start
        command runs again, and its ready command is polled (`COLD_READY_TIMEOUT_S` at most)."""
        tpl = self.manager.store.find_template(rec.template_id)
        if tpl is None or not tpl.start_cmd:
            return
        envd = SandboxEnvd(self.manager.open_port, rec.sandbox_id, rec.envd_access_token,
                           self.config.sandbox.envd_port)
        try:
            await envd.start(tpl.start_cmd, user=tpl.default_user, cwd=tpl.default_workdir,
                             envs=tpl.env_vars)
            if not tpl.ready_cmd:
                return
            loop = asyncio.get_running_loop()
            deadline = loop.time() + COLD_READY_TIMEOUT_S
            while await envd.run(tpl.ready_cmd, user=tpl.default_user, cwd=tpl.default_workdir,
                                 envs=tpl.env_vars, timeout_s=READY_CHECK_TIMEOUT_S) != 0:
                if loop.time() >= deadline:
                    raise AenvError(ErrorCode.TIMEOUT, "the ready command did not succeed "
                                    f"within {COLD_READY_TIMEOUT_S:.0f}s: {tpl.ready_cmd}")
                await asyncio.sleep(READY_INTERVAL_S)
        finally:
            await envd.aclose()

    async def _wait_ready(self, build: Build, envd: SandboxEnvd, state: _State,
                          ready_cmd: str) -> None:
        self._log(build, f"Waiting for the ready command: {ready_cmd}", "finalize")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ready_timeout_s
        last: list[str] = []
        while True:
            last.clear()
            code = await envd.run(ready_cmd, user=state.user, cwd=state.workdir, envs=state.env,
                                  timeout_s=READY_CHECK_TIMEOUT_S,
                                  output=lambda _s, line: last.append(line))
            if code == 0:
                self._log(build, "Ready command succeeded", "finalize")
                return
            if loop.time() >= deadline:
                for line in last[-REASON_LOG_TAIL:]:
                    self._log(build, line, "finalize")
                raise BuildFailed("finalize", f"the ready command did not succeed within "
                                  f"{self.ready_timeout_s:.0f}s (last exit code {code}): "
                                  f"{ready_cmd}")
            await asyncio.sleep(READY_INTERVAL_S)

    async def _root(self, envd: SandboxEnvd, cmd: str, step: str) -> list[str]:
        """Run a helper command as root; its output lines. Fails the step on a non-zero exit."""
        out: list[str] = []
        code = await envd.run(cmd, user="root", output=lambda _s, line: out.append(line),
                              timeout_s=600)
        if code != 0:
            raise BuildFailed(step, f"{cmd!r} failed with exit code {code}: " + " | ".join(out[-5:]))
        return out

    async def _step(self, build: Build, envd: SandboxEnvd, state: _State, step: Step,
                    name: str) -> None:
        args = step.args
        if step.type == "RUN":
            if not args or not args[0].strip():
                raise BuildFailed(name, "RUN needs a command")
            user = args[1] if len(args) > 1 and args[1] else state.user
            code = await envd.run(args[0], user=user, cwd=state.workdir, envs=state.run_env(),
                                  output=lambda _s, line: self._log(build, line, name))
            if code != 0:
                raise BuildFailed(name, f"RUN failed with exit code {code}: {args[0]}")
        elif step.type in ("ENV", "ARG"):
            pairs = _pairs(args, step.type == "ARG")
            if pairs is None:
                raise BuildFailed(name, f"{step.type} needs KEY VALUE pairs, got {args}")
            (state.env if step.type == "ENV" else state.args).update(pairs)
        elif step.type == "WORKDIR":
            if len(args) != 1 or not args[0]:
                raise BuildFailed(name, "WORKDIR needs one path")
            path = posixpath.normpath(posixpath.join(state.workdir or _home(state.user), args[0]))
            q, u = shlex.quote(path), shlex.quote(state.user)
            await self._root(envd, f"[ -d {q} ] || {{ mkdir -p {q} && "
                             f"chown {u}:$(id -g {u}) {q}; }}", name)
            state.workdir = path
        elif step.type == "USER":
            if len(args) != 1 or not args[0]:
                raise BuildFailed(name, "USER needs one user name")
            user = args[0].split(":", 1)[0]
            await self._root(envd, f"id -u {shlex.quote(user)}", name)
            state.user = user
        else:  # COPY, ADD
            await self._copy(build, envd, state, step, name)

    async def _copy(self, build: Build, envd: SandboxEnvd, state: _State, step: Step,
                    name: str) -> None:
        args = step.args
        if len(args) < 2 or not args[0] or not args[1]:
            raise BuildFailed(name, f"{step.type} needs a source and a destination")
        src, dest = args[0], args[1]
        if src.startswith(("http://", "https://")):
            raise BuildFailed(name, f"{step.type} from a URL is not supported: {src}")
        if step.files_hash is None:
            raise BuildFailed(name, f"{step.type} {src}: filesHash is missing")
        archive = self.files_path(build.template_id, step.files_hash)
        if not archive.exists():
            raise BuildFailed(name, f"{step.type} {src}: its files were not uploaded "
                              f"(GET /templates/{build.template_id}/files/{step.files_hash})")
        owner_spec = args[2] if len(args) > 2 and args[2] else state.user
        user, _, group = owner_spec.partition(":")
        mode = None
        if len(args) > 3 and args[3]:
            try:
                mode = int(args[3], 8)
            except ValueError:
                raise BuildFailed(name, f"invalid mode {args[3]!r} (octal)") from None
        if not dest.startswith("/"):
            dest = posixpath.normpath(posixpath.join(state.workdir or _home(state.user), dest)
                                      ) + ("/" if dest in (".", "..") or dest.endswith(
                                          ("/", "/.", "/..")) else "")
        uq, gq = shlex.quote(user), shlex.quote(group or user)
        ids = await self._root(envd, f"id -u {uq} && " + (
            f"getent group {gq} | cut -d: -f3 && echo {gq}" if group else
            f"id -g {uq} && id -gn {uq}") + f" && {{ [ -d {shlex.quote(dest)} ] && echo dir "
            "|| echo other; }", name)
        try:
            owner = Owner(int(ids[0]), int(ids[1]), user, ids[2])
        except (IndexError, ValueError):
            raise BuildFailed(name, f"cannot resolve the owner {owner_spec!r}") from None
        dest_is_dir = ids[-1] == "dir"
        out = archive.with_name(f".place-{secrets.token_hex(6)}.tar")
        remote = f"/tmp/.aenv-build-{secrets.token_hex(6)}.tar"
        try:
            count = await asyncio.to_thread(place, archive, out, src, dest, dest_is_dir, owner,
                                            mode, step.type == "ADD")
            await envd.upload(out, remote)
        except AenvError as exc:
            raise BuildFailed(name, f"{step.type} {src}: {exc.message}") from None
        finally:
            await asyncio.to_thread(out.unlink, True)
        rq = shlex.quote(remote)
        try:
            await self._root(envd, f"tar -xpf {rq} -C /", name)
        finally:
            with contextlib.suppress(AenvError):
                await envd.run(f"rm -f {rq}", user="root")
        self._log(build, f"copied {count} entries to {dest}", name)

    async def _install(self, tpl: BuildTemplate, snap: TemplateRecord, base: TemplateRecord,
                       state: _State, build: Build) -> TemplateRecord:
        """Store the snapshot as the template (replacing a previous build of it)."""
        store = self.manager.store
        now = utcnow()
        old = store.find_template(tpl.template_id)
        final = replace(snap, template_id=tpl.template_id, names=list(tpl.names),
                        default_user=state.user, default_workdir=state.workdir,
                        env_vars={**base.env_vars, **state.env}, source_sandbox=None,
                        created_at=now, public=old.public if old is not None else False,
                        # the build's tags: those of the build it replaces go with it
                        tags={t: now.isoformat() for t in tpl.tags if t != "default"})
        # No await between these: nobody sees the template missing or both at once.
        store.delete_template(snap.template_id)
        retired = None
        if old is not None and old.template_id == tpl.template_id:
            store.delete_template(old.template_id)
            if old.image is not None:
                retired = replace(old, template_id=_new_id("old"), names=[])
                store.put_template(retired)
        store.put_template(final)
        if retired is not None:  # its image and sealed layers go (sandboxes keep theirs)
            await self.manager.delete_template(retired.template_id)
        self._log(build, f"Template {tpl.template_id} stored (snapshot of the build sandbox, "
                  f"{(snap.size_bytes or 0) / 1e6:.1f} MB)", "finalize")
        return final


def _pairs(args: list[str], allow_bare: bool) -> dict[str, str] | None:
    """ENV/ARG arguments: [K, V, K, V, ...] (the SDK) or [K=V, ...]; ARG also [K]."""
    if all("=" in a for a in args) and args:
        return dict(a.split("=", 1) for a in args)
    if allow_bare and len(args) == 1:
        return {args[0]: ""}
    if len(args) % 2 or not args:
        return None
    return {args[i]: args[i + 1] for i in range(0, len(args), 2)}


def _describe(step: Step) -> str:
    args = step.args
    if step.type == "RUN" and len(args) > 1 and args[1]:
        return f"RUN (as {args[1]}) {args[0]}"
    if step.type in ("COPY", "ADD") and len(args) >= 2:
        extra = [f"--chown={args[2]}"] if len(args) > 2 and args[2] else []
        extra += [f"--chmod={args[3]}"] if len(args) > 3 and args[3] else []
        return " ".join([step.type, *extra, args[0], args[1]])
    if step.type == "ENV" and len(args) % 2 == 0 and not any("=" in a for a in args[::2]):
        return "ENV " + " ".join(f"{args[i]}={args[i + 1]}" for i in range(0, len(args), 2))
    return " ".join([step.type, *args])


def _home(user: str) -> str:
    return "/root" if user == "root" else f"/home/{user}"


def _kind(tpl: TemplateRecord) -> str:
    return "an image pull" if tpl.source_image else "the base template"


def log_entry_body(entry: LogEntry) -> dict[str, Any]:
    body: dict[str, Any] = {"timestamp": entry.timestamp.isoformat().replace("+00:00", "Z"),
                            "level": entry.level, "message": entry.message}
    if entry.step is not None:
        body["step"] = entry.step
    return body
