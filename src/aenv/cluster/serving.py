"""What the cluster's servers (scheduler, gateway) share: parsing `--listen`, JSON errors
from `AenvError`s, and running an ASGI app under uvicorn.

Owns: nothing stateful. Must not touch: the node's server (`aenv serve` runs its own).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aenv.api.errors import error_response, from_aenv_error
from aenv.errors import AenvError, invalid


def split_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise invalid(f"--listen must be HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)


async def json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise invalid("the body is not JSON") from None
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    return body


async def on_aenv_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, AenvError)
    return from_aenv_error(exc)


def health_response(body: dict[str, Any], ready: bool) -> Response:
    if not ready:
        return error_response(503, "not ready: " + json.dumps(body))
    return JSONResponse(body)


def run(app: Any, listen: str, http: Any = "httptools") -> None:
    host, port = split_listen(listen)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per etcd request
    uvicorn.run(app, host=host, port=port, loop="uvloop", http=http, ws="none",
                server_header=False, log_level="warning", lifespan="on",
                timeout_graceful_shutdown=5)
