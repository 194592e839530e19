"""E2B control-plane routes (v1 and v2 sandbox endpoints), as the e2b 2.63 SDK calls them.

Each handler parses and validates, calls the `SandboxManager`, and shapes the answer; every
`AenvError` is turned into `{code, message}` JSON by the exception handler in `api.app`.
"""

from __future__ import annotations

from datetime import UTC, datetime
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
    log_entry_body,
    log_line_body,
    metric_body,
    sandbox_body,
    snapshot_body,
)
from aenv.config import Config
from aenv.errors import AenvError, ErrorCode, invalid, not_found
from aenv.orchestrator.events import LEVELS, LogQuery
from aenv.orchestrator.manager import RUNTIME_METADATA_KEY, SandboxManager
from aenv.orchestrator.models import CreateRequest, ListQuery, SandboxState
from aenv.orchestrator.samples import MetricSamples, Sample


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
MAX_LOG_LIMIT = 1000
MAX_SEARCH_CHARS = 256
MAX_METRICS_IDS = 100
UNIX_MAX = 2**44  # milliseconds since the epoch: year 2527 (seconds: capped to UNIX_S_MAX)
UNIX_S_MAX = 2**37  # seconds: year 6325
LOGS_V2_QUERY = (
    QueryParam("cursor", "integer", "milliseconds since the epoch: forward from it "
               "(inclusive), or backward up to it"),
    QueryParam("limit", "integer", f"1..{MAX_LOG_LIMIT}, default {MAX_LOG_LIMIT}"),
    QueryParam("direction", description="forward (default) or backward"),
    QueryParam("level", description="the minimum level: debug, info, warn, error"),
    QueryParam("search", description="a substring of the message (case-insensitive)"),
)


class SandboxRoutes:
    def __init__(self, manager: SandboxManager, config: Config,
                 samples: MetricSamples | None = None) -> None:
        self.manager = manager
        self.config = config
        self.samples = samples or MetricSamples(manager, 0, 1)

    @property
    def domain(self) -> str | None:
        return self.config.server.domain

    def routes(self) -> list[Route]:
        return [
            Route("/sandboxes", self.create, methods=["POST"]),
            Route("/v2/sandboxes", self.create, methods=["POST"]),
            Route("/sandboxes", self.list_v1, methods=["GET"]),
            Route("/v2/sandboxes", self.list_v2, methods=["GET"]),
            # before /sandboxes/{sandbox_id}, which would take "metrics" for an id
            Route("/sandboxes/metrics", self.batch_metrics, methods=["GET"]),
            Route("/sandboxes/{sandbox_id}", self.get, methods=["GET"]),
            Route("/sandboxes/{sandbox_id}", self.kill, methods=["DELETE"]),
            Route("/sandboxes/{sandbox_id}/timeout", self.set_timeout, methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/refreshes", self.refresh, methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/connect", self.connect, methods=["POST"]),
            Route("/v2/sandboxes/{sandbox_id}/connect", self.connect, methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/resume", self.connect, methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/pause", self.pause, methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/metrics", self.metrics, methods=["GET"]),
            Route("/sandboxes/{sandbox_id}/logs", self.logs_v1, methods=["GET"]),
            Route("/v2/sandboxes/{sandbox_id}/logs", self.logs_v2, methods=["GET"]),
            Route("/sandboxes/{sandbox_id}/snapshots", self.create_snapshot, methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/fork", self.fork, methods=["POST"]),
            Route("/snapshots", self.list_snapshots, methods=["GET"]),
            Route("/snapshots/{snapshot_id}", self.get_snapshot, methods=["GET"]),
        ]

    @accepts(NewSandbox)
    async def create(self, request: Request) -> Response:
        body = await parse_body(request, NewSandbox)
        defaults = self.config.sandbox
        if body.auto_pause_memory is False and body.auto_resume and body.auto_resume.enabled:
            raise invalid("autoPauseMemory false cannot be combined with autoResume: a sandbox "
                          "paused without memory is resumed only by connect")
        rec = await self.manager.create(CreateRequest(
            template=body.template_id,
            timeout_s=defaults.timeout_s if body.timeout is None else body.timeout,
            metadata=body.metadata or {},
            env_vars=body.env_vars or {},
            auto_pause=True if body.auto_pause is None else body.auto_pause,
            auto_resume=bool(body.auto_resume and body.auto_resume.enabled),
            auto_pause_memory=body.auto_pause_memory is not False,
            allow_internet_access=(True if body.allow_internet_access is None
                                   else body.allow_internet_access),
            runtime=body.runtime or (body.metadata or {}).get(RUNTIME_METADATA_KEY),
            cpu_count=body.cpu_count, memory_mb=body.memory_mb,
            network=body.network.as_record() if body.network is not None else None,
            volume_mounts=[(m.name, m.path) for m in body.volume_mounts or ()],
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
        rec, resumed = await self.manager.connect(request.path_params["sandbox_id"], timeout,
                                                  memory=body.memory is not False)
        return JSONResponse(sandbox_body(rec, self.domain), status_code=201 if resumed else 200)

    @accepts(PauseBody, body_required=False)
    async def pause(self, request: Request) -> Response:
        body = await parse_body(request, PauseBody, allow_empty=True)
        await self.manager.pause(request.path_params["sandbox_id"], memory=body.memory is not False)
        return Response(status_code=204)

    @accepts(query=(QueryParam("start", "integer", "unix seconds (inclusive)"),
                     QueryParam("end", "integer", "unix seconds (inclusive)")))
    async def metrics(self, request: Request) -> Response:
        """The samples kept of the sandbox in [start, end] (oldest first), and a current one
        when it runs and the range reaches now."""
        sandbox_id = request.path_params["sandbox_id"]
        rec = self.manager.get(sandbox_id)
        q = request.query_params
        start = _unix(q.get("start"), "start")
        end = _unix(q.get("end"), "end")
        if start is not None and end is not None and start > end:
            raise invalid("start must not be after end")
        samples = self.samples.series(sandbox_id, start, end)
        now = datetime.now(UTC)
        if rec.state is SandboxState.RUNNING and (end is None or end >= now.replace(
                microsecond=0)) and (not samples or (now - samples[-1].at).total_seconds() >= 1):
            current = await self.samples.take(sandbox_id)
            if current is not None:
                samples.append(current)
        return JSONResponse([_metric(s) for s in samples])

    @accepts(query=(QueryParam("sandbox_ids", description="comma-separated sandbox ids "
                               f"(at most {MAX_METRICS_IDS})"),))
    async def batch_metrics(self, request: Request) -> Response:
        """E2B's `SandboxesWithMetrics`: the latest sample of each sandbox asked for that
        exists (running, or paused with a sample kept); others are left out."""
        raw = request.query_params.get("sandbox_ids", "")
        ids = list(dict.fromkeys(i.strip() for i in raw.split(",") if i.strip()))
        if not ids:
            raise invalid("sandbox_ids is required: comma-separated sandbox ids")
        if len(ids) > MAX_METRICS_IDS:
            raise invalid(f"at most {MAX_METRICS_IDS} sandbox_ids at once")
        out: dict[str, dict[str, Any]] = {}
        for sandbox_id in ids:
            sample = self.samples.latest(sandbox_id)
            if sample is None:
                sample = await self.samples.take(sandbox_id)
            if sample is not None:
                try:
                    self.manager.get(sandbox_id)
                except AenvError:
                    continue
                out[sandbox_id] = _metric(sample)
        return JSONResponse({"sandboxes": out})

    @accepts(query=(QueryParam("start", "integer", "milliseconds since the epoch"),
                     QueryParam("limit", "integer", f"1..{MAX_LOG_LIMIT}")))
    async def logs_v1(self, request: Request) -> Response:
        """E2B's v1 `SandboxLogs`: entries from `start` on, oldest first."""
        q = request.query_params
        query = LogQuery(cursor_ms=_ms(q.get("start"), "start"), limit=_log_limit(q.get("limit")))
        entries = await self.manager.logs(request.path_params["sandbox_id"], query)
        return JSONResponse({"logs": [log_line_body(e) for e in entries],
                             "logEntries": [log_entry_body(e) for e in entries]})

    @accepts(query=LOGS_V2_QUERY)
    async def logs_v2(self, request: Request) -> Response:
        """E2B's `SandboxLogsV2Response`: lifecycle events and envd's log, paged by time."""
        q = request.query_params
        direction = q.get("direction", "forward")
        if direction not in ("forward", "backward"):
            raise invalid("direction must be forward or backward")
        level = q.get("level") or None
        if level is not None and level not in LEVELS:
            raise invalid(f"level must be one of {', '.join(LEVELS)}")
        search = q.get("search") or None
        if search is not None and len(search) > MAX_SEARCH_CHARS:
            raise invalid(f"search is longer than {MAX_SEARCH_CHARS} characters")
        query = LogQuery(cursor_ms=_ms(q.get("cursor"), "cursor"),
                         limit=_log_limit(q.get("limit")), forward=direction == "forward",
                         level=level, search=search)
        entries = await self.manager.logs(request.path_params["sandbox_id"], query)
        return JSONResponse({"logs": [log_entry_body(e) for e in entries]})

    @accepts(SnapshotBody, body_required=False)
    async def create_snapshot(self, request: Request) -> Response:
        body = await parse_body(request, SnapshotBody, allow_empty=True)
        if body.memory is False:
            raise AenvError(ErrorCode.NOT_SUPPORTED, "filesystem-only snapshots (memory: false) "
                            "are not supported: take a full snapshot, or pause with memory "
                            "false")
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


def _time(raw: str, what: str, unit: str) -> int:
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 16 and int(raw) <= UNIX_MAX):
        raise invalid(f"{what} must be a non-negative integer: {unit} since the Unix epoch")
    return int(raw)


def _unix(raw: str | None, what: str) -> datetime | None:
    if raw is None or raw == "":
        return None
    return datetime.fromtimestamp(min(_time(raw, what, "seconds"), UNIX_S_MAX), UTC)


def _ms(raw: str | None, what: str) -> int | None:
    if raw is None or raw == "":
        return None
    return _time(raw, what, "milliseconds")


def _log_limit(raw: str | None) -> int:
    if raw is None or raw == "":
        return MAX_LOG_LIMIT
    return query_int(raw, "limit", 1, MAX_LOG_LIMIT)


def _metric(sample: Sample) -> dict[str, Any]:
    return metric_body(sample.at, sample.cpu_count, sample.usage)
