"""Routes for image templates: `POST /aenv/images/pull` (native, NDJSON progress stream) and
`GET /templates` (E2B's template list shape).

Owns: request parsing and the wire shape of pull events and template bodies. The pull itself
is `aenv.images.pull.ImagePuller`; a pull keeps running to the end (and registers its
template) if the client goes away.
Must not touch: sandboxes, the E2B sandbox routes (`api/routes.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from aenv.api.bodies import accepts, parse_body
from aenv.api.errors import STATUS_BY_CODE
from aenv.envd.settings import ENVD_VERSION
from aenv.errors import AenvError, ErrorCode
from aenv.images.pull import ImagePuller
from aenv.orchestrator.models import TemplateRecord
from aenv.orchestrator.store import Store

log = logging.getLogger("aenv.api")

_EPOCH = "1970-01-01T00:00:00Z"


class PullBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image: str = Field(min_length=1, max_length=512)
    name: str | None = Field(default=None, min_length=1, max_length=256)
    insecure: bool = False


def template_kind(tpl: TemplateRecord) -> str:
    if tpl.image is not None:
        return "snapshot"
    return "image" if tpl.source_image is not None else "base"


def template_body(tpl: TemplateRecord) -> dict[str, Any]:
    """E2B's `Template` fields, plus aenv's `kind`, `sourceImage`, `defaultUser`."""
    created = (tpl.created_at.isoformat().replace("+00:00", "Z") if tpl.created_at else _EPOCH)
    return {
        "templateID": tpl.template_id, "buildID": tpl.template_id,
        "cpuCount": tpl.cpu_count, "memoryMB": tpl.memory_mb, "diskSizeMB": tpl.disk_size_mb,
        "public": tpl.public, "aliases": list(tpl.names), "names": list(tpl.names),
        "createdAt": created, "updatedAt": created, "createdBy": None, "lastSpawnedAt": None,
        "spawnCount": 0, "buildCount": 1, "envdVersion": ENVD_VERSION, "buildStatus": "ready",
        "kind": template_kind(tpl), "sourceImage": tpl.source_image,
        "defaultUser": tpl.default_user, "layers": len(tpl.layers),
    }


class ImageRoutes:
    def __init__(self, puller: ImagePuller, store: Store) -> None:
        self.puller = puller
        self.store = store
        self._pulls: set[asyncio.Task[None]] = set()  # running pulls, kept referenced

    def routes(self) -> list[Route]:
        return [
            Route("/aenv/images/pull", self.pull, methods=["POST"]),
            Route("/templates", self.list_templates, methods=["GET"]),
            Route("/aenv/images/cache", self.cache, methods=["GET"]),
        ]

    async def cache(self, _: Request) -> Response:
        """The image layer cache: counters and every layer (most recently used first)."""
        cache = self.puller.cache
        return JSONResponse({**cache.stats().to_json(), "entries": cache.listing()})

    async def list_templates(self, _: Request) -> Response:
        return JSONResponse([template_body(t) for t in self.store.iter_templates()])

    @accepts(PullBody)
    async def pull(self, request: Request) -> Response:
        body = await parse_body(request, PullBody)
        # Bad references and name conflicts answer with a status, before the stream starts.
        self.puller.check(body.image, body.name)
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

        async def run() -> None:
            try:
                tpl = await self.puller.pull(body.image, body.name, body.insecure,
                                             queue.put_nowait)
                queue.put_nowait({"type": "template", "template": template_body(tpl)})
            except AenvError as exc:
                queue.put_nowait({"type": "error", "code": exc.code.value,
                                  "status": STATUS_BY_CODE[exc.code], "message": exc.message})
            except Exception as exc:  # the stream has started: report instead of a 500
                log.exception("pull of %s failed", body.image)
                queue.put_nowait({"type": "error", "code": ErrorCode.INTERNAL.value, "status": 500,
                                  "message": f"internal error: {type(exc).__name__}: {exc}"})
            finally:
                queue.put_nowait(None)

        task = asyncio.create_task(run())
        self._pulls.add(task)
        task.add_done_callback(self._pulls.discard)

        async def lines() -> AsyncIterator[bytes]:
            while (item := await queue.get()) is not None:
                yield (json.dumps(item) + "\n").encode()

        return StreamingResponse(lines(), media_type="application/x-ndjson")
