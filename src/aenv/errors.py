"""Errors as values with codes.

Every layer raises `AenvError` with an `ErrorCode`; the API edge maps codes to HTTP statuses
once (see `aenv.api.errors`). Nothing below the API knows about HTTP.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    INVALID_ARGUMENT = "invalid_argument"
    UNAUTHENTICATED = "unauthenticated"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    PAYLOAD_TOO_LARGE = "payload_too_large"  # a request body over the server's limit
    NOT_SUPPORTED = "not_supported"
    UNAVAILABLE = "unavailable"
    PORT_CLOSED = "port_closed"  # the sandbox runs, but nothing listens on that port
    TIMEOUT = "timeout"
    INTERNAL = "internal"
    DATA_LOSS = "data_loss"  # stored data failed its integrity check


class AenvError(Exception):
    """A failure the caller can act on: a code plus a human-readable message."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"AenvError({self.code.value}, {self.message!r})"


def not_found(what: str) -> AenvError:
    return AenvError(ErrorCode.NOT_FOUND, what)


def invalid(message: str) -> AenvError:
    return AenvError(ErrorCode.INVALID_ARGUMENT, message)
