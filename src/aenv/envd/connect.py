"""The Connect RPC protocol, JSON codec only, on top of `aenv.envd.http`.

Owns: dispatching one HTTP request to a unary, server-streaming or client-streaming
handler; 5-byte envelopes (flag 0x00 message, 0x02 end-of-stream with `{}` or
`{"error":{...}}`); `Connect-Timeout-Ms` as the stream deadline; reading
`Keepalive-Ping-Interval` and the Basic-auth username for handlers; rendering `RpcError`.

Streaming handlers run as a task raced against the deadline and against the client
hanging up, so a handler only has to produce messages; when the client goes away the
handler is cancelled (the process it started keeps running — that is the handler's
business). Streams always answer HTTP 200 and put any error in the end-of-stream envelope,
which the Connect client accepts both before and after the first message.
"""

from __future__ import annotations

import asyncio
import binascii
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aenv.envd.errors import RpcError
from aenv.envd.http import BadRequest, Body, ClientGone, Request, Response
from aenv.envd.log import log_exception
from aenv.envd.proto import Msg

UNARY = 0
SERVER_STREAM = 1
CLIENT_STREAM = 2

MAX_MESSAGE = 32 << 20
DEFAULT_KEEPALIVE = 90.0  # envd's default when the client does not ask for an interval
MAX_KEEPALIVE = 24 * 3600
STREAM_CONTENT_TYPE = "application/connect+json"


class Call:
    """What a handler knows about its RPC besides the request message."""

    __slots__ = ("deadline", "keepalive", "request", "timeout", "username")

    def __init__(self, request: Request) -> None:
        self.request = request
        loop = asyncio.get_running_loop()
        self.timeout = _parse_timeout(request.header("connect-timeout-ms"))
        self.deadline = None if self.timeout is None else loop.time() + self.timeout
        self.keepalive = _parse_keepalive(request.header("keepalive-ping-interval"))
        self.username = basic_auth_username(request.header("authorization"))

    def remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - asyncio.get_running_loop().time())


def _parse_timeout(value: str) -> float | None:
    value = value.strip()
    if not value:
        return None
    # isascii: str.isdigit() is also true of "²" (a latin-1 header byte), which int() refuses.
    if not (value.isascii() and value.isdigit()) or len(value) > 10:
        raise RpcError("invalid_argument", f"invalid Connect-Timeout-Ms: {value!r}")
    return int(value) / 1000.0


def _parse_keepalive(value: str) -> float:
    try:
        seconds = int(value)
    except ValueError:
        return DEFAULT_KEEPALIVE
    if seconds <= 0:
        return DEFAULT_KEEPALIVE
    # Bounded before float(): 400 digits would overflow it; a day apart is no keepalive anyway.
    return float(min(seconds, MAX_KEEPALIVE))


def basic_auth_username(header: str) -> str | None:
    """The user of `Authorization: Basic base64("user:")`; None when not sent."""
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "basic" or not token:
        return None
    try:
        decoded = binascii.a2b_base64(token.strip()).decode("utf-8")
    except ValueError:  # binascii.Error, UnicodeDecodeError, and a non-ASCII token
        raise RpcError("unauthenticated", "invalid basic auth header") from None
    return decoded.partition(":")[0]


class ServerStream:
    """The response side of a streaming RPC: envelopes on a chunked HTTP 200."""

    def __init__(self, response: Response) -> None:
        self._response = response
        self.closed = False

    async def _start(self) -> None:
        if not self._response.started:
            await self._response.start(200, [("Content-Type", STREAM_CONTENT_TYPE)])

    async def send(self, message: Msg) -> None:
        await self._start()
        await self._response.write(envelope(0, message))

    async def close(self, error: RpcError | None) -> None:
        if self.closed:
            return
        self.closed = True
        await self._start()
        end: Msg = {} if error is None else {"error": {"code": error.code, "message": error.message}}
        await self._response.write(envelope(2, end))
        await self._response.end()


def envelope(flags: int, message: Msg) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode()
    return bytes((flags,)) + len(payload).to_bytes(4, "big") + payload


def decode_message(payload: bytes) -> Msg:
    if not payload:
        return {}
    try:
        value = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        raise RpcError("invalid_argument", "request message is not valid JSON") from None
    except RecursionError:
        # `[[[[...` deeper than the interpreter's stack: bad input, not a crash.
        raise RpcError("invalid_argument", "request message is nested too deeply") from None
    if not isinstance(value, dict):
        raise RpcError("invalid_argument", "request message must be a JSON object")
    return value


async def read_envelope(body: Body) -> Msg | None:
    """The next request message; None at the end of the request stream."""
    head = await body.read_exactly(5)
    if head is None:
        return None
    flags = head[0]
    length = int.from_bytes(head[1:5], "big")
    if length > MAX_MESSAGE:
        raise RpcError("resource_exhausted", f"message of {length} bytes is too large")
    payload = b""
    if length:
        data = await body.read_exactly(length)
        if data is None:
            raise RpcError("invalid_argument", "request stream ended inside a message")
        payload = data
    if flags & 0x01:
        # No compression was negotiated (envd accepts identity only), so the flag is the
        # client's protocol error: connect-go says `internal` here, but it is bad input.
        raise RpcError("invalid_argument", "compressed messages are not supported")
    if flags & 0x02:
        return None
    return decode_message(payload)


async def read_envelopes(body: Body) -> AsyncIterator[Msg]:
    while True:
        message = await read_envelope(body)
        if message is None:
            return
        yield message


UnaryHandler = Callable[[Call, Msg], Awaitable[Msg]]
ServerStreamHandler = Callable[[Call, Msg, ServerStream], Awaitable[None]]
ClientStreamHandler = Callable[[Call, AsyncIterator[Msg]], Awaitable[Msg]]
AnyHandler = UnaryHandler | ServerStreamHandler | ClientStreamHandler


class Method:
    __slots__ = ("handler", "kind")

    def __init__(self, kind: int, handler: Any) -> None:
        self.kind = kind
        self.handler = handler


def unary(handler: UnaryHandler) -> Method:
    return Method(UNARY, handler)


def server_stream(handler: ServerStreamHandler) -> Method:
    return Method(SERVER_STREAM, handler)


def client_stream(handler: ClientStreamHandler) -> Method:
    return Method(CLIENT_STREAM, handler)


async def send_unary_error(response: Response, error: RpcError) -> None:
    await response.send_json(error.http_status, {"code": error.code, "message": error.message})


def _media_type(request: Request, name: str) -> str:
    return request.header(name).split(";", 1)[0].strip().lower()


async def serve(method: Method, call: Call, response: Response) -> None:
    request = call.request
    if method.kind == UNARY:
        await _serve_unary(method.handler, call, response)
        return
    if _media_type(request, "content-type") != STREAM_CONTENT_TYPE:
        await send_unary_error(response, RpcError("unknown", "unsupported content-type", 415))
        return
    if request.header("connect-content-encoding", "identity").lower() != "identity":
        await send_unary_error(response, RpcError("unimplemented", "unsupported compression"))
        return

    stream = ServerStream(response)
    error: RpcError | None = None
    try:
        if method.kind == SERVER_STREAM:
            first = await read_envelope(request.body)
            if first is None:
                raise RpcError("invalid_argument", "missing request message")
            await _bounded(method.handler(call, first, stream), call)
        else:
            result = await _bounded(method.handler(call, read_envelopes(request.body)), call)
            await stream.send(result)
    except RpcError as e:
        error = e
    except BadRequest as e:
        error = RpcError("invalid_argument", str(e))
    await stream.close(error)


async def _serve_unary(handler: UnaryHandler, call: Call, response: Response) -> None:
    request = call.request
    if _media_type(request, "content-type") != "application/json":
        await send_unary_error(response, RpcError("unknown", "unsupported content-type", 415))
        return
    if request.header("content-encoding", "identity").lower() != "identity":
        await send_unary_error(response, RpcError("unimplemented", "unsupported compression"))
        return
    try:
        message = decode_message(await request.body.read_all(MAX_MESSAGE))
        result = await handler(call, message)
    except RpcError as e:
        await send_unary_error(response, e)
        return
    except BadRequest as e:
        await send_unary_error(response, RpcError("invalid_argument", str(e)))
        return
    except (ClientGone, asyncio.CancelledError):
        raise
    except Exception as e:  # noqa: BLE001 - never leak a traceback to the client
        log_exception(request.path, e)
        await send_unary_error(response, RpcError("internal", "internal error"))
        return
    await response.send_json(200, result)


async def _bounded(coroutine: Awaitable[Any], call: Call) -> Any:
    """Run a streaming handler until it finishes, the deadline passes or the client leaves."""
    task = asyncio.ensure_future(coroutine)
    gone = call.request.gone
    try:
        done, _ = await asyncio.wait({task, gone}, timeout=call.remaining(), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task in done:
        try:
            return task.result()
        except (RpcError, ClientGone, BadRequest):
            raise
        except Exception as e:  # noqa: BLE001
            log_exception(call.request.path, e)
            raise RpcError("internal", "internal error") from None
    task.cancel()
    # It was cancelled on purpose; whatever it raised while unwinding does not matter.
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    if gone.done():
        raise ClientGone("client went away")
    raise RpcError("deadline_exceeded", "context deadline exceeded")
