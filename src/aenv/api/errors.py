"""The one place where error codes become HTTP statuses and E2B-shaped JSON bodies."""

from __future__ import annotations

from starlette.responses import JSONResponse

from aenv.errors import AenvError, ErrorCode

STATUS_BY_CODE: dict[ErrorCode, int] = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.CONFLICT: 409,
    ErrorCode.RESOURCE_EXHAUSTED: 429,
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
