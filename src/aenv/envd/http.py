"""A small HTTP/1.1 server on a raw asyncio Protocol (no `http.server`, no streams API).

Owns: parsing requests (case-insensitive headers, form-urlencoded queries, Content-Length
and chunked bodies decoded incrementally, `Expect: 100-continue`), framing responses
(Content-Length, chunked streaming with one flush per write, bodiless 204), keep-alive
with many concurrent long-lived connections (an answer that ends its connection says
`Connection: close`: an early answer first skips the unread request body, up to 1 MiB), and
telling a handler when its client hung up.

Why a Protocol rather than asyncio streams: a streaming handler (a command's output, a
directory watch) must learn that its client went away while it is only writing. A
Protocol sees `eof_received`/`connection_lost` directly and resolves `Request.gone`;
StreamReader would only report it on the next read.

Handlers are `async def handler(request, response)`. An exception that escapes a handler
is logged to stderr; the client gets a bare 500 JSON error (or a dropped connection if the
response had already started) and never a traceback.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from aenv.envd.log import log_exception

MAX_HEAD = 64 * 1024
# Stop reading from the socket while this much request data is waiting for a handler:
# an upload must not be buffered in memory faster than it is written to disk.
READ_HIGH_WATER = 256 * 1024
# Idle keep-alive connections are dropped after this long; longer than the SDK pool's
# 300 s expiry so that the client, not the server, normally closes them.
IDLE_TIMEOUT = 900.0

REASONS = {
    100: "Continue",
    200: "OK",
    204: "No Content",
    206: "Partial Content",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    406: "Not Acceptable",
    409: "Conflict",
    411: "Length Required",
    413: "Payload Too Large",
    415: "Unsupported Media Type",
    416: "Range Not Satisfiable",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    499: "Client Closed Request",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    507: "Insufficient Storage",
}


class ClientGone(ConnectionError):
    """The peer closed the connection (or sent a truncated request body)."""


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


Handler = Callable[["Request", "Response"], Awaitable[None]]

_HEX = frozenset(b"0123456789abcdefABCDEF")
_TCP_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)


def unquote_plus(text: str) -> str:
    """Form-urlencoded decoding: `+` is a space and `%XX` a byte of UTF-8."""
    text = text.replace("+", " ")
    if "%" not in text:
        return text
    pieces = text.encode("utf-8", "surrogateescape").split(b"%")
    out = bytearray(pieces[0])
    for piece in pieces[1:]:
        code = piece[:2]
        if len(code) == 2 and all(c in _HEX for c in code):
            out.append(int(code, 16))
            out += piece[2:]
        else:
            out += b"%" + piece
    # surrogateescape keeps undecodable bytes, so odd file names survive to the filesystem.
    return out.decode("utf-8", "surrogateescape")


def parse_query(query: str) -> dict[str, str]:
    """First value wins, as in Go's `url.Values.Get`."""
    result: dict[str, str] = {}
    for part in query.split("&"):
        if not part:
            continue
        key, _, value = part.partition("=")
        result.setdefault(unquote_plus(key), unquote_plus(value))
    return result


class Connection(asyncio.Protocol):
    """One client connection: buffers input, parses requests one after another."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._eof = False
        self.closed = False
        self._read_waiter: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._writing_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self.gone: asyncio.Future[None] = self._loop.create_future()
        self._task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None

    # -- asyncio.Protocol callbacks ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._sock = transport.get_extra_info("socket")
        if self._sock is not None and self._sock.family in (socket.AF_INET, socket.AF_INET6):
            # asyncio only disables Nagle for sockets whose proto field says TCP, and
            # sockets made with socket.socket(AF_INET, SOCK_STREAM) say 0: without this
            # every response written in two pieces waits ~40 ms for a delayed ACK.
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._quick_ack()
        self._task = self._loop.create_task(self._serve())

    def _quick_ack(self) -> None:
        # A client that writes a request's head and body separately without TCP_NODELAY
        # holds the body back until the head is ACKed, and Linux delays that ACK by up
        # to 40 ms. Asking for immediate ACKs (the kernel drops back to delayed ACKs on
        # its own, so this is re-armed on every read) took such requests on a kept-alive
        # connection from 44 ms to 0.3 ms.
        if _TCP_QUICKACK is not None and self._sock is not None:
            try:
                self._sock.setsockopt(socket.IPPROTO_TCP, _TCP_QUICKACK, 1)
            except OSError:
                self._sock = None  # not TCP (a Unix socket): nothing to tune

    def data_received(self, data: bytes) -> None:
        self._quick_ack()
        self._buf += data
        if len(self._buf) > READ_HIGH_WATER and not self._reading_paused and self.transport:
            self._reading_paused = True
            self.transport.pause_reading()
        self._wake_reader()

    def eof_received(self) -> bool:
        self._eof = True
        self._hang_up()
        self._wake_reader()
        return True  # keep the transport: a response may still be written

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._eof = True
        self._hang_up()
        self._wake_reader()
        self._wake_drain()

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._wake_drain()

    # -- internals ----------------------------------------------------------------------

    def _hang_up(self) -> None:
        if not self.gone.done():
            self.gone.set_result(None)

    def _wake_reader(self) -> None:
        waiter = self._read_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_drain(self) -> None:
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _consumed(self) -> None:
        if self._reading_paused and len(self._buf) < READ_HIGH_WATER // 2 and self.transport:
            self._reading_paused = False
            self.transport.resume_reading()

    async def _wait_input(self) -> None:
        """Wait for more input; raise ClientGone if the peer has stopped sending."""
        if self._eof:
            raise ClientGone("connection closed by peer")
        self._consumed()
        waiter = self._loop.create_future()
        self._read_waiter = waiter
        try:
            await waiter
        finally:
            self._read_waiter = None

    async def read_head(self) -> bytes | None:
        """The request line and headers, or None on a clean close between requests."""
        start = 0
        while True:
            index = self._buf.find(b"\r\n\r\n", max(0, start - 3))
            if index >= 0:
                head = bytes(self._buf[:index])
                del self._buf[: index + 4]
                self._consumed()
                return head.lstrip(b"\r\n")
            if len(self._buf) > MAX_HEAD:
                raise BadRequest("request head too large", 431)
            start = len(self._buf)
            if self._eof:
                if not self._buf.strip():
                    return None
                raise BadRequest("truncated request head")
            await self._wait_input()

    async def read_line(self, limit: int = 8192) -> bytes:
        start = 0
        while True:
            index = self._buf.find(b"\r\n", max(0, start - 1))
            if index >= 0:
                line = bytes(self._buf[:index])
                del self._buf[: index + 2]
                self._consumed()
                return line
            if len(self._buf) > limit:
                raise BadRequest("line too long")
            start = len(self._buf)
            await self._wait_input()

    async def read_some(self, limit: int) -> bytes:
        while not self._buf:
            await self._wait_input()
        data = bytes(self._buf[:limit])
        del self._buf[:limit]
        self._consumed()
        return data

    async def read_exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            await self._wait_input()
        data = bytes(self._buf[:n])
        del self._buf[:n]
        self._consumed()
        return data

    def write(self, data: bytes) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            raise ClientGone("connection closed")
        self.transport.write(data)

    async def drain(self) -> None:
        while self._writing_paused and not self.closed:
            waiter = self._loop.create_future()
            self._drain_waiter = waiter
            try:
                await waiter
            finally:
                self._drain_waiter = None
        if self.closed:
            raise ClientGone("connection closed")

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def _idle(self) -> None:
        if self.transport is not None:
            self.transport.close()

    async def _serve(self) -> None:
        try:
            while True:
                timer = self._loop.call_later(IDLE_TIMEOUT, self._idle)
                try:
                    head = await self.read_head()
                except BadRequest as e:
                    await self._reject(e)
                    return
                except ClientGone:
                    return
                finally:
                    timer.cancel()
                if head is None:
                    return
                try:
                    request = _parse_head(self, head)
                except BadRequest as e:
                    await self._reject(e, head)
                    return
                response = Response(self, request)
                try:
                    await self._handler(request, response)
                except ClientGone:
                    self.abort()
                    return
                except BadRequest as e:
                    if response.started:
                        self.abort()
                        return
                    # Set before the answer, so it says `Connection: close`: a client must not
                    # send its next request on a connection about to be closed.
                    response.close_after = True
                    await response.send_error(e.status, str(e))
                except Exception as e:  # noqa: BLE001 - the last line of defence
                    log_exception(f"{request.method} {request.path}", e)
                    if response.started:
                        self.abort()
                        return
                    response.close_after = True
                    await response.send_error(500, "internal server error")
                if not response.finished:
                    if response.started:
                        self.abort()
                        return
                    response.close_after = True
                    await response.send_error(500, "handler sent no response")
                # An unread body (an early error answer) must be consumed before the
                # next request, and before closing too: closing a socket with unread
                # input makes the kernel send RST, and a client still uploading may then
                # lose our answer. A client waiting for `100 Continue` sends no body.
                if not request.body.done and (
                    request.body.awaiting_continue or not await request.body.discard()
                ):
                    return
                if response.close_after or not request.keep_alive or self.closed:
                    return
        except (ClientGone, ConnectionError):
            pass
        except Exception as e:  # noqa: BLE001
            log_exception("http connection", e)
        finally:
            if self.transport is not None and not self.transport.is_closing():
                self.transport.close()

    async def _reject(self, error: BadRequest, head: bytes = b"") -> None:
        body = json.dumps({"code": error.status, "message": str(error)}).encode()
        reason = REASONS.get(error.status, "Error")
        # An answer to HEAD has no body (its client would read one as the next answer).
        head_request = (head or bytes(self._buf[:5])).startswith(b"HEAD ")
        try:
            self.write(
                f"HTTP/1.1 {error.status} {reason}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + (b"" if head_request else body)
            )
        except ClientGone:
            pass


def _parse_head(conn: Connection, head: bytes) -> Request:
    # A bare CR or LF, or a NUL, inside a line is no line ending here and no field content
    # anywhere (RFC 9110 5.5): refused, so that no header hides inside another one's value.
    bare = head.replace(b"\r\n", b"")
    if b"\n" in bare or b"\r" in bare or b"\x00" in head:
        raise BadRequest("malformed request head: bare CR, LF or NUL")
    lines = head.split(b"\r\n")
    parts = lines[0].decode("latin-1").split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest("malformed request line")
    method, target, version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise BadRequest("malformed header line")
        key = name.decode("latin-1").lower()
        text = value.strip().decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    if target.startswith(("http://", "https://")):
        # absolute-form (sent to proxies): keep only the path and query.
        slash = target.find("/", target.find("//") + 2)
        target = target[slash:] if slash >= 0 else "/"
    path, _, query = target.partition("?")

    chunked = False
    length: int | None = 0
    encoding = headers.get("transfer-encoding")
    if encoding is not None:
        if encoding.lower().split(",")[-1].strip() != "chunked":
            raise BadRequest("unsupported transfer-encoding", 501)
        chunked, length = True, None
    elif "content-length" in headers:
        try:
            length = int(headers["content-length"])
        except ValueError:
            raise BadRequest("invalid content-length") from None
        if length < 0:
            raise BadRequest("invalid content-length")
    expect = headers.get("expect", "").lower() == "100-continue"
    body = Body(conn, length, chunked, expect)

    connection = headers.get("connection", "").lower()
    if version == "HTTP/1.0":
        keep_alive = "keep-alive" in connection
    else:
        keep_alive = "close" not in connection
    return Request(conn, method, path, query, headers, body, keep_alive)


class Body:
    """A request body read incrementally; chunked framing is removed on the fly."""

    def __init__(self, conn: Connection, length: int | None, chunked: bool, expect: bool) -> None:
        self._conn = conn
        self._remaining = length or 0
        self._chunked = chunked
        self._chunk_left = 0
        self._expect = expect
        self.done = not chunked and not length

    @property
    def awaiting_continue(self) -> bool:
        """The client sent `Expect: 100-continue` and is still waiting for it."""
        return self._expect

    async def read(self, limit: int = 65536) -> bytes:
        """Up to `limit` bytes of body; b"" once the body is complete."""
        if self.done:
            return b""
        conn = self._conn
        if self._expect:
            self._expect = False
            conn.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if not self._chunked:
            data = await conn.read_some(min(limit, self._remaining))
            self._remaining -= len(data)
            self.done = self._remaining == 0
            return data
        if self._chunk_left == 0:
            line = await conn.read_line()
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise BadRequest("malformed chunk size") from None
            if size < 0:
                raise BadRequest("malformed chunk size")
            if size == 0:
                while await conn.read_line():  # trailers, ignored
                    pass
                self.done = True
                return b""
            self._chunk_left = size
        data = await conn.read_some(min(limit, self._chunk_left))
        self._chunk_left -= len(data)
        if self._chunk_left == 0 and await conn.read_exactly(2) != b"\r\n":
            raise BadRequest("malformed chunk")
        return data

    async def read_exactly(self, n: int) -> bytes | None:
        """Exactly n bytes, or None if the body ends first (a clean end only at 0 bytes)."""
        out = bytearray()
        while len(out) < n:
            data = await self.read(n - len(out))
            if not data:
                if out:
                    raise BadRequest("request body ended inside a message")
                return None
            out += data
        return bytes(out)

    async def read_all(self, limit: int) -> bytes:
        out = bytearray()
        while True:
            data = await self.read()
            if not data:
                return bytes(out)
            out += data
            if len(out) > limit:
                raise BadRequest("request body too large", 413)

    async def discard(self, limit: int = 1 << 20) -> bool:
        """Skip the unread rest of the body so the connection can be reused."""
        skipped = 0
        try:
            while not self.done and skipped <= limit:
                skipped += len(await self.read())
        except (ClientGone, BadRequest):
            return False
        return self.done


class Request:
    __slots__ = ("_q", "body", "conn", "headers", "keep_alive", "method", "path", "query_string")

    def __init__(
        self,
        conn: Connection,
        method: str,
        path: str,
        query_string: str,
        headers: dict[str, str],
        body: Body,
        keep_alive: bool,
    ) -> None:
        self.conn = conn
        self.method = method
        self.path = path
        self.query_string = query_string
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self._q: dict[str, str] | None = None

    @property
    def query(self) -> dict[str, str]:
        if self._q is None:
            self._q = parse_query(self.query_string)
        return self._q

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name, default)

    @property
    def gone(self) -> asyncio.Future[None]:
        """Resolves when the client hangs up."""
        return self.conn.gone


class Response:
    def __init__(self, conn: Connection, request: Request) -> None:
        self._conn = conn
        self._request = request
        self.started = False
        self.finished = False
        self.close_after = False
        self._chunked = False
        self._bodiless = False

    async def start(
        self,
        status: int,
        headers: list[tuple[str, str]] | None = None,
        length: int | None = None,
        body: bytes = b"",
    ) -> None:
        """Send the status line and headers (and `body`, in the same segment);
        `length=None` streams a chunked body."""
        lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}"]
        for name, value in headers or ():
            lines.append(f"{name}: {value}")
        if status == 204 or status == 304 or self._request.method == "HEAD":
            self._bodiless = True
            if self._request.method == "HEAD" and length is not None and status not in (204, 304):
                # A HEAD answer states the length a GET would send (RFC 9110 9.3.2).
                lines.append(f"Content-Length: {length}")
        elif length is None:
            self._chunked = True
            lines.append("Transfer-Encoding: chunked")
        else:
            lines.append(f"Content-Length: {length}")
        # An answer before the whole request body was read (an early error), as Go's
        # net/http does it: the rest is skipped now, up to a limit, so that the answer can
        # say whether the connection goes on. A body the client holds back for
        # `100 Continue`, or more than the limit, is never read: the connection ends with
        # this answer (Connection._serve), which then says `Connection: close`.
        request_body = self._request.body
        if not request_body.done and (request_body.awaiting_continue
                                      or not await request_body.discard()):
            self.close_after = True
        if self.close_after or not self._request.keep_alive:
            lines.append("Connection: close")
        self.started = True
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        self._conn.write(head + body if body and not self._bodiless else head)

    async def write(self, data: bytes) -> None:
        """Send part of the body; a chunked body is flushed as one chunk per call."""
        if not data or self._bodiless:
            return
        if self._chunked:
            self._conn.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            self._conn.write(data)
        await self._conn.drain()

    async def end(self) -> None:
        if self._chunked:
            self._conn.write(b"0\r\n\r\n")
        self.finished = True
        await self._conn.drain()

    async def send(
        self,
        status: int,
        body: bytes = b"",
        content_type: str | None = None,
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        all_headers = list(headers or ())
        if content_type is not None:
            all_headers.append(("Content-Type", content_type))
        await self.start(status, all_headers, len(body), body)
        await self.end()

    async def send_json(self, status: int, value: Any, headers: list[tuple[str, str]] | None = None) -> None:
        body = json.dumps(value, separators=(",", ":")).encode()
        await self.send(status, body, "application/json", headers)

    async def send_error(self, status: int, message: str) -> None:
        """The plain-HTTP error body the SDK parses: an integer code and a message."""
        await self.send_json(status, {"code": status, "message": message})

    @property
    def connection(self) -> Connection:
        return self._conn
