"""`aenv gateway --etcd URL [--listen HOST:PORT]`: the cluster's one E2B endpoint.

Stateless (any number of replicas): everything it knows is in etcd, read through a cache of
at most `CACHE_S`.
- **Sandbox traffic** (`E2b-Sandbox-Id`/`-Port` headers, a `<port>-<id>.<domain>` host, or
  a signed `/files` URL, by the envd tokens the bindings carry; HTTP and upgrades) goes to
  the owning node, whose own proxy takes it into the sandbox. The
  node's proxy code does it here too: `SandboxProxy` and `TunnelRegistry` (api/proxy.py,
  api/upgrade.py) run over `NodeConnector`, which opens a TCP connection to the node that
  owns the sandbox instead of a socket inside the sandbox. The sandbox headers are added for
  host-routed requests, since the node routes by them.
- **Control plane**, API key checked here (the nodes share it, and it is forwarded): a create
  asks the scheduler for a node (any replica; placement is computed here from etcd when no
  scheduler answers) and tries another when a node answers 429/503 or is unreachable;
  operations on a sandbox go to its node; `GET /sandboxes` and `/v2/sandboxes` merge every
  live node's answer (same filters, pagination by one cursor over (startedAt, sandboxID)), and
  name missing nodes in `X-Aenv-Missing-Nodes` instead of failing.
- **Failures**: a sandbox bound to a dead node (no lease) is, if it was paused, resumed on
  another node (`POST /aenv/cluster/adopt/{id}` there, then the connect), and listed as
  paused meanwhile; if it was running, it is lost: `GET` answers 404 with `state: lost` and
  the node, lists leave it out and count it in `X-Aenv-Lost-Sandboxes`.
- `GET /nodes`, `GET /nodes/{id}` (ready / draining / unhealthy), `POST|DELETE
  /nodes/{id}/drain`; the sandbox detail carries `nodeID`.

Owns: nothing durable but the bindings it writes right after a create or fork (the owning
node's agent rewrites them) and drain keys. Must not touch: sandbox records (nodes own them).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from aenv.api.app import ApiKeyAuth
from aenv.api.errors import CrashAnswer
from aenv.api.proxy import SandboxProxy, Target, route_by_headers, route_by_signature
from aenv.api.upgrade import TunnelingHttpToolsProtocol, TunnelRegistry
from aenv.cluster import keys, placement
from aenv.cluster.etcd import Etcd, encode
from aenv.cluster.serving import health_response, json_body, on_aenv_error
from aenv.errors import AenvError, ErrorCode, invalid, not_found
from aenv.orchestrator.manager import SandboxManager
from aenv.orchestrator.models import SandboxRecord

log = logging.getLogger("aenv.cluster")

CACHE_S = 1.0
PROBE_CACHE_S = 2.0
DIRECTORY_TIMEOUT_S = 1.0  # the directory's etcd reads (~2 ms when etcd is well)
ETCD_BACKOFF_S = 3.0
PROBE_TIMEOUT_S = 1.0
CONNECT_TIMEOUT_S = 3.0
CONTROL_TIMEOUT_S = 600.0  # a fork of 100 or a cross-node resume of a big sandbox
CREATE_ATTEMPTS = 4
MISSING_HEADER = "X-Aenv-Missing-Nodes"
LOST_HEADER = "X-Aenv-Lost-Sandboxes"
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                  "host", "content-length", "proxy-authorization", "expect"})
_RELAYED = ("content-type", "x-next-token", "cache-control")


def cursor(listed: dict[str, Any]) -> str:
    """The nodes' list cursor (orchestrator.manager: [started_at isoformat, id], base64url)
    for a listed sandbox: one token pages every node at once."""
    started = str(listed.get("startedAt", "")).replace("Z", "+00:00")
    raw = json.dumps([started, listed.get("sandboxID", "")]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _sort_key(listed: dict[str, Any]) -> tuple[str, str]:
    return str(listed.get("startedAt", "")).replace("Z", "+00:00"), str(listed.get("sandboxID"))


@dataclass
class Owner:
    binding: keys.Binding
    node: keys.NodeInfo | None  # None: the node is dead (no lease)


class Directory:
    """Bindings and live nodes, read from etcd and cached for CACHE_S (used beyond that
    while etcd does not answer: traffic to known sandboxes goes on through an outage)."""

    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd
        self._nodes: tuple[float, dict[str, keys.NodeInfo]] | None = None
        self._bindings: dict[str, tuple[float, keys.Binding]] = {}
        self._tokens: tuple[float, list[tuple[str, str]]] | None = None
        self._probes: dict[str, tuple[float, keys.NodeInfo | None]] = {}
        self._away_until = 0.0  # after a failed read, stale answers until then
        self._http = httpx.AsyncClient(timeout=PROBE_TIMEOUT_S, trust_env=False)

    async def close(self) -> None:
        await self._http.aclose()
        await self.etcd.close()

    def _etcd_away(self) -> bool:
        return time.monotonic() < self._away_until

    def _failed(self) -> None:
        self._away_until = time.monotonic() + ETCD_BACKOFF_S

    async def reachable(self, node_id: str) -> keys.NodeInfo | None:
        """A node with no lease that still answers (its lease ran out while etcd was away,
        or it lost etcd and not us) serves its sandboxes still, and nothing moves off it:
        dead is no lease *and* no answer. Probed at most every PROBE_CACHE_S."""
        now = time.monotonic()
        cached = self._probes.get(node_id)
        if cached is not None and now - cached[0] < PROBE_CACHE_S:
            return cached[1]
        info = None
        member = await self.etcd.get(keys.MEMBERS + node_id)
        if member is not None:
            url = str(member.json().get("url", ""))
            with contextlib.suppress(httpx.HTTPError):
                if (await self._http.get(url + "/health")).status_code in (200, 204):
                    info = keys.NodeInfo(node_id=node_id, url=url, status="unhealthy")
        self._probes[node_id] = (now, info)
        return info

    async def nodes(self, fresh: bool = False) -> dict[str, keys.NodeInfo]:
        now = time.monotonic()
        if self._nodes is not None and self._etcd_away():
            return self._nodes[1]
        if fresh or self._nodes is None or now - self._nodes[0] > CACHE_S:
            try:
                kvs = await self.etcd.get_prefix(keys.NODES)
            except AenvError:
                self._failed()
                if self._nodes is None:
                    raise
                return self._nodes[1]  # etcd away: what we knew, so known sandboxes serve on
            nodes = {n.node_id: n for n in (keys.NodeInfo.from_json(kv.json()) for kv in kvs)}
            self._nodes = (now, nodes)
        return self._nodes[1]

    async def owner(self, sandbox_id: str, fresh: bool = False) -> Owner | None:
        now = time.monotonic()
        cached = self._bindings.get(sandbox_id)
        if cached is not None and self._etcd_away():
            return Owner(cached[1], (await self.nodes()).get(cached[1].node_id))
        if fresh or cached is None or now - cached[0] > CACHE_S:
            try:
                kv = await self.etcd.get(keys.sandbox_key(sandbox_id))
            except AenvError:
                self._failed()
                if cached is None:
                    raise
                return Owner(cached[1], (await self.nodes()).get(cached[1].node_id))
            if kv is None:
                self._bindings.pop(sandbox_id, None)
                return None
            cached = (now, keys.Binding.from_json(kv.json()))
            self._bindings[sandbox_id] = cached
            if len(self._bindings) > 100_000:
                self._bindings.clear()
        binding = cached[1]
        node = (await self.nodes(fresh)).get(binding.node_id)
        return Owner(binding, node or await self.reachable(binding.node_id))

    async def tokens(self) -> list[tuple[str, str]]:
        """(sandbox, envd token) of every sandbox bound to a live node: a signed `/files`
        URL names its sandbox only through a signature made with that token."""
        now = time.monotonic()
        if self._tokens is None or now - self._tokens[0] > CACHE_S:
            live = await self.nodes()
            pairs = []
            for kv in await self.etcd.get_prefix(keys.SANDBOXES):
                binding = keys.Binding.from_json(kv.json())
                if binding.token and binding.node_id in live:
                    pairs.append((keys.tail(kv.key, keys.SANDBOXES), binding.token))
            self._tokens = (now, pairs)
        return self._tokens[1]

    def remember(self, sandbox_id: str, binding: keys.Binding) -> None:
        self._bindings[sandbox_id] = (time.monotonic(), binding)

    def forget(self, sandbox_id: str) -> None:
        self._bindings.pop(sandbox_id, None)


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


class NodeConnector:
    """What `SandboxProxy` and `TunnelRegistry` need of a manager, for a gateway: a
    connection to the node that owns the sandbox (the node's proxy does the rest)."""

    def __init__(self, directory: Directory) -> None:
        self.directory = directory
        self._listeners: list[Callable[[str], None]] = []

    def on_stop_serving(self, listener: Callable[[str], None]) -> None:
        self._listeners.append(listener)

    def get(self, sandbox_id: str) -> SandboxRecord:
        """The proxy asks for a sandbox's record to apply its traffic policy (token, host
        mask); the gateway holds none: the owning node's proxy applies it."""
        raise not_found(f"sandbox {sandbox_id}: its record is on its node")

    def running_ids(self) -> list[str]:
        return []

    def stopped_serving(self, sandbox_id: str) -> None:
        for listener in self._listeners:
            listener(sandbox_id)

    async def open_port(self, sandbox_id: str, port: int) -> socket.socket:
        owner = await self.directory.owner(sandbox_id)
        if owner is None or owner.node is None:
            raise not_found(f"sandbox {sandbox_id} is not running")
        host, node_port = _address(owner.node.url)
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, node_port, type=socket.SOCK_STREAM)
        family, _, proto, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM, proto)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, addr), CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            sock.close()
            self.directory.forget(sandbox_id)
            raise AenvError(ErrorCode.UNAVAILABLE,
                            f"node {owner.node.node_id} is unreachable: {exc!r}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


def _with_sandbox_headers(scope: Scope, target: Target) -> Scope:
    """`scope` with `E2b-Sandbox-Id`/`-Port` (a host-routed request has none; the node routes
    by them)."""
    if any(k == b"e2b-sandbox-id" for k, _ in scope["headers"]):
        return scope
    headers = [*scope["headers"], (b"e2b-sandbox-id", target.sandbox_id.encode()),
               (b"e2b-sandbox-port", str(target.port).encode())]
    return {**scope, "headers": headers}


class GatewayEdge:
    """Sandbox traffic to the proxy (to the owning node), the rest to the control plane."""

    def __init__(self, control: ASGIApp, proxy: SandboxProxy, domain: str | None,
                 tunnels: TunnelRegistry, directory: Directory) -> None:
        self.control = control
        self.proxy = proxy
        self.domain = domain
        self.tunnels = tunnels
        self.directory = directory

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            target = route_by_headers(scope, self.domain)
            if target is None and scope["path"] == "/files" and \
                    b"signature=" in scope.get("query_string", b""):
                tokens = await self.directory.tokens()
                target = route_by_signature(scope, lambda: tokens)
            if target is not None:
                await self.proxy(_with_sandbox_headers(scope, target), receive, send, target)
                return
        await self.control(scope, receive, send)


class GatewayHttpToolsProtocol(TunnelingHttpToolsProtocol):
    """The node's upgrade protocol, adding the sandbox headers to host-routed upgrades."""

    def _upgrade(self, early: bytes) -> None:
        target = self._tunnel_target()
        names = {k.lower() for k, _ in self.headers}
        if target is not None and b"e2b-sandbox-id" not in names:
            self.headers = [*self.headers, (b"e2b-sandbox-id", target.sandbox_id.encode()),
                            (b"e2b-sandbox-port", str(target.port).encode())]
        super()._upgrade(early)


class Gateway:
    def __init__(self, etcd_url: str, api_key: str, schedulers: list[str]) -> None:
        self.etcd = Etcd(etcd_url)
        self.api_key = api_key
        self.static_schedulers = [s.rstrip("/") for s in schedulers]
        self.directory = Directory(Etcd(etcd_url, timeout_s=DIRECTORY_TIMEOUT_S))
        self.connector = NodeConnector(self.directory)
        self._scheduler_urls: tuple[float, list[str]] | None = None
        self._writes: set[asyncio.Task[None]] = set()
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(CONTROL_TIMEOUT_S,
                                                            connect=CONNECT_TIMEOUT_S),
                                      trust_env=False, limits=httpx.Limits(
                                          max_connections=1000, max_keepalive_connections=100))

    async def close(self) -> None:
        await asyncio.gather(*self._writes, return_exceptions=True)
        await self.directory.close()
        await self.http.aclose()
        await self.etcd.close()

    # ------------------------------------------------------------------ helpers
    def _headers(self, request: Request) -> list[tuple[str, str]]:
        return [(k, v) for k, v in request.headers.items() if k not in _HOP]

    async def _send(self, node: keys.NodeInfo, method: str, path: str, query: str = "",
                    body: bytes = b"", headers: list[tuple[str, str]] | None = None
                    ) -> httpx.Response:
        url = node.url + path + ("?" + query if query else "")
        hdrs = headers if headers is not None else [("x-api-key", self.api_key)]
        try:
            return await self.http.request(method, url, content=body or None, headers=hdrs)
        except httpx.HTTPError as exc:
            raise AenvError(ErrorCode.UNAVAILABLE,
                            f"node {node.node_id} did not answer: {type(exc).__name__}") from None

    @staticmethod
    def _relay(resp: httpx.Response, extra: dict[str, Any] | None = None) -> Response:
        headers = {k: v for k, v in resp.headers.items() if k.lower() in _RELAYED}
        if extra and resp.headers.get("content-type", "").startswith("application/json"):
            try:
                data = resp.json()
            except ValueError:
                data = None
            if isinstance(data, dict):
                return JSONResponse({**data, **extra}, status_code=resp.status_code,
                                    headers={k: v for k, v in headers.items()
                                             if k != "content-type"})
        return Response(resp.content, status_code=resp.status_code, headers=headers)

    async def _bind(self, sandbox_id: str, node_id: str, token: str) -> None:
        """Route `sandbox_id` to `node_id` at once: here from the cache, for the other
        replicas once the write lands (off the create's path: one etcd commit fewer), and
        in any case at the node's next heartbeat."""
        binding = keys.Binding(node_id, "running", token=token)
        self.directory.remember(sandbox_id, binding)
        task = asyncio.create_task(self._write_binding(sandbox_id, binding))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write_binding(self, sandbox_id: str, binding: keys.Binding) -> None:
        try:
            # only if absent: the node's agent may have written its fuller one already
            await self.etcd.create(keys.sandbox_key(sandbox_id), encode(binding.to_json()))
        except AenvError as exc:
            log.warning("sandbox %s: binding not written (its node's heartbeat will): %s",
                        sandbox_id, exc.message)

    async def _schedulers(self) -> list[str]:
        """The leader first, then every replica (cached for CACHE_S)."""
        now = time.monotonic()
        if self._scheduler_urls is not None and now - self._scheduler_urls[0] < CACHE_S:
            return self._scheduler_urls[1]
        urls: list[str] = []
        with contextlib.suppress(AenvError):
            leader = await self.etcd.get(keys.LEADER)
            if leader is not None:
                urls.append(str(leader.json()["url"]))
            urls += [str(kv.json()["url"]) for kv in await self.etcd.get_prefix(keys.SCHEDULERS)]
        urls = list(dict.fromkeys(urls + self.static_schedulers))
        self._scheduler_urls = (now, urls)
        return urls

    async def place(self, body: dict[str, Any]) -> keys.NodeInfo:
        """A node for `body` (the scheduler's request): asked of the leader, then of any
        replica; computed here from the nodes' heartbeats when no scheduler answers."""
        for url in await self._schedulers():
            try:
                resp = await self.http.post(url + "/place", json=body, timeout=3.0,
                                            headers={"X-API-Key": self.api_key})
            except httpx.HTTPError:
                self._scheduler_urls = None  # ask etcd who is there, next time
                continue
            if resp.status_code == 200:
                node_id = str(resp.json().get("nodeID"))
                node = (await self.directory.nodes()).get(node_id) or \
                    (await self.directory.nodes(fresh=True)).get(node_id)
                if node is not None:
                    return node
                continue
            if resp.status_code in (400, 429):
                message = str(resp.json().get("message", resp.text))
                raise AenvError(ErrorCode.RESOURCE_EXHAUSTED if resp.status_code == 429
                                else ErrorCode.INVALID_ARGUMENT, message)
        nodes = await self.directory.nodes(fresh=True)
        req = placement.Request(kind=str(body.get("kind", "create")),
                                template=body.get("template"), cpu=int(body.get("cpu", 2)),
                                memory_mb=int(body.get("memory", 512)),
                                exclude=set(body.get("exclude", [])), prefer=body.get("prefer"))
        node = placement.place(nodes.values(), req)
        if node is None:
            raise AenvError(ErrorCode.RESOURCE_EXHAUSTED,
                            f"no node can take this sandbox ({len(nodes)} nodes alive)")
        return node

    # ------------------------------------------------------------------ create
    async def create(self, request: Request) -> Response:
        body = await json_body(request)
        status, answer = await self.create_somewhere(request.url.path, request.url.query,
                                                     body, self._headers(request), [])
        return JSONResponse(answer, status_code=status)

    async def create_somewhere(self, path: str, query: str, body: dict[str, Any],
                               headers: list[tuple[str, str]], exclude: list[str]
                               ) -> tuple[int, dict[str, Any]]:
        """Create `body` on a node the scheduler picks, another one when a node refuses
        (429 full, 503 unavailable) or does not answer. (status, JSON answer)."""
        template = body.get("templateID") or "base"
        cpu, memory = body.get("cpuCount"), body.get("memoryMB")
        want: dict[str, Any] = {"kind": "create",
                                "template": template if isinstance(template, str) else None,
                                "cpu": cpu if isinstance(cpu, int) and cpu > 0 else 2,
                                "memory": memory if isinstance(memory, int) and memory > 0
                                else 512, "exclude": exclude}
        raw = json.dumps(body).encode()
        last: tuple[int, dict[str, Any]] | None = None
        for _ in range(CREATE_ATTEMPTS):
            try:
                node = await self.place(want)
            except AenvError:
                if last is not None:
                    return last
                raise
            try:
                resp = await self._send(node, "POST", path, query, raw, headers)
            except AenvError as exc:
                last = 503, {"code": 503, "message": exc.message, "error_code": exc.code.value}
                exclude.append(node.node_id)
                continue
            answer = _json_or_message(resp)
            if resp.status_code in (429, 503):
                last = resp.status_code, answer
                exclude.append(node.node_id)
                continue
            if resp.status_code == 201:
                await self._bind(str(answer["sandboxID"]), node.node_id,
                                 str(answer.get("envdAccessToken") or ""))
                return 201, {**answer, "nodeID": node.node_id}
            return resp.status_code, answer
        assert last is not None
        return last

    # ------------------------------------------------------------------ one sandbox
    async def _lost(self, sandbox_id: str, owner: Owner) -> Response:
        body = {"code": 404, "message": f"sandbox {sandbox_id} was running on node "
                f"{owner.binding.node_id}, which is dead: the sandbox is lost",
                "error_code": ErrorCode.NOT_FOUND.value, "state": "lost",
                "nodeID": owner.binding.node_id}
        return JSONResponse(body, status_code=404)

    async def adopt_elsewhere(self, sandbox_id: str, owner: Owner) -> keys.NodeInfo:
        """Move paused `sandbox_id` off its dead or draining node: a node placed for a
        resume takes over its record (the paused state follows from the repository)."""
        listed = owner.binding.listed
        want: dict[str, Any] = {"kind": "resume", "template": listed.get("templateID"),
                                "cpu": int(listed.get("cpuCount", 2)),
                                "memory": int(listed.get("memoryMB", 512)),
                                "exclude": [owner.binding.node_id]}
        last: AenvError | None = None
        for _ in range(CREATE_ATTEMPTS):
            node = await self.place(want)
            resp = await self._send(node, "POST", f"/aenv/cluster/adopt/{sandbox_id}")
            if resp.status_code == 200:
                self.connector.stopped_serving(sandbox_id)
                self.directory.remember(sandbox_id, keys.Binding(node.node_id, "paused",
                                                                 listed))
                log.info("sandbox %s: moved from node %s to node %s", sandbox_id,
                         owner.binding.node_id, node.node_id)
                return node
            message = str(resp.json().get("message", resp.text))
            if resp.status_code == 409:
                fresh = await self.directory.owner(sandbox_id, fresh=True)
                if fresh is not None and fresh.node is not None and \
                        fresh.binding.node_id != owner.binding.node_id:
                    return fresh.node  # another gateway moved it meanwhile
            if resp.status_code in (404, 409, 400):
                raise AenvError(ErrorCode.CONFLICT if resp.status_code == 409
                                else ErrorCode.NOT_FOUND, message)
            last = AenvError(ErrorCode.UNAVAILABLE, message)
            want["exclude"].append(node.node_id)
        raise last or AenvError(ErrorCode.UNAVAILABLE, f"sandbox {sandbox_id} could not move")

    async def sandbox_op(self, request: Request) -> Response:
        sandbox_id = request.path_params["sandbox_id"]
        owner = await self.directory.owner(sandbox_id, fresh=request.method != "GET")
        if owner is None:
            raise not_found(f"sandbox {sandbox_id} not found")
        path = request.url.path
        op = path.rsplit("/", 1)[-1] if path.count("/") > 2 else ""
        node = owner.node
        movable = owner.binding.state == "paused" and (
            node is None or node.status == "draining" and op in ("connect", "resume"))
        if node is None and not movable:
            if request.method == "DELETE":
                # Deleting a lost sandbox: forgotten here, removed by its node if it returns.
                await self.etcd.put(keys.evict_key(owner.binding.node_id, sandbox_id), b"{}")
                await self.etcd.delete(keys.sandbox_key(sandbox_id))
                self.directory.forget(sandbox_id)
                return Response(status_code=204)
            return await self._lost(sandbox_id, owner)
        if movable and request.method == "GET" and op != "metrics":
            return JSONResponse({**owner.binding.listed, "nodeID": owner.binding.node_id,
                                 "nodeStatus": "unhealthy" if node is None else node.status})
        if movable:
            node = await self.adopt_elsewhere(sandbox_id, owner)
        assert node is not None
        raw = await request.body()
        resp = await self._send(node, request.method, path, request.url.query, raw,
                                self._headers(request))
        if request.method == "DELETE" and resp.status_code in (204, 404):
            self.connector.stopped_serving(sandbox_id)
            self.directory.forget(sandbox_id)
            kv = await self.etcd.get(keys.sandbox_key(sandbox_id))
            if kv is not None and keys.Binding.from_json(kv.json()).node_id == node.node_id:
                await self.etcd.delete_if(kv.key, kv.mod_revision)
        elif op == "pause" and resp.status_code == 204:
            self.connector.stopped_serving(sandbox_id)
        elif op == "fork" and resp.status_code == 201:
            children = resp.json()
            for child in children:
                if isinstance(child, dict) and "sandbox" in child:
                    child["sandbox"]["nodeID"] = node.node_id
                    await self._bind(str(child["sandbox"]["sandboxID"]), node.node_id,
                                     str(child["sandbox"].get("envdAccessToken") or ""))
            refused = [i for i, c in enumerate(children)
                       if isinstance(c, dict) and c.get("error", {}).get("code") in (429, 503)]
            if refused:
                await self._fork_elsewhere(sandbox_id, node, raw, children, refused)
            return JSONResponse(children, status_code=201)
        if resp.status_code < 300 and request.method != "DELETE" and op in ("", "connect",
                                                                           "resume"):
            return self._relay(resp, {"nodeID": node.node_id})
        return self._relay(resp)

    async def _fork_elsewhere(self, sandbox_id: str, node: keys.NodeInfo, raw: bytes,
                              children: list[Any], refused: list[int]) -> None:
        """The children the parent's node had no room for, on other nodes: created from a
        snapshot of the parent (a copy is a fork child by another path: its memory,
        processes and files, a new identity), which is deleted once they run."""
        body = json.loads(raw) if raw else {}
        try:
            snap = await self._send(node, "POST", f"/sandboxes/{sandbox_id}/snapshots")
            if snap.status_code != 201:
                raise AenvError(ErrorCode.UNAVAILABLE,
                                f"snapshot of the parent: {_json_or_message(snap)['message']}")
            snap_id = str(snap.json()["snapshotID"])
        except AenvError as exc:
            log.warning("fork of %s: %d children had no room on node %s, and %s", sandbox_id,
                        len(refused), node.node_id, exc.message)
            return
        try:
            await self._await_catalog(node, snap_id)
            info = (await self.directory.owner(sandbox_id) or Owner(keys.Binding("", ""), None))
            listed = info.binding.listed
            create: dict[str, Any] = {"templateID": snap_id, "metadata": listed.get("metadata")
                                      or {}}
            if isinstance(body.get("timeout"), int):
                create["timeout"] = body["timeout"]
            elif listed.get("endAt"):  # as the node's fork: the parent's remaining TTL
                left = datetime.fromisoformat(str(listed["endAt"])) - datetime.now(UTC)
                create["timeout"] = max(1, int(left.total_seconds()))
            results = await asyncio.gather(*(
                self.create_somewhere("/v2/sandboxes", "", create,
                                      [("x-api-key", self.api_key),
                                       ("content-type", "application/json")], [node.node_id])
                for _ in refused), return_exceptions=True)
            for index, result in zip(refused, results, strict=True):
                if isinstance(result, AenvError):
                    continue  # the node's own refusal stays the answer for that child
                if isinstance(result, BaseException):
                    raise result
                status, answer = result
                if status == 201:
                    children[index] = {"sandbox": answer}
        except AenvError as exc:
            log.warning("fork of %s: children elsewhere failed: %s", sandbox_id, exc.message)
        finally:
            with contextlib.suppress(AenvError):
                await self._send(node, "DELETE", f"/templates/{snap_id}")

    async def _await_catalog(self, node: keys.NodeInfo, snapshot_id: str,
                             timeout_s: float = 120) -> None:
        """Until `snapshot_id` is in the repository and its node published it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self.etcd.get(keys.template_key(snapshot_id)) is not None:
                return
            await asyncio.sleep(0.2)
        raise AenvError(ErrorCode.TIMEOUT, f"snapshot {snapshot_id} did not reach the "
                        f"repository in {timeout_s:.0f} s")

    # ------------------------------------------------------------------ lists
    async def list_sandboxes(self, request: Request) -> Response:
        v1 = request.url.path == "/sandboxes"
        q = dict(request.query_params)
        limit_raw = q.get("limit", "100")
        if not (limit_raw.isdigit() and 1 <= int(limit_raw) <= 1000):
            raise invalid("limit must be between 1 and 1000")
        limit = int(limit_raw)
        desc = q.get("order", "desc") != "asc"
        nodes = dict(await self.directory.nodes(fresh=True))
        query = request.url.query
        # Bindings first: sandboxes of nodes with no lease are paused (listed from their
        # binding), lost, or on a node that still answers (then asked like the others).
        orphans: list[tuple[str, keys.Binding]] = []
        for kv in await self.etcd.get_prefix(keys.SANDBOXES):
            binding = keys.Binding.from_json(kv.json())
            if binding.node_id not in nodes:
                orphans.append((keys.tail(kv.key, keys.SANDBOXES), binding))
        for node_id in {b.node_id for _, b in orphans}:
            probed = await self.directory.reachable(node_id)
            if probed is not None:
                nodes[node_id] = probed

        async def ask(node: keys.NodeInfo) -> tuple[str, httpx.Response | None]:
            try:
                return node.node_id, await self._send(node, "GET", request.url.path, query,
                                                      headers=self._headers(request))
            except AenvError:
                return node.node_id, None

        answers = await asyncio.gather(*(ask(n) for n in nodes.values()))
        items: list[dict[str, Any]] = []
        missing: list[str] = []
        more = False
        for node_id, resp in answers:
            if resp is None or resp.status_code >= 500:
                missing.append(node_id)
                continue
            if resp.status_code != 200:
                return self._relay(resp)  # a bad filter: every node says the same
            more = more or bool(resp.headers.get("x-next-token"))
            items += [{**item, "nodeID": node_id} for item in resp.json()]
        lost: list[str] = []
        for sandbox_id, binding in orphans:
            if binding.node_id in nodes or not binding.listed:
                continue
            if binding.state == "running":
                lost.append(sandbox_id)
            elif not v1 and _matches(binding.listed, q):
                items.append({**binding.listed, "state": "paused", "nodeID": binding.node_id})
        items.sort(key=_sort_key, reverse=desc)
        page = items[:limit]
        headers: dict[str, str] = {}
        if page and (more or len(items) > limit):
            headers["X-Next-Token"] = cursor(page[-1])
        if missing:
            headers[MISSING_HEADER] = ",".join(sorted(missing))
        if lost:
            headers[LOST_HEADER] = ",".join(sorted(lost)[:100])
        return JSONResponse(page, headers=headers)

    # ------------------------------------------------------------------ nodes
    async def node_views(self) -> list[dict[str, Any]]:
        nodes = await self.directory.nodes(fresh=True)
        members = {keys.tail(kv.key, keys.MEMBERS): kv.json()
                   for kv in await self.etcd.get_prefix(keys.MEMBERS)}
        counts: dict[str, dict[str, int]] = {}
        for kv in await self.etcd.get_prefix(keys.SANDBOXES):
            b = keys.Binding.from_json(kv.json())
            if b.node_id not in nodes:
                c = counts.setdefault(b.node_id, {"lost": 0, "paused": 0})
                c["lost" if b.state == "running" else "paused"] += 1
        out = [n.to_json() for n in nodes.values()]
        for node_id, member in members.items():
            if node_id not in nodes:
                c = counts.get(node_id, {"lost": 0, "paused": 0})
                out.append({"nodeID": node_id, "url": member.get("url"), "status": "unhealthy",
                            "sandboxes": {"running": 0, "paused": c["paused"],
                                          "lost": c["lost"]}})
        return sorted(out, key=lambda n: str(n["nodeID"]))

    async def list_nodes(self, _: Request) -> Response:
        return JSONResponse(await self.node_views())

    async def get_node(self, request: Request) -> Response:
        for view in await self.node_views():
            if view["nodeID"] == request.path_params["node_id"]:
                return JSONResponse(view)
        raise not_found(f"node {request.path_params['node_id']} not found")

    async def drain(self, request: Request) -> Response:
        node_id = request.path_params["node_id"]
        if not any(v["nodeID"] == node_id for v in await self.node_views()):
            raise not_found(f"node {node_id} not found")
        if request.method == "DELETE":
            await self.etcd.delete(keys.DRAIN + node_id)
        else:
            await self.etcd.put(keys.DRAIN + node_id, encode({}))
        return Response(status_code=204)

    # ------------------------------------------------------------------ everything else
    async def other(self, request: Request) -> Response:
        """Templates, snapshots, images: lists merged over the live nodes; a GET of one
        thing from the first node that has it; anything else to one ready node."""
        nodes = sorted((await self.directory.nodes()).values(), key=lambda n: n.node_id)
        if not nodes:
            raise AenvError(ErrorCode.UNAVAILABLE, "no node is alive")
        path, query = request.url.path, request.url.query
        headers = self._headers(request)
        if request.method == "GET" and path in ("/templates", "/snapshots"):
            merged: dict[str, dict[str, Any]] = {}
            for node in nodes:
                with contextlib.suppress(AenvError):
                    resp = await self._send(node, "GET", path, query, headers=headers)
                    if resp.status_code == 200:
                        for item in resp.json():
                            merged.setdefault(str(item.get("templateID")
                                                  or item.get("snapshotID")), item)
            return JSONResponse(list(merged.values()))
        if request.method == "GET":
            last: httpx.Response | None = None
            for node in nodes:
                with contextlib.suppress(AenvError):
                    last = await self._send(node, "GET", path, query, headers=headers)
                    if last.status_code != 404:
                        break
            if last is None:
                raise AenvError(ErrorCode.UNAVAILABLE, "no node answered")
            return self._relay(last)
        parts = path.strip("/").split("/")
        named = parts[1] if len(parts) > 1 and parts[0] == "templates" else None
        # A template (a snapshot) is changed on the node that made it (the catalog says
        # which; others hold copies), else on one that holds it; the rest on any node.
        origin = await self.etcd.get(keys.template_key(named)) if named else None
        origin_id = origin.json().get("node") if origin is not None else None
        node = next((n for n in nodes if n.node_id == origin_id),
                    next((n for n in nodes if named and named in n.templates),
                         next((n for n in nodes if n.status == "ready"), nodes[0])))
        req = self.http.build_request(request.method, node.url + path + ("?" + query if query
                                                                         else ""),
                                      content=request.stream(), headers=headers)
        try:
            resp = await self.http.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise AenvError(ErrorCode.UNAVAILABLE,
                            f"node {node.node_id} did not answer: {type(exc).__name__}") from None
        return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code,
                                 headers={k: v for k, v in resp.headers.items()
                                          if k.lower() in _RELAYED},
                                 background=BackgroundTask(resp.aclose))

    async def health(self, _: Request) -> Response:
        ok = await self.etcd.healthy()
        nodes = len(await self.directory.nodes(fresh=True)) if ok else 0
        return health_response({"etcd": ok, "nodes": nodes}, ok)


def _json_or_message(resp: httpx.Response) -> dict[str, Any]:
    try:
        data = resp.json()
    except ValueError:
        data = None
    if isinstance(data, dict):
        return data
    return {"code": resp.status_code, "message": resp.text[:500]}


def _matches(listed: dict[str, Any], q: dict[str, str]) -> bool:
    """The node's list filters (api/routes.py) applied to a binding's listed sandbox."""
    if q.get("state") and "paused" not in {s.strip() for s in q["state"].split(",")}:
        return False
    if q.get("template") and q["template"] not in (listed.get("templateID"),
                                                  listed.get("alias")):
        return False
    if q.get("metadata"):
        wanted = {unquote(k): unquote(v) for k, v in parse_qsl(q["metadata"],
                                                                keep_blank_values=True)}
        meta = listed.get("metadata") or {}
        if any(meta.get(k) != v for k, v in wanted.items()):
            return False
    started = datetime.fromisoformat(str(listed.get("startedAt", "")))
    if q.get("startedAfter"):
        try:
            if started <= datetime.fromisoformat(q["startedAfter"]):
                return False
        except ValueError:
            return False
    if q.get("nextToken"):
        try:
            raw = base64.urlsafe_b64decode(q["nextToken"] + "=" * (-len(q["nextToken"]) % 4))
            at, sid = json.loads(raw)
        except (ValueError, TypeError):
            return False
        key = _sort_key(listed)
        return key < (at, sid) if q.get("order", "desc") != "asc" else key > (at, sid)
    return True


def build_gateway(etcd_url: str, api_key: str | None = None, domain: str | None = None,
                  schedulers: list[str] | None = None) -> tuple[ASGIApp, Gateway]:
    key = api_key or os.environ.get("AENV_API_KEY") or "aenv_" + secrets.token_hex(16)
    gateway = Gateway(etcd_url, key, schedulers or [])
    # The node's proxy and tunnels, over connections to nodes (duck-typed as a manager:
    # they call only on_stop_serving and open_port).
    as_manager = cast(SandboxManager, gateway.connector)
    proxy = SandboxProxy(as_manager)
    tunnels = TunnelRegistry(as_manager)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await gateway.close()

    one = "/sandboxes/{sandbox_id}"
    ops: list[tuple[str, list[str]]] = [
        (one, ["GET", "DELETE"]), (one + "/timeout", ["POST"]), (one + "/refreshes", ["POST"]),
        (one + "/connect", ["POST"]), ("/v2" + one + "/connect", ["POST"]),
        (one + "/resume", ["POST"]), (one + "/pause", ["POST"]), (one + "/metrics", ["GET"]),
        (one + "/snapshots", ["POST"]), (one + "/fork", ["POST"])]
    handler: Callable[[Request], Awaitable[Response]] = gateway.sandbox_op
    control = Starlette(
        routes=[Route("/health", gateway.health, methods=["GET"]),
                Route("/sandboxes", gateway.create, methods=["POST"]),
                Route("/v2/sandboxes", gateway.create, methods=["POST"]),
                Route("/sandboxes", gateway.list_sandboxes, methods=["GET"]),
                Route("/v2/sandboxes", gateway.list_sandboxes, methods=["GET"]),
                *(Route(path, handler, methods=methods) for path, methods in ops),
                Route("/nodes", gateway.list_nodes, methods=["GET"]),
                Route("/nodes/{node_id}", gateway.get_node, methods=["GET"]),
                Route("/nodes/{node_id}/drain", gateway.drain, methods=["POST", "DELETE"]),
                Route("/{rest:path}", gateway.other,
                      methods=["GET", "POST", "PUT", "DELETE", "PATCH"])],
        middleware=[], exception_handlers={AenvError: on_aenv_error}, lifespan=lifespan)
    app = GatewayEdge(CrashAnswer(ApiKeyAuth(control, key)), proxy, domain, tunnels,
                      gateway.directory)
    return app, gateway


def protocol() -> type[GatewayHttpToolsProtocol]:
    return GatewayHttpToolsProtocol
