"""An exception no handler maps still gets a `{code, message}` 500 on a connection that stays
usable. A real uvicorn serves a Starlette app built like the server's control plane; the fault
(a handler that raises) is the only artificial part: with every input path now answering 4xx
there is no request that makes the real server crash on purpose."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import CrashAnswer


async def crash(_: Request) -> Response:
    raise RuntimeError("a bug")


async def fine(_: Request) -> Response:
    return JSONResponse({"ok": True})


def serve(middleware: list[Middleware]) -> Iterator[str]:
    app = Starlette(routes=[Route("/crash", crash), Route("/fine", fine)], middleware=middleware)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def guarded() -> Iterator[str]:
    yield from serve([Middleware(CrashAnswer)])


@pytest.fixture
def unguarded() -> Iterator[str]:
    yield from serve([])


def client_port(response: httpx.Response) -> int:
    return int(response.extensions["network_stream"].get_extra_info("client_addr")[1])


def test_crash_is_json_500_and_the_connection_is_reused(guarded: str) -> None:
    with httpx.Client(base_url=guarded) as client:
        r = client.get("/crash")
        assert r.status_code == 500
        assert r.json() == {"code": 500, "message": "internal error: RuntimeError"}
        follow = client.get("/fine")
        assert follow.status_code == 200
        assert client_port(follow) == client_port(r)


def test_without_the_guard_the_connection_is_dropped(unguarded: str) -> None:
    """Control: Starlette's own handling closes the connection, so the test above can fail."""
    with httpx.Client(base_url=unguarded) as client:
        r = client.get("/crash")
        assert r.status_code == 500
        try:
            first = client_port(r)
            follow = client.get("/fine")
        except (OSError, httpx.TransportError):
            return  # the connection was closed under the client: what the guard prevents
        assert client_port(follow) != first
