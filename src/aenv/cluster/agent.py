"""The node agent: what `aenv serve --cluster URL --advertise URL` adds to a node.

Runs in the node's process and event loop, beside its `SandboxManager`, which it uses only
through public methods. Every `HEARTBEAT_S` it:
- keeps its lease alive (a new one and a new registration if it had expired) and writes
  `nodes/<id>` under it: status (`draining` while `drain/<id>` exists), capacity, usage,
  templates held;
- reconciles its roster with etcd, as upstream's heartbeat does: a binding `sandboxes/<id>`
  for each of its sandboxes (state and listed fields), removed when the sandbox is gone;
  `paused/<id>` (the whole record, and whether its paused state is in the repository yet)
  for each paused one, so that another node can resume it if this one dies; a paused copy
  whose binding names another node (it was resumed there while this node was away) is
  dropped here;
- publishes its snapshot templates that are in the repository (`templates/<id>`);
- removes the sandboxes `evict/<id>/` names (lost ones deleted while it was dead).
A create that names a template this node lacks imports it from that catalog first (the
manager's `template_provider` hook). `adopt()` (`POST /aenv/cluster/adopt/{id}`) takes over a
paused sandbox of a dead or draining node.

`ClusterNodeApp` wraps the node's ASGI app: it starts the agent once the node is up, stops it
first on shutdown, and serves the adopt route (API key checked). Owns: this node's keys in
etcd. Must not touch: the node's records except through the manager; other nodes' keys, except
the binding and paused record of a sandbox it adopts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import re
import secrets
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aenv.api.errors import error_response, from_aenv_error
from aenv.api.schemas import listed_body
from aenv.cluster import keys
from aenv.cluster.etcd import Etcd, KeyValue, encode
from aenv.errors import AenvError, ErrorCode, not_found
from aenv.orchestrator.manager import SandboxManager
from aenv.orchestrator.models import ListQuery, SandboxRecord, SandboxState
from aenv.orchestrator.paused import entry_name
from aenv.runtime.base import PausedStateDriver, RuntimeHandle

log = logging.getLogger("aenv.cluster")

NODE_ID_FILE = "cluster-node-id"
IMPORTED_FILE = "cluster-imported.json"  # templates this node copied from the catalog
_ADOPT_RE = re.compile(r"^/aenv/cluster/adopt/([A-Za-z0-9]+)$")


def node_id_for(home: Path, given: str | None) -> str:
    """The node's id: `given`, else the one kept in its home (made on first use)."""
    path = home / NODE_ID_FILE
    if given:
        return given
    with contextlib.suppress(FileNotFoundError):
        existing = path.read_text().strip()
        if existing:
            return existing
    node_id = "n" + secrets.token_hex(4)
    path.write_text(node_id + "\n")
    return node_id


def relocate(rec: SandboxRecord, workspace: Path) -> SandboxRecord:
    """`rec` as this node keeps it: paths of its handle inside the old node's workspace
    moved to `workspace` (the paused state is pulled back there)."""
    old = rec.handle.get("workspace")
    if not isinstance(old, str) or not old:
        return rec

    def move(value: Any) -> Any:
        if isinstance(value, str) and (value == old or value.startswith(old + "/")):
            return str(workspace) + value[len(old):]
        return value

    return replace(rec, handle={k: move(v) for k, v in rec.handle.items()})


def _memory_mb() -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 0


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


class NodeAgent:
    def __init__(self, manager: SandboxManager, etcd: Etcd, node_id: str, advertise: str,
                 heartbeat_s: float = keys.HEARTBEAT_S, lease_s: int = keys.NODE_LEASE_S
                 ) -> None:
        self.manager = manager
        self.etcd = etcd
        self.node_id = node_id
        self.url = advertise.rstrip("/")
        self.heartbeat_s = heartbeat_s
        self.lease_s = lease_s
        self.lease = 0
        self.started_at = _now()
        self._task: asyncio.Task[None] | None = None
        self._status = "ready"
        self._adopting: set[str] = set()
        self._chained_provider: Callable[[str], Awaitable[None]] | None = None

    # ------------------------------------------------------------------ lifetime
    async def start(self) -> None:
        # Templates another node published are imported when a create names them.
        self._chained_provider = self.manager.template_provider
        self.manager.template_provider = self._provide_template
        self._task = asyncio.create_task(self._run(), name="aenv-cluster-agent")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.lease:
            # Leaving on purpose: no need to wait for the lease to run out. Bindings stay:
            # the node's sandboxes are still its own when it comes back.
            with contextlib.suppress(AenvError):
                await self.etcd.revoke(self.lease)
            self.lease = 0
        await self.etcd.close()

    async def _run(self) -> None:
        while True:
            try:
                await self.heartbeat()
            except AenvError as exc:
                log.warning("cluster heartbeat failed: %s", exc.message)
            except Exception:  # keep heartbeating whatever one pass hit
                log.exception("cluster heartbeat failed")
            await asyncio.sleep(self.heartbeat_s)

    # ------------------------------------------------------------------ heartbeat
    async def heartbeat(self) -> None:
        await self._keep_lease()
        drain = await self.etcd.get(keys.DRAIN + self.node_id)
        self._status = "draining" if drain is not None else "ready"
        records = self._roster()
        await self.etcd.put(keys.node_key(self.node_id), encode(self.info(records).to_json()),
                            lease=self.lease)
        await self._evict()
        await self._sync_sandboxes()
        await self._publish_templates()

    async def _evict(self) -> None:
        """Remove sandboxes deleted through a gateway while this node was dead (lost)."""
        prefix = keys.EVICT + self.node_id + "/"
        for kv in await self.etcd.get_prefix(prefix):
            sid = keys.tail(kv.key, prefix)
            with contextlib.suppress(AenvError):  # gone already
                await self.manager.kill(sid)
                log.info("sandbox %s: removed (deleted while this node was away)", sid)
            await self.etcd.delete(kv.key)

    async def _keep_lease(self) -> None:
        if self.lease and await self.etcd.keepalive(self.lease) > 0:
            return
        if self.lease:
            log.warning("cluster lease of node %s had expired: registering again", self.node_id)
        self.lease = await self.etcd.grant(self.lease_s)
        await self.etcd.put(keys.MEMBERS + self.node_id,
                            encode({"nodeID": self.node_id, "url": self.url}))
        log.info("node %s registered in the cluster as %s (lease %d s)", self.node_id,
                 self.url, self.lease_s)

    def _roster(self) -> list[SandboxRecord]:
        out: list[SandboxRecord] = []
        token: str | None = None
        while True:
            page, token = self.manager.list_sandboxes(ListQuery(limit=1000, next_token=token))
            out += page
            if token is None:
                return out

    def info(self, records: list[SandboxRecord]) -> keys.NodeInfo:
        running = [r for r in records if r.state is SandboxState.RUNNING]
        held: set[str] = set()
        for tpl in self.manager.store.iter_templates():
            held.add(tpl.template_id)
            held.update(tpl.names)
        try:
            disk_free = shutil.disk_usage(self.manager.layout.home).free // 2**20
        except OSError:
            disk_free = 0
        return keys.NodeInfo(
            node_id=self.node_id, url=self.url, status=self._status,
            cpus=os.cpu_count() or 1, memory_mb=_memory_mb(), disk_free_mb=disk_free,
            max_sandboxes=self.manager.config.sandbox.max_sandboxes,
            allocated_cpu=sum(r.cpu_count for r in running),
            allocated_memory_mb=sum(r.memory_mb for r in running),
            load=round(os.getloadavg()[0], 2), running=len(running),
            paused=len(records) - len(running), templates=sorted(held),
            started_at=self.started_at, heartbeat_at=_now())

    async def _sync_sandboxes(self) -> None:
        # Bindings first, then the roster: a sandbox bound after this read was on the
        # roster already when it was bound, so it is never taken for one that is gone.
        bindings = {keys.tail(kv.key, keys.SANDBOXES): kv
                    for kv in await self.etcd.get_prefix(keys.SANDBOXES)}
        paused_kvs = {keys.tail(kv.key, keys.PAUSED): kv
                      for kv in await self.etcd.get_prefix(keys.PAUSED)}
        local = {r.sandbox_id: r for r in self._roster()}
        for sid, rec in local.items():
            if sid in self._adopting:
                continue
            kv = bindings.get(sid)
            current = keys.Binding.from_json(kv.json()) if kv is not None else None
            if current is not None and current.node_id != self.node_id:
                await self._drop_moved(rec, current.node_id)
                continue
            wanted = keys.Binding(self.node_id, rec.state.api_state, listed_body(rec),
                                  rec.envd_access_token).to_json()
            if current is None or current.to_json() != wanted:
                await self.etcd.put(keys.sandbox_key(sid), encode(wanted))
            if rec.state is SandboxState.PAUSED:
                await self._publish_paused(rec, paused_kvs.get(sid))
        for sid, kv in bindings.items():
            if sid not in local and sid not in self._adopting and \
                    keys.Binding.from_json(kv.json()).node_id == self.node_id:
                await self.etcd.delete_if(kv.key, kv.mod_revision)
        for sid, kv in paused_kvs.items():
            held = local.get(sid)
            if (held is None or held.state is not SandboxState.PAUSED) and \
                    sid not in self._adopting and kv.json().get("node") == self.node_id:
                await self.etcd.delete_if(kv.key, kv.mod_revision)

    async def _drop_moved(self, rec: SandboxRecord, owner: str) -> None:
        if rec.state is not SandboxState.PAUSED:
            log.warning("sandbox %s runs here but is bound to node %s", rec.sandbox_id, owner)
            return
        log.info("sandbox %s was resumed on node %s while this node was away: dropping the "
                 "paused copy here", rec.sandbox_id, owner)
        with contextlib.suppress(AenvError):  # not kill(): the repository's copy is theirs now
            await self.manager.drop_moved(rec.sandbox_id)

    async def _in_repository(self, rec: SandboxRecord) -> bool:
        snapshots = self.manager.snapshots
        if snapshots is None:
            return False
        try:
            driver = await self.manager.runtime(rec.runtime)
        except AenvError:
            return False
        if not isinstance(driver, PausedStateDriver):
            return False
        try:
            names = driver.paused_state(RuntimeHandle(rec.runtime, rec.sandbox_id, rec.handle))
        except AenvError:
            return False
        for name in names:
            if not await snapshots.repository.exists(entry_name(rec.sandbox_id, name)):
                return False
        return True

    async def _publish_paused(self, rec: SandboxRecord, kv: KeyValue | None) -> None:
        record = keys.record_to_json(rec)
        previous = kv.json() if kv is not None else {}
        if previous.get("node") == self.node_id and previous.get("record") == record and \
                previous.get("inRepository"):
            return
        in_repository = await self._in_repository(rec)
        value = {"node": self.node_id, "record": record, "inRepository": in_repository}
        if value != previous:
            await self.etcd.put(keys.paused_key(rec.sandbox_id), encode(value))

    async def _publish_templates(self) -> None:
        published = {keys.tail(kv.key, keys.TEMPLATES): kv
                     for kv in await self.etcd.get_prefix(keys.TEMPLATES)}
        local: set[str] = set()
        imported = self._imported()
        for tpl in self.manager.store.iter_templates():
            if tpl.image is None or tpl.image.startswith("/") or not tpl.in_repository or \
                    tpl.template_id in imported:
                continue  # only our own snapshots whose image and layers any node can pull
            local.add(tpl.template_id)
            if tpl.template_id not in published:
                value = {"node": self.node_id, "template": keys.template_to_json(tpl)}
                await self.etcd.create(keys.template_key(tpl.template_id), encode(value))
        for tid, kv in published.items():
            if tid not in local and kv.json().get("node") == self.node_id:
                await self.etcd.delete_if(kv.key, kv.mod_revision)
        # Imported templates whose origin deleted them go here too (sandboxes made from
        # them keep running, as on their node).
        gone = [tid for tid in imported if tid not in published]
        for tid in gone:
            with contextlib.suppress(AenvError):
                await self.manager.delete_template(tid)
                log.info("template %s: deleted (its node deleted it)", tid)
        if gone:
            self._save_imported(imported - set(gone))

    def _imported(self) -> set[str]:
        try:
            return set(json.loads((self.manager.layout.home / IMPORTED_FILE).read_text()))
        except (OSError, ValueError):
            return set()

    def _save_imported(self, ids: set[str]) -> None:
        path = self.manager.layout.home / IMPORTED_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(sorted(ids)))
        os.replace(tmp, path)

    async def _provide_template(self, name: str) -> None:
        if self.manager.store.find_template(name) is None:
            await self.import_template(name)
        if self._chained_provider is not None:
            await self._chained_provider(name)

    async def import_template(self, id_or_name: str) -> bool:
        """Copy a snapshot template published by another node into this node's store."""
        try:
            kv = await self.etcd.get(keys.template_key(id_or_name))
            candidates = [kv] if kv is not None else await self.etcd.get_prefix(keys.TEMPLATES)
        except AenvError as exc:
            log.warning("template %s: the cluster catalog is unavailable: %s", id_or_name,
                        exc.message)
            return False
        for cand in candidates:
            if cand is None:
                continue
            tpl = keys.template_from_json(cand.json()["template"])
            if tpl.template_id == id_or_name or id_or_name in tpl.names:
                if self.manager.store.find_template(tpl.template_id) is None:
                    self._save_imported(self._imported() | {tpl.template_id})
                    self.manager.store.put_template(tpl)
                    log.info("template %s imported from the cluster catalog (node %s)",
                             tpl.template_id, cand.json().get("node"))
                return True
        return False

    # ------------------------------------------------------------------ adoption
    async def adopt(self, sandbox_id: str) -> SandboxRecord:
        """Take over paused sandbox `sandbox_id` of a dead or draining node."""
        if sandbox_id in self._adopting:
            raise AenvError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} is being adopted")
        self._adopting.add(sandbox_id)
        try:
            return await self._adopt(sandbox_id)
        finally:
            self._adopting.discard(sandbox_id)

    async def _adopt(self, sandbox_id: str) -> SandboxRecord:
        binding_kv = await self.etcd.get(keys.sandbox_key(sandbox_id))
        paused_kv = await self.etcd.get(keys.paused_key(sandbox_id))
        if binding_kv is None or paused_kv is None:
            raise not_found(f"sandbox {sandbox_id}: no paused sandbox of that id in the cluster")
        binding = keys.Binding.from_json(binding_kv.json())
        if binding.node_id == self.node_id:
            return self.manager.get(sandbox_id)
        owner = await self.etcd.get(keys.node_key(binding.node_id))
        if owner is not None and keys.NodeInfo.from_json(owner.json()).status == "ready":
            raise AenvError(ErrorCode.CONFLICT, f"sandbox {sandbox_id}: its node "
                            f"{binding.node_id} is alive; it resumes there")
        paused = paused_kv.json()
        if not paused.get("inRepository"):
            raise AenvError(ErrorCode.UNAVAILABLE,
                            f"sandbox {sandbox_id}: its paused state had not reached the "
                            f"repository when node {binding.node_id} went away; it resumes "
                            "when that node is back")
        rec = relocate(keys.record_from_json(paused["record"]),
                       self.manager.layout.workspace(sandbox_id))
        if self.manager.store.find_template(rec.template_id) is None:
            await self.import_template(rec.template_id)
        mine = keys.Binding(self.node_id, "paused", listed_body(rec),
                            rec.envd_access_token).to_json()
        if not await self.etcd.replace(binding_kv.key, encode(mine), binding_kv.mod_revision):
            raise AenvError(ErrorCode.CONFLICT,
                            f"sandbox {sandbox_id} was adopted by another node meanwhile")
        try:
            adopted = await self.manager.adopt_paused(rec)
        except BaseException:
            # Give it back to its previous owner: another node (or that one) may take it.
            with contextlib.suppress(AenvError):
                kv = await self.etcd.get(binding_kv.key)
                if kv is not None and keys.Binding.from_json(kv.json()).node_id == self.node_id:
                    await self.etcd.replace(kv.key, binding_kv.value, kv.mod_revision)
            raise
        await self.etcd.put(paused_kv.key, encode({**paused, "node": self.node_id,
                                                   "record": keys.record_to_json(adopted)}))
        log.info("sandbox %s adopted from node %s", sandbox_id, binding.node_id)
        return adopted


class ClusterNodeApp:
    """The node's ASGI app with the agent attached (lifespan) and its one route."""

    def __init__(self, app: ASGIApp, agent: NodeAgent, api_key: str) -> None:
        self.app = app
        self.agent = agent
        self.api_key = api_key.encode()
        # What uvicorn's upgrade protocol (api/upgrade.py) reads off the application.
        self.tunnels = getattr(app, "tunnels", None)
        self.domain = getattr(app, "domain", None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        match = _ADOPT_RE.match(scope["path"]) if scope["type"] == "http" else None
        if match is None or any(k == b"e2b-sandbox-id" for k, _ in scope["headers"]):
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-api-key"), b"")
        if not hmac.compare_digest(given, self.api_key):
            await error_response(401, "invalid API key: send X-API-Key")(scope, receive, send)
            return
        if scope["method"] != "POST":
            await error_response(405, "use POST")(scope, receive, send)
            return
        try:
            rec = await self.agent.adopt(match.group(1))
        except AenvError as exc:
            await from_aenv_error(exc)(scope, receive, send)
            return
        await JSONResponse({"sandboxID": rec.sandbox_id, "nodeID": self.agent.node_id,
                            "state": rec.state.api_state})(scope, receive, send)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def wrapped_send(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                await self.agent.start()
            await send(message)

        async def wrapped_receive() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self.agent.stop()
            return message

        await self.app(scope, wrapped_receive, wrapped_send)


def advertise_url(advertise: str | None, listen: str) -> str:
    """The URL gateways reach this node at: `--advertise`, else `--listen` when that names
    an address others can use."""
    if advertise:
        return advertise.rstrip("/")
    host = listen.rpartition(":")[0].strip("[]")
    if host in ("0.0.0.0", "::", ""):
        raise AenvError(ErrorCode.INVALID_ARGUMENT,
                        f"--cluster with --listen {listen} needs --advertise URL (the address "
                        "gateways reach this node at)")
    return f"http://{listen}"


def attach(app: ASGIApp, manager: SandboxManager, api_key: str, etcd_url: str,
           advertise: str | None, listen: str, node_id: str | None = None) -> ClusterNodeApp:
    """What `aenv serve --cluster` does to the node's application."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per etcd request
    agent = NodeAgent(manager, Etcd(etcd_url), node_id_for(manager.layout.home, node_id),
                      advertise_url(advertise, listen))
    return ClusterNodeApp(app, agent, api_key)
