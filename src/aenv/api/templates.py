"""E2B's template build routes, as the e2b 2.63 SDK's `Template.build` calls them, plus
template get/delete/alias lookups.

Owns: parsing and the wire shapes of `POST /v3/templates`, `GET /templates/{id}/files/{hash}`
(the upload link points back at this server: `PUT /aenv/templates/{id}/files/{hash}`, with the
caller's API key in the headers the SDK is told to send), `POST /v2/templates/{id}/builds/{build}`,
`GET /templates/{id}/builds/{build}/status|logs`, `GET /templates/aliases/{alias}`,
`GET /templates/{id}`, `DELETE /templates/{id}`. The builds themselves are
`aenv.builds.builder.TemplateBuilds`. Must not touch: sandbox routes, the pipeline.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.bodies import QueryParam, accepts, parse_body
from aenv.api.images import template_body
from aenv.builds.builder import (
    Build,
    BuildSpec,
    BuildTemplate,
    LogEntry,
    Step,
    TemplateBuilds,
    log_entry_body,
)
from aenv.envd.settings import ENVD_VERSION
from aenv.errors import invalid

_LEVELS = {"debug": 0, "info": 1, "warn": 2, "error": 3}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class BuildRequest(_Body):
    name: str | None = Field(default=None, min_length=1, max_length=256)
    alias: str | None = Field(default=None, min_length=1, max_length=256)
    tags: list[str] | None = None
    cpu_count: int | None = Field(default=None, alias="cpuCount", ge=1, le=2**31 - 1)
    memory_mb: int | None = Field(default=None, alias="memoryMB", ge=1, le=2**31 - 1)


class StepBody(_Body):
    type: str = Field(min_length=1)
    args: list[str] = Field(default_factory=list)
    files_hash: str | None = Field(default=None, alias="filesHash")


class BuildStart(_Body):
    from_image: str | None = Field(default=None, alias="fromImage")
    from_template: str | None = Field(default=None, alias="fromTemplate")
    from_image_registry: dict[str, Any] | None = Field(default=None, alias="fromImageRegistry")
    steps: list[StepBody] = Field(default_factory=list)
    start_cmd: str | None = Field(default=None, alias="startCmd")
    ready_cmd: str | None = Field(default=None, alias="readyCmd")


def _ts(value: datetime) -> str:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def build_body(build: Build) -> dict[str, Any]:
    """E2B's `TemplateBuild`."""
    body: dict[str, Any] = {
        "buildID": build.build_id, "status": build.status, "createdAt": _ts(build.created_at),
        "updatedAt": _ts(build.updated_at or build.created_at), "cpuCount": build.cpu_count,
        "memoryMB": build.memory_mb, "envdVersion": ENVD_VERSION}
    if build.finished_at is not None:
        body["finishedAt"] = _ts(build.finished_at)
    return body


def _int_param(request: Request, name: str, default: int, low: int = 0) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise invalid(f"{name} must be an integer") from None
    if value < low:
        raise invalid(f"{name} must be >= {low}")
    return value


def _level_filter(request: Request, entries: list[LogEntry]) -> list[LogEntry]:
    level = request.query_params.get("level")
    if not level:
        return entries
    if level not in _LEVELS:
        raise invalid(f"level must be one of {', '.join(_LEVELS)}")
    return [e for e in entries if _LEVELS.get(e.level, 1) >= _LEVELS[level]]


class TemplateRoutes:
    def __init__(self, builds: TemplateBuilds) -> None:
        self.builds = builds

    def routes(self) -> list[Route]:
        return [
            Route("/v3/templates", self.request_build, methods=["POST"]),
            Route("/templates/aliases/{alias}", self.alias, methods=["GET"]),
            Route("/templates/{template_id}/files/{files_hash}", self.files_link,
                  methods=["GET"]),
            Route("/aenv/templates/{template_id}/files/{files_hash}", self.upload,
                  methods=["PUT"], name="upload_files"),
            Route("/v2/templates/{template_id}/builds/{build_id}", self.start_build,
                  methods=["POST"]),
            Route("/templates/{template_id}/builds/{build_id}/status", self.status,
                  methods=["GET"]),
            Route("/templates/{template_id}/builds/{build_id}/logs", self.logs, methods=["GET"]),
            Route("/templates/{template_id}", self.get_template, methods=["GET"]),
            Route("/templates/{template_id}", self.delete_template, methods=["DELETE"]),
        ]

    @accepts(BuildRequest)
    async def request_build(self, request: Request) -> Response:
        body = await parse_body(request, BuildRequest)
        name = body.name or body.alias
        if not name:
            raise invalid("name is required")
        tpl, build = self.builds.request(name, body.tags or [], body.cpu_count, body.memory_mb)
        return JSONResponse({"templateID": tpl.template_id, "buildID": build.build_id,
                             "public": False, "names": list(tpl.names), "tags": list(tpl.tags),
                             "aliases": list(tpl.names)}, status_code=202)

    async def alias(self, request: Request) -> Response:
        tpl = self.builds.template(request.path_params["alias"])
        return JSONResponse({"templateID": tpl.template_id, "public": False})

    async def files_link(self, request: Request) -> Response:
        template_id = request.path_params["template_id"]
        files_hash = request.path_params["files_hash"]
        path = self.builds.files_path(template_id, files_hash)
        url = str(request.url_for("upload_files", template_id=template_id,
                                  files_hash=files_hash))
        # The SDK PUTs the archive to `url` with exactly these headers (no API key of its own).
        headers = {"X-API-Key": request.headers.get("x-api-key", "")}
        return JSONResponse({"present": path.exists(), "url": url, "headers": headers},
                            status_code=201)

    async def upload(self, request: Request) -> Response:
        await self.builds.receive_files(request.path_params["template_id"],
                                        request.path_params["files_hash"], request.stream())
        return Response(status_code=204)

    @accepts(BuildStart, body_required=False)
    async def start_build(self, request: Request) -> Response:
        body = await parse_body(request, BuildStart, allow_empty=True)
        spec = BuildSpec(
            from_image=body.from_image, from_template=body.from_template,
            steps=[Step(type=s.type.upper(), args=list(s.args), files_hash=s.files_hash)
                   for s in body.steps],
            start_cmd=body.start_cmd or None, ready_cmd=body.ready_cmd or None,
            registry_credentials=bool(body.from_image_registry))
        self.builds.start(request.path_params["template_id"], request.path_params["build_id"],
                          spec)
        return Response(status_code=202)

    @accepts(query=(QueryParam("logsOffset", "integer"), QueryParam("limit", "integer"),
                     QueryParam("level")))
    async def status(self, request: Request) -> Response:
        build = self.builds.build(request.path_params["template_id"],
                                  request.path_params["build_id"])
        offset = _int_param(request, "logsOffset", 0)
        limit = min(_int_param(request, "limit", 100, 1), 100)
        entries = _level_filter(request, build.logs[offset:])[:limit]
        body: dict[str, Any] = {
            "templateID": build.template_id, "buildID": build.build_id, "status": build.status,
            "logs": [], "logEntries": [log_entry_body(e) for e in entries]}
        if build.reason is not None:
            body["reason"] = build.reason
        return JSONResponse(body)

    @accepts(query=(QueryParam("cursor", "integer"), QueryParam("limit", "integer"),
                     QueryParam("direction"), QueryParam("level")))
    async def logs(self, request: Request) -> Response:
        build = self.builds.build(request.path_params["template_id"],
                                  request.path_params["build_id"])
        cursor = _int_param(request, "cursor", 0)
        limit = min(_int_param(request, "limit", 100, 1), 1000)
        forward = request.query_params.get("direction", "forward") != "backward"
        entries = _level_filter(request, build.logs)
        if forward:
            picked = [e for e in entries if e.timestamp.timestamp() * 1000 >= cursor][:limit]
        else:
            picked = [e for e in entries
                      if not cursor or e.timestamp.timestamp() * 1000 <= cursor][-limit:][::-1]
        return JSONResponse({"logs": [log_entry_body(e) for e in picked]})

    async def get_template(self, request: Request) -> Response:
        tpl = self.builds.template(request.path_params["template_id"])
        return JSONResponse(self._template_with_builds(tpl))

    def _template_with_builds(self, tpl: BuildTemplate) -> dict[str, Any]:
        stored = self.builds.manager.store.find_template(tpl.template_id)
        builds = [build_body(b) for b in reversed(tpl.builds)]
        if stored is not None:
            body = template_body(stored)
        else:  # requested, not built (yet)
            defaults = self.builds.config.sandbox
            created = _ts(tpl.created_at)
            body = {"templateID": tpl.template_id, "buildID": "", "cpuCount": defaults.cpu_count,
                    "memoryMB": defaults.memory_mb, "diskSizeMB": defaults.disk_size_mb,
                    "public": False, "aliases": list(tpl.names), "names": list(tpl.names),
                    "createdAt": created, "updatedAt": created, "createdBy": None,
                    "lastSpawnedAt": None, "spawnCount": 0, "envdVersion": ENVD_VERSION}
        latest = tpl.builds[-1] if tpl.builds else None
        if latest is not None:
            body["buildStatus"] = latest.status
            body["buildCount"] = len(tpl.builds)
            ready = next((b for b in reversed(tpl.builds) if b.status == "ready"), None)
            if ready is not None:
                body["buildID"] = ready.build_id
        else:
            body.setdefault("buildCount", 0)
            body.setdefault("buildStatus", "ready" if stored is not None else "waiting")
        body["builds"] = builds
        return body

    async def delete_template(self, request: Request) -> Response:
        await self.builds.delete(request.path_params["template_id"])
        return Response(status_code=204)
