"""The one error type envd raises on purpose, and how it maps onto the wire.

Owns: `RpcError` (a Connect error code plus a message) and the code → HTTP status table.
Connect handlers raise it and the Connect layer renders it as `{"code":"not_found",...}`;
the plain-HTTP endpoints (`/files`, `/init`, ...) render the same error as
`{"code":404,"message":...}` through `http_status()`. Any other exception escaping a
handler is a bug: it is logged with its traceback to stderr and the client sees a generic
`internal` error, never the traceback.
"""

from __future__ import annotations

# Connect code → HTTP status, as the Connect protocol specifies them.
_CODE_STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}


class RpcError(Exception):
    """A failure with a Connect code; the message is shown to the client verbatim."""

    def __init__(self, code: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        # Plain-HTTP endpoints sometimes need a status the code alone does not imply
        # (507 for a full disk, 406 for an unusable Accept-Encoding).
        self._status = status

    @property
    def http_status(self) -> int:
        if self._status is not None:
            return self._status
        return _CODE_STATUS.get(self.code, 500)


def http_status(code: str) -> int:
    return _CODE_STATUS.get(code, 500)


def invalid(message: str) -> RpcError:
    return RpcError("invalid_argument", message)


def not_found(message: str) -> RpcError:
    return RpcError("not_found", message)


def internal(message: str) -> RpcError:
    return RpcError("internal", message)
