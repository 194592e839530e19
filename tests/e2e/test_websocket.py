"""WebSocket (and any HTTP/1.1 upgrade) to a sandbox port through the proxy, and streaming
responses that must not be buffered. The client is the `websockets` library; the server is a
stdlib RFC 6455 echo server inside the sandbox (tests/data/echo_server.py).

Both routing styles: `E2b-Sandbox-Id`/`E2b-Sandbox-Port` headers, and a
`<port>-<id>.<domain>` host (this module's own server has a sandbox domain).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import websockets
from e2b import Sandbox
from e2e_helpers import wait_until
from sandbox_helpers import runtime_env
from websockets.asyncio.client import ClientConnection, connect

from aenv.devserver import ServerProcess, sdk_server

DOMAIN = "sbx.aenv.test"
PORT = 8765
ECHO = Path(__file__).resolve().parent.parent / "data" / "echo_server.py"


@pytest.fixture(scope="module")
def ws_server() -> Iterator[ServerProcess]:
    """A server of this module's own: host-based routing needs a sandbox domain."""
    with sdk_server("aenv-ws-", extra_env=runtime_env(AENV_SERVER_DOMAIN=DOMAIN)) as srv:
        yield srv


@pytest.fixture(scope="module")
def sbx(ws_server: ServerProcess) -> Iterator[Sandbox]:
    s = Sandbox.create(timeout=900)  # sdk_server pointed the SDK at ws_server
    try:
        s.files.write("/home/user/echo_server.py", ECHO.read_text())
        s.commands.run(f"python3 /home/user/echo_server.py {PORT}", background=True)
        wait_until(lambda: _stats(ws_server, s) is not None, 20, what="the echo server")
        yield s
    finally:
        s.kill()


def _stats(server: ServerProcess, s: Sandbox) -> int | None:
    """WebSocket connections open in the sandbox's echo server (plain HTTP through the proxy)."""
    try:
        resp = httpx.get(f"{server.url}/stats", timeout=5,
                         headers={"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": str(PORT)})
    except httpx.HTTPError:
        return None
    return int(resp.text) if resp.status_code == 200 else None


def _server_sockets(server: ServerProcess) -> int:
    """Sockets held by the `aenv serve` process (the proxy's both ends of every tunnel)."""
    assert server.proc is not None
    fd_dir = f"/proc/{server.proc.pid}/fd"
    n = 0
    for fd in os.listdir(fd_dir):
        try:
            n += os.readlink(f"{fd_dir}/{fd}").startswith("socket:")
        except FileNotFoundError:
            pass
    return n


def _by_headers(server: ServerProcess, s: Sandbox) -> dict[str, object]:
    return {"uri": f"ws://127.0.0.1:{server.port}/echo",
            "additional_headers": {"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": str(PORT)}}


def _by_host(server: ServerProcess, s: Sandbox) -> dict[str, object]:
    # The Host header names the sandbox; the TCP connection goes to the server itself.
    sock = socket.create_connection(("127.0.0.1", server.port))
    return {"uri": f"ws://{PORT}-{s.sandbox_id}.{DOMAIN}/echo", "sock": sock}


ROUTES = {"headers": _by_headers, "host": _by_host}


@pytest.fixture
async def ws_factory(ws_server: ServerProcess,
                     sbx: Sandbox) -> AsyncIterator[dict[str, object]]:
    opened: list[ClientConnection] = []

    async def open_ws(route: str, **kwargs: object) -> ClientConnection:
        args = {**ROUTES[route](ws_server, sbx), "max_size": None, "ping_interval": None,
                "open_timeout": 30, **kwargs}
        ws = await connect(**args)  # type: ignore[arg-type]
        opened.append(ws)
        return ws

    yield {"open": open_ws}
    for ws in opened:
        await ws.close()


@pytest.mark.parametrize("route", ["headers", "host"])
async def test_thousand_messages_each_way_concurrently(route: str,
                                                        ws_factory: dict[str, object]) -> None:
    ws = await ws_factory["open"](route)  # type: ignore[operator]
    messages = [f"message {i} " + "x" * (i % 300) for i in range(1000)]

    async def sender() -> None:
        for m in messages:
            await ws.send(m)
        await ws.send(b"\x00binary\xff")

    task = asyncio.create_task(sender())
    got = [await asyncio.wait_for(ws.recv(), 30) for _ in messages]
    await task
    assert got == messages
    assert await ws.recv() == b"\x00binary\xff"
    pong = await ws.ping(b"are you there")
    await asyncio.wait_for(pong, 10)


@pytest.mark.parametrize("route", ["headers", "host"])
async def test_ten_mib_message(route: str, ws_factory: dict[str, object]) -> None:
    ws = await ws_factory["open"](route)  # type: ignore[operator]
    payload = os.urandom(10 << 20)
    await ws.send(payload)
    back = await asyncio.wait_for(ws.recv(), 60)
    assert isinstance(back, bytes) and len(back) == len(payload)
    assert hashlib.sha256(back).digest() == hashlib.sha256(payload).digest()
    # A fragmented message is echoed frame by frame and reassembled by the client.
    await ws.send(iter([b"frag-1|", b"frag-2|", b"frag-3"]))
    assert await ws.recv() == b"frag-1|frag-2|frag-3"


async def test_close_frame_code_and_reason_pass_both_ways(ws_factory: dict[str, object]) -> None:
    ws = await ws_factory["open"]("headers")  # type: ignore[operator]
    await ws.send("before close")
    assert await ws.recv() == "before close"
    await ws.close(code=4001, reason="done here")
    # The echo server answered with our close frame's payload: code and reason came back.
    assert (ws.close_code, ws.close_reason) == (4001, "done here")


async def test_no_idle_timeout(ws_factory: dict[str, object]) -> None:
    """uvicorn's keep-alive timeout (5 s) and any proxy read timeout must not end a quiet
    WebSocket: it lives as long as its sandbox."""
    ws = await ws_factory["open"]("host")  # type: ignore[operator]
    await asyncio.sleep(12)
    await ws.send("still open")
    assert await asyncio.wait_for(ws.recv(), 10) == "still open"


async def test_client_gone_mid_stream_leaves_no_socket(ws_server: ServerProcess, sbx: Sandbox,
                                                      ws_factory: dict[str, object]) -> None:
    warm = await ws_factory["open"]("headers")  # type: ignore[operator]
    await warm.send("warm")
    await warm.recv()
    await warm.close()
    await asyncio.to_thread(wait_until, lambda: _stats(ws_server, sbx) == 0, 10,
                            what="the warm-up connection to close")
    baseline = _server_sockets(ws_server)

    ws = await ws_factory["open"]("headers")  # type: ignore[operator]
    await ws.send("hello")
    assert await ws.recv() == "hello"
    assert _stats(ws_server, sbx) == 1  # positive control: the probe sees an open connection
    assert _server_sockets(ws_server) >= baseline + 2  # client side + sandbox side
    # Mid-stream: a 10 MiB message half sent, the echo under way, then the client vanishes
    # without a close frame (a crashed client: the TCP connection is simply reset).
    send = asyncio.create_task(ws.send(os.urandom(10 << 20)))
    await asyncio.sleep(0.05)
    ws.transport.abort()
    send.cancel()
    # Polled from a thread: the abort completes on this event loop, which must keep running.
    await asyncio.to_thread(wait_until, lambda: _stats(ws_server, sbx) == 0, 20,
                            what="the sandbox's socket to close")
    await asyncio.to_thread(wait_until, lambda: _server_sockets(ws_server) <= baseline, 20,
                            what=f"the server's sockets back to {baseline}")


async def test_pause_closes_tunnels_and_resume_serves_new_ones(ws_server: ServerProcess) -> None:
    s = await asyncio.to_thread(Sandbox.create, timeout=300)
    try:
        await asyncio.to_thread(s.files.write, "/home/user/echo_server.py", ECHO.read_text())
        await asyncio.to_thread(s.commands.run, f"python3 /home/user/echo_server.py {PORT}", background=True)
        await asyncio.to_thread(wait_until, lambda: _stats(ws_server, s) is not None, 20,
                                what="the echo server")
        baseline = _server_sockets(ws_server)
        ws = await connect(**_by_headers(ws_server, s), ping_interval=None)  # type: ignore[arg-type]
        await ws.send("before pause")
        assert await ws.recv() == "before pause"
        # Positive control: the probes see the tunnel (the sandbox's end open; the server's
        # count up, by one at least: a pooled idle upstream connection may close meanwhile).
        assert _stats(ws_server, s) == 1
        assert _server_sockets(ws_server) >= baseline + 1
        await asyncio.to_thread(s.pause)
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 20)
        await asyncio.to_thread(wait_until, lambda: _server_sockets(ws_server) <= baseline, 20,
                                what="the paused sandbox's tunnel sockets to close")
        # Traffic resumes a paused sandbox only with auto-resume: connect, then a new tunnel.
        await asyncio.to_thread(Sandbox.connect, s.sandbox_id)
        again = await connect(**_by_headers(ws_server, s), ping_interval=None)  # type: ignore[arg-type]
        await again.send("after resume")
        assert await again.recv() == "after resume"
        await again.close()
    finally:
        await asyncio.to_thread(s.kill)


def _raw_upgrade(server: ServerProcess, s: Sandbox, protocol: str, port: int = PORT,
                 path: str = "/raw") -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: {protocol}\r\n"
                 f"E2b-Sandbox-Id: {s.sandbox_id}\r\nE2b-Sandbox-Port: {port}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        data = sock.recv(4096)
        if not data:
            break
        head += data
    return sock, head


def _read_to_eof(sock: socket.socket) -> bytes:
    out = b""
    while data := sock.recv(65536):
        out += data
    return out


def test_any_upgrade_protocol_and_half_close(ws_server: ServerProcess, sbx: Sandbox) -> None:
    sock, head = _raw_upgrade(ws_server, sbx, "x-raw-echo")
    try:
        assert head.startswith(b"HTTP/1.1 101 "), head
        sock.sendall(b"raw bytes, not websocket frames\n")
        # Half-close: our FIN reaches the sandbox as a FIN, and its answer still comes back.
        sock.shutdown(socket.SHUT_WR)
        rest = _read_to_eof(sock)
        assert head.split(b"\r\n\r\n", 1)[1] + rest == (
            b"raw bytes, not websocket frames\nbye after your FIN\n")
    finally:
        sock.close()


def test_bytes_sent_with_the_upgrade_request_are_kept(ws_server: ServerProcess,
                                                      sbx: Sandbox) -> None:
    """A client may send its first bytes of the new protocol in the request's own segment."""
    with socket.create_connection(("127.0.0.1", ws_server.port), timeout=10) as sock:
        sock.sendall(f"GET /raw HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                     f"Upgrade: x-raw-echo\r\nE2b-Sandbox-Id: {sbx.sandbox_id}\r\n"
                     f"E2b-Sandbox-Port: {PORT}\r\n\r\nearly bytes\n".encode())
        sock.shutdown(socket.SHUT_WR)
        answer = _read_to_eof(sock)
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101 "), answer
    assert rest == b"early bytes\nbye after your FIN\n"


def test_refused_upgrade_is_answered_and_closed(ws_server: ServerProcess, sbx: Sandbox) -> None:
    sock, head = _raw_upgrade(ws_server, sbx, "x-unknown")
    try:
        rest = _read_to_eof(sock)  # the connection ends after the refusal
        assert head.startswith(b"HTTP/1.1 400 "), head
        assert (head + rest).endswith(b"not a websocket\n")
    finally:
        sock.close()


def test_upgrade_to_a_closed_port_is_a_502(ws_server: ServerProcess, sbx: Sandbox) -> None:
    sock, head = _raw_upgrade(ws_server, sbx, "websocket", port=9)
    try:
        body = head + _read_to_eof(sock)
        assert head.startswith(b"HTTP/1.1 502 "), head
        assert b"port is not open" in body
    finally:
        sock.close()


async def test_upgrade_to_an_unknown_sandbox(ws_server: ServerProcess) -> None:
    with pytest.raises(websockets.InvalidStatus) as exc_info:
        await connect(f"ws://127.0.0.1:{ws_server.port}/", open_timeout=30,
                      additional_headers={"E2b-Sandbox-Id": "zzzzzzzzzzzzzzzzzzzz",
                                          "E2b-Sandbox-Port": str(PORT)})
    assert exc_info.value.response.status_code == 502


def test_server_sent_events_are_not_buffered(ws_server: ServerProcess, sbx: Sandbox) -> None:
    arrivals: list[float] = []
    start = time.monotonic()
    with httpx.stream("GET", f"{ws_server.url}/stream", timeout=30,
                      headers={"E2b-Sandbox-Id": sbx.sandbox_id,
                               "E2b-Sandbox-Port": str(PORT)}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"] == "text/event-stream"
        for line in resp.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic() - start)
    assert len(arrivals) == 20
    # 20 events 50 ms apart: the first arrives long before the last is sent.
    assert arrivals[0] < arrivals[-1] - 0.5, arrivals
