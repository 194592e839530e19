"""Reverse proxy for sandbox traffic: envd (port 49983) and any other port inside a sandbox.

Routing, in order:
1. `E2b-Sandbox-Id` + `E2b-Sandbox-Port` headers (what the SDK sends with E2B_SANDBOX_URL);
2. the Host header `<port>-<sandboxID>.<domain>` (E2B's host-based scheme);
3. a signed `/files` URL (the SDK's `download_url`/`upload_url` carry no sandbox header): the
   sandbox is the one whose access token verifies the signature.
A sandbox created with `network.allowPublicTraffic: false` answers on ports other than envd's
only to requests carrying its `e2b-traffic-access-token` (403 otherwise; the header is not
passed on), and `network.maskRequestHost` (`${PORT}` substituted) is the Host its ports see.
The proxy speaks HTTP/1.1 to the sandbox over a socket the runtime driver opens inside the
sandbox's network namespace, streams bodies both ways without buffering (Connect streams are
long-lived and flushed per frame), and keeps idle upstream connections for reuse.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

from starlette.types import Message, Receive, Scope, Send

from aenv.errors import AenvError, ErrorCode
from aenv.orchestrator.manager import SandboxManager

log = logging.getLogger("aenv.proxy")

_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer",
                         b"upgrade", b"proxy-authorization", b"proxy-authenticate", b"host"})
# Not forwarded upstream: uvicorn already answered the client's `Expect: 100-continue`, and an
# upstream asked again would send an interim `100 Continue` of its own.
_REQUEST_ONLY_HERE = frozenset({b"expect"})
# Not relayed to the client: uvicorn writes its own Date (two Date fields are invalid).
_RESPONSE_ONLY_HERE = frozenset({b"content-length", b"date"})
_HOST_RE = re.compile(r"^(\d{1,5})-([a-z0-9]+)\.")
TRAFFIC_TOKEN_HEADER = b"e2b-traffic-access-token"
MAX_IDLE_PER_TARGET = 8
_MAX_HEAD = 64 * 1024


@dataclass(frozen=True)
class Target:
    sandbox_id: str
    port: int


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def route_by_headers(scope: Scope, domain: str | None) -> Target | None:
    sandbox_id = _header(scope, b"e2b-sandbox-id")
    if sandbox_id:
        port = _header(scope, b"e2b-sandbox-port") or "49983"
        return Target(sandbox_id, int(port)) if port.isdigit() else None
    host = (_header(scope, b"host") or "").split(":")[0]
    if domain and host.endswith("." + domain):
        m = _HOST_RE.match(host)
        if m:
            return Target(m.group(2), int(m.group(1)))
    return None


def traffic_refusal(manager: SandboxManager, target: Target,
                    headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why a request to `target` is refused for want of the sandbox's traffic access token,
    or None (allowed; also when the sandbox is unknown: the caller's 502 says so)."""
    try:
        rec = manager.get(target.sandbox_id)
    except AenvError:
        return None
    if rec.traffic_access_token is None or target.port == manager.config.sandbox.envd_port:
        return None
    given = next((v for k, v in headers if k.lower() == TRAFFIC_TOKEN_HEADER), b"")
    if not given:
        return (f"sandbox {target.sandbox_id} does not accept public traffic: send its "
                "trafficAccessToken in the e2b-traffic-access-token header")
    if not hmac.compare_digest(given, rec.traffic_access_token.encode()):
        return "invalid e2b-traffic-access-token"
    return None


def upstream_host(manager: SandboxManager, target: Target) -> bytes:
    """The Host the sandbox's port sees: its `maskRequestHost`, else 127.0.0.1:<port>."""
    try:
        mask = manager.get(target.sandbox_id).network.get("maskRequestHost")
    except AenvError:
        mask = None
    if isinstance(mask, str) and mask:
        return mask.replace("${PORT}", str(target.port)).encode("latin-1", errors="replace")
    return b"127.0.0.1:%d" % target.port


def file_signature(path: str, op: str, username: str, token: str, expiration: str | None) -> str:
    raw = f"{path}:{op}:{username}:{token}" + (f":{expiration}" if expiration else "")
    digest = base64.b64encode(hashlib.sha256(raw.encode()).digest()).decode().rstrip("=")
    return "v1_" + digest


def route_by_signature(scope: Scope, tokens: Callable[[], list[tuple[str, str]]]) -> Target | None:
    if scope["path"] != "/files":
        return None
    query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True))
    signature = query.get("signature")
    if not signature or "path" not in query:
        return None
    op = "read" if scope["method"] in ("GET", "HEAD") else "write"  # as envd checks it
    for sandbox_id, token in tokens():
        expected = file_signature(query["path"], op, query.get("username", ""), token,
                                  query.get("signature_expiration"))
        if expected == signature:
            return Target(sandbox_id, 49983)
    return None


@dataclass
class _Upstream:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def close(self) -> None:
        self.writer.close()


@dataclass
class _Pool:
    idle: dict[Target, list[_Upstream]] = field(default_factory=dict)

    def take(self, target: Target) -> _Upstream | None:
        conns = self.idle.get(target)
        while conns:
            conn = conns.pop()
            if not conn.reader.at_eof() and not conn.writer.is_closing():
                return conn
            conn.close()
        return None

    def give(self, target: Target, conn: _Upstream) -> None:
        conns = self.idle.setdefault(target, [])
        if len(conns) >= MAX_IDLE_PER_TARGET:
            conn.close()
        else:
            conns.append(conn)

    def drop(self, sandbox_id: str) -> None:
        for target in [t for t in self.idle if t.sandbox_id == sandbox_id]:
            for conn in self.idle.pop(target):
                conn.close()


class UpstreamError(Exception):
    """The upstream failed before the response started: answer with a 502."""


class ResponseAborted(Exception):
    """The upstream failed mid-response: the client connection must be aborted."""


@dataclass(frozen=True)
class _ResponseHead:
    status: int
    headers: list[tuple[bytes, bytes]]
    http10: bool  # an HTTP/1.0 answer: the connection closes after it unless it says keep-alive


async def _read_head(reader: asyncio.StreamReader) -> _ResponseHead:
    """The final response head; interim 1xx answers (other than 101) are skipped."""
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError) as exc:
            raise UpstreamError(f"upstream closed before answering: {exc}") from None
        lines = head[:-4].split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[1].isdigit() or not parts[0].startswith(b"HTTP/1."):
            raise UpstreamError(f"malformed status line {lines[0][:80]!r}")
        status = int(parts[1])
        if 100 <= status < 200 and status != 101:
            continue
        headers = []
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers.append((name.strip().lower(), value.strip()))
        return _ResponseHead(status, headers, parts[0] == b"HTTP/1.0")


class SandboxProxy:
    def __init__(self, manager: SandboxManager) -> None:
        self.manager = manager
        self.pool = _Pool()
        manager.on_stop_serving(self.pool.drop)

    def access_tokens(self) -> list[tuple[str, str]]:
        return [(sid, self.manager.get(sid).envd_access_token) for sid in self.manager.running_ids()]

    async def _send_error(self, send: Send, status: int, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _not_running(self, send: Send, target: Target, message: str) -> None:
        # The E2B edge's exact shape: the SDK maps "was not found" to SandboxNotRunning and
        # "port is not open" to SandboxUnreachable.
        body = json.dumps({"sandboxId": target.sandbox_id, "message": message, "code": 502})
        await self._send_error(send, 502, body.encode())

    async def _open(self, target: Target) -> _Upstream:
        conn = self.pool.take(target)
        if conn is not None:
            return conn
        sock = await self.manager.open_port(target.sandbox_id, target.port)
        reader, writer = await asyncio.open_connection(sock=sock, limit=_MAX_HEAD)
        return _Upstream(reader, writer)

    async def __call__(self, scope: Scope, receive: Receive, send: Send, target: Target) -> None:
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 1011})
            return
        refusal = traffic_refusal(self.manager, target, scope["headers"])
        if refusal is not None:
            body = json.dumps({"sandboxId": target.sandbox_id, "message": refusal, "code": 403})
            await self._send_error(send, 403, body.encode())
            return
        try:
            conn = await self._open(target)
        except AenvError as exc:
            if exc.code is ErrorCode.PORT_CLOSED:
                await self._not_running(send, target,
                                        f"The sandbox is running but port is not open: {exc.message}")
            else:
                await self._not_running(send, target, "The sandbox was not found")
            return
        try:
            reusable = await self._exchange(scope, receive, send, target, conn)
        except ResponseAborted as exc:
            conn.close()
            log.info("proxy to %s:%d: %s", target.sandbox_id, target.port, exc)
            raise
        except UpstreamError as exc:
            conn.close()
            log.info("proxy to %s:%d failed: %s", target.sandbox_id, target.port, exc)
            await self._not_running(send, target, f"The sandbox was not found ({exc})")
            return
        except BaseException:
            conn.close()
            raise
        if reusable:
            self.pool.give(target, conn)
        else:
            conn.close()

    async def _exchange(self, scope: Scope, receive: Receive, send: Send, target: Target,
                        conn: _Upstream) -> bool:
        """One request/response. Returns True when the upstream connection can be reused."""
        has_length = any(k.lower() == b"content-length" for k, _ in scope["headers"])
        chunked_in = any(k.lower() == b"transfer-encoding" for k, _ in scope["headers"])
        path = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            path += b"?" + scope["query_string"]
        head = [scope["method"].encode() + b" " + path + b" HTTP/1.1",
                b"host: " + upstream_host(self.manager, target)]
        head += [k + b": " + v for k, v in scope["headers"]
                 if k.lower() not in _HOP_BY_HOP and k.lower() not in _REQUEST_ONLY_HERE
                 and k.lower() != TRAFFIC_TOKEN_HEADER]
        if chunked_in or not has_length and scope["method"] not in ("GET", "HEAD", "DELETE",
                                                                     "OPTIONS"):
            head.append(b"transfer-encoding: chunked")
            chunked_out = True
        else:
            chunked_out = False
        w = conn.writer
        w.write(b"\r\n".join(head) + b"\r\n\r\n")

        disconnected = asyncio.Event()
        body_done = asyncio.Event()
        # Forward the request body as it arrives (client-streaming RPCs need it incrementally),
        # then keep listening so that a client that goes away closes the upstream stream.
        async def pump_request() -> None:
            more = True
            while more:
                msg: Message = await receive()
                if msg["type"] == "http.disconnect":
                    disconnected.set()
                    return
                body = msg.get("body", b"")
                more = msg.get("more_body", False)
                if chunked_out:
                    if body:
                        w.write(b"%x\r\n%b\r\n" % (len(body), body))
                    if not more:
                        w.write(b"0\r\n\r\n")
                elif body:
                    w.write(body)
                await w.drain()
            body_done.set()
            msg = await receive()
            if msg["type"] == "http.disconnect":
                disconnected.set()

        pump = asyncio.create_task(pump_request())
        try:
            return await self._relay_response(scope, send, conn, pump, disconnected, body_done)
        finally:
            if not pump.done():
                pump.cancel()

    async def _relay_response(self, scope: Scope, send: Send, conn: _Upstream,
                              pump: asyncio.Task[None], disconnected: asyncio.Event,
                              body_done: asyncio.Event) -> bool:
        reader = conn.reader
        head_task = asyncio.ensure_future(_read_head(reader))
        first: set[asyncio.Future[Any]] = {head_task, pump}
        done, _ = await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if head_task not in done:
            if disconnected.is_set():
                head_task.cancel()
                return False
            pump_exc = None if pump.cancelled() else pump.exception()
            if pump_exc is not None:
                head_task.cancel()
                raise UpstreamError(f"sending the request failed: {pump_exc}")
        response = await head_task
        status, headers = response.status, response.headers
        try:
            length = next((int(v) for k, v in headers if k == b"content-length"), None)
        except ValueError:
            raise UpstreamError("malformed content-length") from None
        chunked = any(k == b"transfer-encoding" and b"chunked" in v.lower() for k, v in headers)
        tokens = {t.strip().lower() for k, v in headers if k == b"connection" for t in v.split(b",")}
        keep_alive = b"close" not in tokens and (not response.http10 or b"keep-alive" in tokens)
        bodiless = scope["method"] == "HEAD" or status in (204, 304) or 100 <= status < 200
        # The length is re-added once, from the parsed value: passing the upstream's header
        # through as well sent it twice, which undici (the JS SDK's fetch) rejects. A HEAD
        # answer keeps it (the length of what a GET would send); uvicorn would hold a 204 or
        # 304 that carries one to a body that never comes.
        out_headers = [(k, v) for k, v in headers
                       if k not in _HOP_BY_HOP and k not in _RESPONSE_ONLY_HERE]
        if length is not None and not chunked and (scope["method"] == "HEAD" or not bodiless):
            out_headers.append((b"content-length", str(length).encode()))
        await send({"type": "http.response.start", "status": status, "headers": out_headers})
        if bodiless:
            await send({"type": "http.response.body", "body": b""})
            return keep_alive and body_done.is_set()

        async def next_piece() -> bytes | None:
            """The next piece of response body, or None at its end."""
            nonlocal length
            if chunked:
                size_line = await reader.readline()
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b""):
                        pass  # trailers
                    return None
                data = await reader.readexactly(size + 2)
                return data[:-2]
            if length is not None:
                if length == 0:
                    return None
                data = await reader.read(min(length, 256 * 1024))
                if not data:
                    raise asyncio.IncompleteReadError(b"", length)
                length -= len(data)
                return data
            data = await reader.read(256 * 1024)
            return data or None

        stop = asyncio.ensure_future(disconnected.wait())
        try:
            while True:
                piece_task = asyncio.ensure_future(next_piece())
                waiters: set[asyncio.Future[Any]] = {piece_task, stop}
                done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                if piece_task not in done:
                    piece_task.cancel()
                    return False  # client went away mid-stream: drop the upstream stream
                try:
                    piece = piece_task.result()
                except (asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
                    # Ending the body normally would present a truncated answer as complete;
                    # aborting the client connection tells the client it is incomplete.
                    raise ResponseAborted(f"upstream response cut short: {exc!r}") from None
                if piece is None:
                    await send({"type": "http.response.body", "body": b""})
                    return keep_alive and (length is not None or chunked) and body_done.is_set()
                await send({"type": "http.response.body", "body": piece, "more_body": True})
        finally:
            stop.cancel()
