"""E2B control-plane routes (v1 and v2 sandbox endpoints), as the e2b 2.63 SDK calls them.

Each handler parses and validates, calls the `SandboxManager`, and shapes the answer; every
`AenvError` is turned into `{code, message}` JSON by the exception handler in `api.app`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from urllib.parse import parse_qsl, unquote

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.bodies import QueryParam, accepts, parse_body
from aenv.api.errors import STATUS_BY_CODE
from aenv.api.schemas import (
    ConnectSandbox,
    ForkBody,
    NewSandbox,
    PauseBody,
    SnapshotBody,
    TimeoutBody,
    detail_body,
    listed_body,
    metric_body,
    sandbox_body,
    snapshot_body,
)
from aenv.config import Config
from aenv.errors import AenvError, invalid, not_found
from aenv.orchestrator.manager import RUNTIME_METADATA_KEY, SandboxManager
from aenv.orchestrator.models import CreateRequest, ListQuery


def query_int(raw: str, what: str, low: int, high: int) -> int:
    """A query parameter that must be a plain decimal integer within [low, high]."""
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 12 and low <= int(raw) <= high):
        raise invalid(f"{what} must be an integer between {low} and {high}")
    return int(raw)


LIST_QUERY = (
    QueryParam("state", description="comma-separated: running, paused"),
    QueryParam("metadata", description="urlencoded key=value pairs the sandbox must have"),
    QueryParam("template"), QueryParam("startedAfter", description="RFC 3339 timestamp"),
    QueryParam("order", description="asc or desc"), QueryParam("limit", "integer"),
    QueryParam("nextToken"),
)


class SandboxRoutes:
    def __init__(self, manager: SandboxManager, config: Config) -> None:
        self.manager = manager
        self.config = config

    @property
    def domain(self) -> str | None:
        return self.config.server.domain

    def routes(self) -> list[Route]:
        return [
            Route("/sandboxes", self.create, methods=["POST"]),
            Route("/v2/sandboxes", self.create, methods=["POST"]),
            Route("/sandboxes", self.list_v1, methods=["GET"]),
            Route("/v2/sandboxes", self.list_v2, methods=["GET"]),
            Route("/sandboxes/{sandbox_id}", self.get, methods=["GET"]),
            Route("/sandboxes/{sandbox_id}", self.kill, methods=["DELETE"]),
            Route("/sandboxes/{sandbox_id}/timeout", self.set_timeout, methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/refreshes", self.refresh, methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/connect", self.connect, methods=["POST"]),
            Route("/v2/sandboxes/{sandbox_id}/connect", self.connect, methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/resume", self.connect, methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/pause", self.pause, methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/metrics", self.metrics, methods=["GET"]),
            Route("/sandboxes/{sandbox_id}/snapshots", self.create_snapshot, methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/fork", self.fork, methods=["POST"]),
            Route("/snapshots", self.list_snapshots, methods=["GET"]),
            Route("/snapshots/{snapshot_id}", self.get_snapshot, methods=["GET"]),
        ]

    @accepts(NewSandbox)
    async def create(self, request: Request) -> Response:
        body = await parse_body(request, NewSandbox)
        defaults = self.config.sandbox
        rec = await self.manager.create(CreateRequest(
            template=body.template_id,
            timeout_s=defaults.timeout_s if body.timeout is None else body.timeout,
            metadata=body.metadata or {},
            env_vars=body.env_vars or {},
            auto_pause=True if body.auto_pause is None else body.auto_pause,
            auto_resume=bool(body.auto_resume and body.auto_resume.enabled),
            allow_internet_access=(True if body.allow_internet_access is None
                                   else body.allow_internet_access),
            runtime=body.runtime or (body.metadata or {}).get(RUNTIME_METADATA_KEY),
            cpu_count=body.cpu_count, memory_mb=body.memory_mb,
        ))
        return JSONResponse(sandbox_body(rec, self.domain), status_code=201)

    def _list_query(self, request: Request, default_states: set[str] | None) -> ListQuery:
        q = request.query_params
        states = default_states
        if q.get("state"):
            states = {s.strip() for s in q["state"].split(",") if s.strip()}
            unknown = states - {"running", "paused"}
            if unknown:
                raise invalid(f"unknown state filter {sorted(unknown)}; use running, paused")
        metadata: dict[str, str] = {}
        if q.get("metadata"):
            # The SDK quotes keys and values, urlencodes the dict, and httpx encodes it again.
            metadata = {unquote(k): unquote(v)
                        for k, v in parse_qsl(q["metadata"], keep_blank_values=True)}
        started_after = None
        if q.get("startedAfter"):
            try:
                started_after = datetime.fromisoformat(q["startedAfter"])
            except ValueError:
                raise invalid("startedAfter must be an RFC 3339 timestamp") from None
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid("order must be asc or desc")
        limit = query_int(q.get("limit", "100"), "limit", 0, 10**9)
        return ListQuery(states=states, metadata=metadata, template=q.get("template"),
                         started_after=started_after, order_desc=order == "desc",
                         limit=limit, next_token=q.get("nextToken") or None)

    async def _list(self, request: Request, default_states: set[str] | None) -> Response:
        items, token = self.manager.list_sandboxes(self._list_query(request, default_states))
        headers = {"X-Next-Token": token} if token else {}
        return JSONResponse([listed_body(r) for r in items], headers=headers)

    @accepts(query=LIST_QUERY)
    async def list_v1(self, request: Request) -> Response:
        return await self._list(request, {"running"})

    @accepts(query=LIST_QUERY)
    async def list_v2(self, request: Request) -> Response:
        return await self._list(request, None)

    async def get(self, request: Request) -> Response:
        rec = self.manager.get(request.path_params["sandbox_id"])
        return JSONResponse(detail_body(rec, self.domain))

    async def kill(self, request: Request) -> Response:
        await self.manager.kill(request.path_params["sandbox_id"])
        return Response(status_code=204)

    @accepts(TimeoutBody)
    async def set_timeout(self, request: Request) -> Response:
        body = await parse_body(request, TimeoutBody)
        await self.manager.set_timeout(request.path_params["sandbox_id"], body.timeout)
        return Response(status_code=204)

    @accepts(ConnectSandbox, body_required=False)
    async def refresh(self, request: Request) -> Response:
        raw = await parse_body(request, ConnectSandbox, allow_empty=True)
        await self.manager.connect(request.path_params["sandbox_id"],
                                   raw.timeout or self.config.sandbox.timeout_s)
        return Response(status_code=204)

    @accepts(ConnectSandbox, body_required=False)
    async def connect(self, request: Request) -> Response:
        body = await parse_body(request, ConnectSandbox, allow_empty=True)
        timeout = self.config.sandbox.timeout_s if body.timeout is None else body.timeout
        rec, resumed = await self.manager.connect(request.path_params["sandbox_id"], timeout)
        return JSONResponse(sandbox_body(rec, self.domain), status_code=201 if resumed else 200)

    @accepts(PauseBody, body_required=False)
    async def pause(self, request: Request) -> Response:
        await parse_body(request, PauseBody, allow_empty=True)
        await self.manager.pause(request.path_params["sandbox_id"])
        return Response(status_code=204)

    async def metrics(self, request: Request) -> Response:
        sandbox_id = request.path_params["sandbox_id"]
        rec = self.manager.get(sandbox_id)
        at, usage = await self.manager.metrics(sandbox_id)
        body: list[dict[str, Any]] = [metric_body(at, rec.cpu_count, usage)]
        return JSONResponse(body)

    @accepts(SnapshotBody, body_required=False)
    async def create_snapshot(self, request: Request) -> Response:
        body = await parse_body(request, SnapshotBody, allow_empty=True)
        tpl = await self.manager.snapshot(request.path_params["sandbox_id"], body.name)
        return JSONResponse(snapshot_body(tpl), status_code=201)

    @accepts(query=(QueryParam("sandboxID"), QueryParam("name"), QueryParam("limit", "integer"),
                     QueryParam("nextToken")))
    async def list_snapshots(self, request: Request) -> Response:
        q = request.query_params
        limit = query_int(q.get("limit", "100"), "limit", 1, 1000)
        offset_raw = q.get("nextToken", "0")
        if not (offset_raw.isascii() and offset_raw.isdigit() and len(offset_raw) <= 12):
            raise invalid("nextToken is not a token this server issued")
        offset = int(offset_raw)
        items = self.manager.list_snapshots(q.get("sandboxID"), q.get("name"))
        page = items[offset:offset + limit]
        more = offset + limit < len(items)
        headers = {"X-Next-Token": str(offset + limit)} if more else {}
        return JSONResponse([snapshot_body(t) for t in page], headers=headers)

    async def get_snapshot(self, request: Request) -> Response:
        tpl = self.manager.find_template(request.path_params["snapshot_id"])
        if tpl.image is None:
            raise not_found(f"snapshot '{tpl.template_id}' not found")
        return JSONResponse(snapshot_body(tpl))

    @accepts(ForkBody, body_required=False)
    async def fork(self, request: Request) -> Response:
        body = await parse_body(request, ForkBody, allow_empty=True)
        results = await self.manager.fork(request.path_params["sandbox_id"], body.count,
                                          body.timeout)
        out: list[dict[str, Any]] = []
        for result in results:
            if isinstance(result, AenvError):
                status = STATUS_BY_CODE[result.code]
                out.append({"error": {"code": status, "message": result.message}})
            else:
                out.append({"sandbox": sandbox_body(result, self.domain)})
        return JSONResponse(out, status_code=201)
