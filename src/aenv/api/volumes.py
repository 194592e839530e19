"""E2B volumes over HTTP: the control plane (`/volumes`, API key) and the volume content API
(`/volumecontent/{id}/...`, the volume's own bearer token, no sandbox involved), in the
shapes of the e2b 2.63 SDK (`e2b/api/client/api/volumes`, `e2b/volume/client`).

The SDK's `Volume` sends content requests to `E2B_VOLUME_API_URL` (else `https://api.<domain>`):
point it at this server. File bodies stream both ways (no whole file in memory); the
filesystem work runs in threads (`storage/volume_files.py`, which keeps every path inside
the volume). `PUT /sandboxes/{id}/network` (the live egress change) is here too: like the
volume routes it is an attachment of a sandbox, not part of its lifecycle.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from aenv.api.bodies import QueryParam, accepts, parse_body
from aenv.api.schemas import NetworkUpdate, NewVolume
from aenv.config import Config
from aenv.errors import invalid
from aenv.orchestrator.manager import SandboxManager
from aenv.orchestrator.volumes import VolumeManager, VolumeRecord
from aenv.storage.volume_files import VolumeFiles, read_chunks

CONTENT_PREFIX = "/volumecontent/"
MAX_ID = 2**32 - 2  # uids and gids (2**32 - 1 is "no change" to the kernel)


class EntryMetadata(BaseModel):
    """`PATCH /volumecontent/{id}/path`: what to change."""

    model_config = ConfigDict(extra="ignore")
    uid: int | None = Field(default=None, ge=0, le=MAX_ID)
    gid: int | None = Field(default=None, ge=0, le=MAX_ID)
    mode: int | None = Field(default=None, ge=0, le=0o7777)
_PATH_QUERY = (QueryParam("path"),)
_OWNER_QUERY = (QueryParam("path"), QueryParam("uid", "integer"), QueryParam("gid", "integer"),
                QueryParam("mode", "integer"), QueryParam("force"))


def _volume_body(rec: VolumeRecord, token: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"volumeID": rec.volume_id, "name": rec.name}
    if token:
        body["token"] = rec.token
    # aenv's own: the size (MiB) and whether it is enforced.
    body.update(sizeMB=rec.size_mb, quota=rec.quota)
    return body


def _int(request: Request, name: str, high: int) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 12 and int(raw) <= high):
        raise invalid(f"{name} must be an integer between 0 and {high}")
    return int(raw)


def _force(request: Request) -> bool:
    raw = request.query_params.get("force", "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise invalid("force must be true or false")
    return raw in ("true", "1")


def _path(request: Request) -> str:
    path = request.query_params.get("path")
    if path is None:
        raise invalid("the path query parameter is required")
    return path


class VolumeRoutes:
    def __init__(self, volumes: VolumeManager, manager: SandboxManager, config: Config) -> None:
        self.volumes = volumes
        self.manager = manager
        self.config = config

    def routes(self) -> list[Route]:
        c = CONTENT_PREFIX + "{volume_id}"
        return [
            Route("/volumes", self.create, methods=["POST"]),
            Route("/volumes", self.list, methods=["GET"]),
            Route("/volumes/{volume_id}", self.get, methods=["GET"]),
            Route("/volumes/{volume_id}", self.delete, methods=["DELETE"]),
            Route("/sandboxes/{sandbox_id}/network", self.update_network, methods=["PUT"]),
            Route(c + "/path", self.stat, methods=["GET"]),
            Route(c + "/path", self.set_metadata, methods=["PATCH"]),
            Route(c + "/path", self.remove, methods=["DELETE"]),
            Route(c + "/dir", self.list_dir, methods=["GET"]),
            Route(c + "/dir", self.make_dir, methods=["POST"]),
            Route(c + "/file", self.read_file, methods=["GET"]),
            Route(c + "/file", self.write_file, methods=["PUT"]),
        ]

    # -- control plane (API key) --------------------------------------------------------
    @accepts(NewVolume)
    async def create(self, request: Request) -> Response:
        body = await parse_body(request, NewVolume)
        rec = await asyncio.to_thread(self.volumes.create, body.name, body.size_mb)
        return JSONResponse(_volume_body(rec, token=True), status_code=201)

    async def list(self, _: Request) -> Response:
        return JSONResponse([_volume_body(r, token=False) for r in self.volumes.list()])

    async def get(self, request: Request) -> Response:
        rec = self.volumes.get(request.path_params["volume_id"])
        return JSONResponse(_volume_body(rec, token=True))

    async def delete(self, request: Request) -> Response:
        await asyncio.to_thread(self.volumes.delete, request.path_params["volume_id"])
        return Response(status_code=204)

    @accepts(NetworkUpdate, body_required=False)
    async def update_network(self, request: Request) -> Response:
        body = await parse_body(request, NetworkUpdate, allow_empty=True)
        await self.manager.update_network(request.path_params["sandbox_id"], body.as_update())
        return Response(status_code=204)

    # -- content (the volume's token) ---------------------------------------------------
    def _files(self, request: Request) -> VolumeFiles:
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        rec = self.volumes.authorize(request.path_params["volume_id"],
                                     token.strip() if scheme.lower() == "bearer" else "")
        return VolumeFiles(self.volumes.data_dir(rec.volume_id))

    @accepts(query=_PATH_QUERY)
    async def stat(self, request: Request) -> Response:
        files = self._files(request)
        entry = await asyncio.to_thread(files.stat, _path(request))
        return JSONResponse(entry.to_json())

    @accepts(query=(QueryParam("path"), QueryParam("depth", "integer")))
    async def list_dir(self, request: Request) -> Response:
        files = self._files(request)
        depth = _int(request, "depth", 1000)
        entries = await asyncio.to_thread(files.list_dir, _path(request),
                                          1 if depth is None else depth)
        return JSONResponse([e.to_json() for e in entries])

    @accepts(query=_OWNER_QUERY)
    async def make_dir(self, request: Request) -> Response:
        files = self._files(request)
        entry = await asyncio.to_thread(files.mkdir, _path(request), _int(request, "uid", MAX_ID),
                                        _int(request, "gid", MAX_ID),
                                        _int(request, "mode", 0o7777), _force(request))
        return JSONResponse(entry.to_json(), status_code=201)

    @accepts(query=_OWNER_QUERY)
    async def write_file(self, request: Request) -> Response:
        files = self._files(request)
        fd, path = await asyncio.to_thread(files.open_write, _path(request),
                                           _int(request, "uid", MAX_ID),
                                           _int(request, "gid", MAX_ID),
                                           _int(request, "mode", 0o7777), _force(request))
        try:
            async for chunk in request.stream():
                if chunk:
                    await asyncio.to_thread(files.write_chunk, fd, chunk, path)
        except BaseException:
            await asyncio.to_thread(files.finish_write, fd, path)
            raise
        entry = await asyncio.to_thread(files.finish_write, fd, path)
        return JSONResponse(entry.to_json(), status_code=201)

    @accepts(query=_PATH_QUERY)
    async def read_file(self, request: Request) -> Response:
        files = self._files(request)
        fd, size = await asyncio.to_thread(files.open_read, _path(request))
        return StreamingResponse(read_chunks(fd), media_type="application/octet-stream",
                                 headers={"content-length": str(size)})

    @accepts(EntryMetadata, body_required=False, query=_PATH_QUERY)
    async def set_metadata(self, request: Request) -> Response:
        files = self._files(request)
        body = await parse_body(request, EntryMetadata, allow_empty=True)
        entry = await asyncio.to_thread(files.set_metadata, _path(request), body.uid, body.gid,
                                        body.mode)
        return JSONResponse(entry.to_json())

    @accepts(query=_PATH_QUERY)
    async def remove(self, request: Request) -> Response:
        files = self._files(request)
        await asyncio.to_thread(files.remove, _path(request))
        return Response(status_code=204)

