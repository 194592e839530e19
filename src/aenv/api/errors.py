"""The one place where error codes become HTTP statuses and E2B-shaped JSON bodies."""

from __future__ import annotations

import logging

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aenv.errors import AenvError, ErrorCode

log = logging.getLogger("aenv.api")

STATUS_BY_CODE: dict[ErrorCode, int] = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.CONFLICT: 409,
    ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.INTERNAL: 500,
    ErrorCode.DATA_LOSS: 500,
    ErrorCode.NOT_SUPPORTED: 501,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.PORT_CLOSED: 502,
    ErrorCode.TIMEOUT: 504,
}


def error_body(status: int, message: str, code: ErrorCode | None = None) -> dict[str, object]:
    body: dict[str, object] = {"code": status, "message": message}
    if code is not None:
        body["error_code"] = code.value
    return body


def error_response(status: int, message: str, code: ErrorCode | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code), status_code=status)


def from_aenv_error(exc: AenvError) -> JSONResponse:
    return error_response(STATUS_BY_CODE[exc.code], exc.message, exc.code)


class CrashAnswer:
    """Answers an exception no handler took with a 500 `{code, message}` and swallows it, so
    the client's keep-alive connection survives: Starlette's own last-resort handler re-raises
    after answering, and uvicorn then closes the connection under the client. Sits inside
    Starlette's ServerErrorMiddleware (as app middleware), below which AenvError and
    HTTPException are already mapped. A response already under way cannot be replaced: that
    exception goes on up as before."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            await error_response(500, f"internal error: {type(exc).__name__}")(
                scope, receive, send)
