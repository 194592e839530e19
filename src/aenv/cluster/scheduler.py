"""`aenv scheduler --etcd URL [--listen HOST:PORT]`: placement over HTTP JSON.

`POST /place {kind, template?, cpu?, memory?, exclude?: [node ids], prefer?: node id}` answers
`{nodeID, url}` (`placement.place` over the live nodes in etcd), 429 when no node can take
it. `GET /health`: 200 `{schedulerID, leader, leaderID}` once etcd answers.

Replicas: one leader through `Election` on `scheduler/leader`. The leader counts what it
placed since each node's last heartbeat (reservations, dropped by the next heartbeat, which
counts them, or after two), so that a burst of creates spreads instead of piling onto the
node that looked emptiest; that soft state is all it keeps, and a new leader simply starts
without it. A follower forwards `/place` to the leader, and answers itself when the leader
does not (while a dead leader's lease runs out): a placement never fails because a
scheduler died.

Owns: `schedulers/<id>` and the election key. Must not touch: nodes' or sandboxes' keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.cluster import keys, placement
from aenv.cluster.election import Election
from aenv.cluster.etcd import Etcd, encode
from aenv.cluster.serving import health_response, json_body, on_aenv_error
from aenv.errors import AenvError, ErrorCode, invalid

log = logging.getLogger("aenv.cluster")

LEADER_TTL_S = 3
FORWARD_TIMEOUT_S = 2.0
RESERVATION_S = 2 * keys.HEARTBEAT_S
NODES_CACHE_S = 0.5


def _epoch(stamp: str) -> float:
    try:
        return datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return 0.0


def parse_request(body: dict[str, Any]) -> placement.Request:
    kind = body.get("kind", "create")
    if kind not in placement.KINDS:
        raise invalid(f"kind must be one of {', '.join(placement.KINDS)}")
    template = body.get("template")
    cpu, memory = body.get("cpu", 2), body.get("memory", 512)
    exclude, prefer = body.get("exclude", []), body.get("prefer")
    if template is not None and not isinstance(template, str) or \
            not isinstance(cpu, int) or not isinstance(memory, int) or cpu < 1 or memory < 1 or \
            not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude) or \
            prefer is not None and not isinstance(prefer, str):
        raise invalid("place: template is a string, cpu and memory positive integers, "
                      "exclude a list of node ids, prefer a node id")
    return placement.Request(kind=kind, template=template, cpu=cpu, memory_mb=memory,
                             exclude=set(exclude), prefer=prefer)


class Scheduler:
    def __init__(self, etcd: Etcd, url: str, api_key: str | None) -> None:
        self.etcd = etcd
        self.id = "s" + secrets.token_hex(4)
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.election = Election(etcd, keys.LEADER, encode({"id": self.id, "url": self.url}),
                                 LEADER_TTL_S)
        self._reserved: dict[str, list[tuple[float, int, int]]] = {}
        self._http = httpx.AsyncClient(timeout=FORWARD_TIMEOUT_S, trust_env=False)
        self._tasks: list[asyncio.Task[None]] = []
        self._nodes: tuple[float, list[keys.NodeInfo]] | None = None
        self._lease = 0
        self.ready = False

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self.election.run(), name="aenv-election"),
                       asyncio.create_task(self._register_forever(), name="aenv-sched-reg")]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.election.resign()
        if self._lease:
            with contextlib.suppress(AenvError):
                await self.etcd.revoke(self._lease)
        await self._http.aclose()
        await self.etcd.close()

    async def _register_forever(self) -> None:
        while True:
            try:
                if not self._lease or await self.etcd.keepalive(self._lease) <= 0:
                    self._lease = await self.etcd.grant(LEADER_TTL_S)
                    await self.etcd.put(keys.SCHEDULERS + self.id,
                                        encode({"id": self.id, "url": self.url}),
                                        lease=self._lease)
                self.ready = True
            except AenvError as exc:
                self.ready = False
                log.warning("scheduler: etcd: %s", exc.message)
            await asyncio.sleep(LEADER_TTL_S / 3)

    def _reservations(self, nodes: list[keys.NodeInfo]) -> dict[str, tuple[int, int]]:
        """What was placed on each node since its last heartbeat (which counts the rest)."""
        now = time.time()
        beats = {n.node_id: _epoch(n.heartbeat_at) for n in nodes}
        out: dict[str, tuple[int, int]] = {}
        for node, items in list(self._reserved.items()):
            since = beats.get(node, now)
            items[:] = [i for i in items if i[0] > since and now - i[0] < RESERVATION_S]
            if items:
                out[node] = (sum(i[1] for i in items), sum(i[2] for i in items))
            else:
                del self._reserved[node]
        return out

    async def nodes(self) -> list[keys.NodeInfo]:
        """The live nodes' heartbeats, read at most every NODES_CACHE_S (what was placed
        since is in the reservations)."""
        now = time.monotonic()
        if self._nodes is None or now - self._nodes[0] > NODES_CACHE_S:
            self._nodes = (now, [keys.NodeInfo.from_json(kv.json())
                                 for kv in await self.etcd.get_prefix(keys.NODES)])
        return self._nodes[1]

    async def _template_in_catalog(self, template: str) -> bool:
        if await self.etcd.get(keys.template_key(template)) is not None:
            return True
        return any(template in kv.json().get("template", {}).get("names", [])
                   for kv in await self.etcd.get_prefix(keys.TEMPLATES))

    async def place(self, req: placement.Request) -> keys.NodeInfo:
        nodes = await self.nodes()
        if req.template and any(req.template in n.templates for n in nodes) and \
                not all(req.template in n.templates for n in nodes) and \
                not await self._template_in_catalog(req.template):
            req.required_template = True  # a template only some nodes have, and only there
        node = placement.place(nodes, req, self._reservations(nodes))
        if node is None:
            ready = sum(1 for n in nodes if n.status == "ready")
            raise AenvError(ErrorCode.RESOURCE_EXHAUSTED,
                            f"no node can take a {req.kind} of {req.cpu} CPU / {req.memory_mb} "
                            f"MiB ({len(nodes)} nodes alive, {ready} ready, "
                            f"{len(req.exclude)} excluded)")
        self._reserved.setdefault(node.node_id, []).append(
            (time.time(), req.cpu, req.memory_mb))
        return node

    async def _forward(self, body: dict[str, Any]) -> Response | None:
        """The leader's answer to `body`, or None when there is no leader to ask."""
        kv = await self.etcd.get(keys.LEADER)
        if kv is None:
            return None
        leader = kv.json()
        if leader.get("id") == self.id:
            return None
        headers = {"X-Aenv-Forwarded": self.id}
        if self.api_key:
            headers["X-API-Key"] = self.api_key
        try:
            resp = await self._http.post(str(leader["url"]) + "/place", json=body, headers=headers)
        except httpx.HTTPError as exc:
            log.info("scheduler: leader %s did not answer (%s): placing here", leader.get("id"),
                     type(exc).__name__)
            return None
        if resp.status_code >= 500:
            return None
        return Response(resp.content, status_code=resp.status_code,
                        media_type="application/json")

    # ------------------------------------------------------------------ routes
    async def place_route(self, request: Request) -> Response:
        if self.api_key and not hmac.compare_digest(
                request.headers.get("x-api-key", "").encode(), self.api_key.encode()):
            raise AenvError(ErrorCode.UNAUTHENTICATED, "invalid API key: send X-API-Key")
        body = await json_body(request)
        req = parse_request(body)
        if not self.election.is_leader and "x-aenv-forwarded" not in request.headers:
            forwarded = await self._forward(body)
            if forwarded is not None:
                return forwarded
        node = await self.place(req)
        return JSONResponse({"nodeID": node.node_id, "url": node.url,
                             "schedulerID": self.id, "leader": self.election.is_leader})

    async def health(self, _: Request) -> Response:
        kv = await self.etcd.get(keys.LEADER) if self.ready else None
        leader = kv.json().get("id") if kv is not None else None
        return health_response({"schedulerID": self.id, "url": self.url,
                                "leader": self.election.is_leader, "leaderID": leader},
                               self.ready)


def build_scheduler(etcd_url: str, url: str, api_key: str | None) -> tuple[Starlette, Scheduler]:
    scheduler = Scheduler(Etcd(etcd_url), url, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await scheduler.start()
        try:
            yield
        finally:
            await scheduler.close()

    app = Starlette(routes=[Route("/place", scheduler.place_route, methods=["POST"]),
                            Route("/health", scheduler.health, methods=["GET"])],
                    exception_handlers={AenvError: on_aenv_error}, lifespan=lifespan)
    return app, scheduler
