"""E2B's template build routes, as the e2b 2.63 SDK's `Template.build` calls them, plus
template get/delete/alias lookups.

Owns: parsing and the wire shapes of `POST /v3/templates`, `GET /templates/{id}/files/{hash}`
(the upload link points back at this server: `PUT /aenv/templates/{id}/files/{hash}`, with the
caller's API key in the headers the SDK is told to send), `POST /v2/templates/{id}/builds/{build}`,
`GET /templates/{id}/builds/{build}/status|logs`, `GET /templates/aliases/{alias}`,
`GET /templates/{id}`, `DELETE /templates/{id}`, `PATCH /templates/{id}` and
`/v2/templates/{id}` (`public`), `GET /v2/templates` (paged), `GET /default-templates`, and tags: `POST|DELETE
/templates/tags`, `GET /templates/{id}/tags` (`/count`, `/exists`). A tag names the
template's build: aenv keeps one build per template, so a tag's `buildID` is that build's (a
UUID derived from the template and when it was built) and a rebuild drops the tags of the
build it replaces (its own tags are the build request's). The builds themselves are
`aenv.builds.builder.TemplateBuilds`. Must not touch: sandbox routes, the pipeline.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints
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
from aenv.builds.code_interpreter import TEMPLATE_NAME as CODE_INTERPRETER
from aenv.envd.settings import ENVD_VERSION
from aenv.errors import invalid, not_found
from aenv.orchestrator.models import TemplateRecord
from aenv.orchestrator.store import Store

_LEVELS = {"debug": 0, "info": 1, "warn": 2, "error": 3}
MAX_PAGE = 1000  # templates per page of GET /v2/templates


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
    force: bool | None = None  # this step and the ones after it skip the build cache


_TAG = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
Tag = Annotated[str, StringConstraints(pattern=_TAG)]
MAX_TAGS = 64


class TemplateUpdate(_Body):
    public: bool | None = None


class AssignTags(_Body):
    target: str = Field(min_length=1, max_length=400)  # name:tag (or a template id or name)
    tags: list[Tag] = Field(min_length=1, max_length=MAX_TAGS)


class DeleteTags(_Body):
    name: str = Field(min_length=1, max_length=400)
    tags: list[Tag] = Field(min_length=1, max_length=MAX_TAGS)


class BuildStart(_Body):
    from_image: str | None = Field(default=None, alias="fromImage")
    from_template: str | None = Field(default=None, alias="fromTemplate")
    from_image_registry: dict[str, Any] | None = Field(default=None, alias="fromImageRegistry")
    steps: list[StepBody] = Field(default_factory=list)
    start_cmd: str | None = Field(default=None, alias="startCmd")
    ready_cmd: str | None = Field(default=None, alias="readyCmd")
    force: bool | None = None  # the SDK's skip_cache: every step runs


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
            Route("/v2/templates", self.list_v2, methods=["GET"]),
            Route("/default-templates", self.default_templates, methods=["GET"]),
            # before /templates/{template_id}, which would take "tags" for an id
            Route("/templates/tags", self.assign_tags, methods=["POST"]),
            Route("/templates/tags", self.delete_tags, methods=["DELETE"]),
            Route("/templates/{template_id}/tags", self.tags, methods=["GET"]),
            Route("/templates/{template_id}/tags/count", self.tags_count, methods=["GET"]),
            Route("/templates/{template_id}/tags/exists", self.tag_exists, methods=["GET"]),
            Route("/templates/{template_id}", self.update_v1, methods=["PATCH"]),
            Route("/v2/templates/{template_id}", self.update_v2, methods=["PATCH"]),
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
            steps=[Step(type=s.type.upper(), args=list(s.args), files_hash=s.files_hash,
                        force=bool(s.force)) for s in body.steps],
            start_cmd=body.start_cmd or None, ready_cmd=body.ready_cmd or None,
            registry_credentials=bool(body.from_image_registry), force=bool(body.force))
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

    # ---------------------------------------------------------------- list, update, tags
    @property
    def _store(self) -> Store:
        return self.builds.manager.store

    @accepts(query=(QueryParam("teamID", description="ignored: one team per server"),
                     QueryParam("nextToken"), QueryParam("limit", "integer",
                                                         f"1..{MAX_PAGE}, default 100")))
    async def list_v2(self, request: Request) -> Response:
        """E2B's `GET /v2/templates`: `[Template]`, the next page's token in `X-Next-Token`."""
        q = request.query_params
        limit = _int_param(request, "limit", 100, 1)
        if limit > MAX_PAGE:
            raise invalid(f"limit must be between 1 and {MAX_PAGE}")
        token = q.get("nextToken") or "0"
        if not (token.isascii() and token.isdigit() and len(token) <= 12):
            raise invalid("nextToken is not a token this server issued")
        offset = int(token)
        items = [t for t in self._store.iter_templates() if not t.transient]
        headers = ({"X-Next-Token": str(offset + limit)} if offset + limit < len(items)
                   else {})
        return JSONResponse([template_body(t) for t in items[offset:offset + limit]],
                            headers=headers)

    async def default_templates(self, _: Request) -> Response:
        """E2B's `GET /default-templates`: the templates every server has (the default, and
        the code interpreter's once it is built), `isDefault` true."""
        names = {self.builds.config.sandbox.template, "base", CODE_INTERPRETER}
        found = [t for t in self._store.iter_templates() if names & set(t.names)]
        return JSONResponse([{**template_body(t), "isDefault": True} for t in found])

    async def _update(self, request: Request) -> TemplateRecord:
        body = await parse_body(request, TemplateUpdate)
        tpl = self.builds.manager.find_template(request.path_params["template_id"])
        if body.public is not None and body.public != tpl.public:
            tpl = replace(tpl, public=body.public)
            self._store.put_template(tpl)
        return tpl

    @accepts(TemplateUpdate)
    async def update_v1(self, request: Request) -> Response:
        tpl = await self._update(request)
        return JSONResponse({"names": list(tpl.names)})

    @accepts(TemplateUpdate)
    async def update_v2(self, request: Request) -> Response:
        """E2B's `TemplateUpdateResponse`."""
        tpl = await self._update(request)
        return JSONResponse({"names": list(tpl.names)})

    @accepts(AssignTags)
    async def assign_tags(self, request: Request) -> Response:
        """E2B's `AssignedTemplateTags`: `tags` now name the build `target` names."""
        body = await parse_body(request, AssignTags)
        tpl = self.builds.manager.find_template(body.target)
        now = datetime.now(UTC).isoformat()
        added = {t: now for t in body.tags if t != "default" and t not in tpl.tags}
        if added:
            tpl = replace(tpl, tags={**tpl.tags, **added})
            self._store.put_template(tpl)
        return JSONResponse({"tags": list(body.tags), "buildID": build_uuid(tpl)},
                            status_code=201)

    @accepts(DeleteTags)
    async def delete_tags(self, request: Request) -> Response:
        body = await parse_body(request, DeleteTags)
        tpl = self.builds.manager.find_template(body.name)
        if "default" in body.tags:
            raise invalid("the default tag names the latest build: it cannot be removed")
        missing = [t for t in body.tags if t not in tpl.tags]
        if missing:
            raise not_found(f"template '{body.name}' has no tag {', '.join(missing)}")
        self._store.put_template(replace(tpl, tags={
            t: at for t, at in tpl.tags.items() if t not in body.tags}))
        return Response(status_code=204)

    def _tags_of(self, request: Request) -> tuple[TemplateRecord, dict[str, str]]:
        tpl = self.builds.manager.find_template(request.path_params["template_id"])
        created = _ts(tpl.created_at) if tpl.created_at else _ts(datetime.fromtimestamp(0, UTC))
        tags = {"default": created}
        tags.update({t: _ts(datetime.fromisoformat(at)) for t, at in tpl.tags.items()})
        return tpl, tags

    async def tags(self, request: Request) -> Response:
        """E2B's `[TemplateTag]`: `default` and every tag of the template's build."""
        tpl, tags = self._tags_of(request)
        build = build_uuid(tpl)
        return JSONResponse([{"tag": t, "buildID": build, "createdAt": at}
                             for t, at in tags.items()])

    async def tags_count(self, request: Request) -> Response:
        _, tags = self._tags_of(request)
        return JSONResponse({"total": len(tags)})

    @accepts(query=(QueryParam("tag"),))
    async def tag_exists(self, request: Request) -> Response:
        tag = request.query_params.get("tag", "")
        if not re.match(_TAG, tag):
            raise invalid("tag is required: letters, digits, '.', '_', '-', at most 128")
        _, tags = self._tags_of(request)
        return JSONResponse({"exists": tag in tags, "normalizedTag": tag})


def build_uuid(tpl: TemplateRecord) -> str:
    """The id of a template's (one) build, as a UUID (what the SDK's tag models parse)."""
    created = tpl.created_at.isoformat() if tpl.created_at else ""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"aenv-build:{tpl.template_id}:{created}"))
