"""Access control: the sandbox access token and signed `/files` URLs.

Owns: which requests need `X-Access-Token`, constant-time token comparison, and the v1
URL signature of `Sandbox.download_url()` / `upload_url()`:
`"v1_" + base64(sha256("{path}:{op}:{username}:{token}[:{expiration}]"))` with padding
stripped, where `op` is `read` or `write` and `username` is "" for the default user.

Without a token (`EnvdSettings.access_token` None) everything is open, as in E2B.
"""

from __future__ import annotations

import binascii
import time
from typing import Any

from aenv.envd.errors import RpcError


# The interpreter's built-in SHA-256 and constant-time compare, rather than hashlib and
# hmac: those load OpenSSL's libcrypto, which costs every envd ~0.5 MiB of private memory.
def _builtin(names: tuple[str, ...], attribute: str, fallback: str) -> Any:
    for name in names:
        try:
            return getattr(__import__(name), attribute)
        except (ImportError, AttributeError):
            continue
    return getattr(__import__(fallback), attribute)  # pragma: no cover


_sha256 = _builtin(("_sha256", "_sha2"), "sha256", "hashlib")
_compare_digest = _builtin(("_operator",), "_compare_digest", "hmac")

TOKEN_HEADER = "x-access-token"

# Requests that never need the header: health checks, /files (which may carry a
# signature instead and checks on its own; HEAD is a read, as GET) and /init (which
# authenticates itself).
PUBLIC = frozenset(
    {("GET", "/health"), ("HEAD", "/health"), ("GET", "/files"), ("HEAD", "/files"),
     ("POST", "/files"), ("POST", "/init")}
)

UNAUTHORIZED = "unauthorized access, please provide a valid access token or method signing if supported"


def tokens_equal(given: str, expected: str) -> bool:
    return bool(
        _compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode("utf-8", "surrogateescape"))
    )


def needs_token(method: str, path: str) -> bool:
    return (method, path) not in PUBLIC


def signature(path: str, operation: str, username: str, token: str, expiration: int | None) -> str:
    raw = f"{path}:{operation}:{username}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest: bytes = _sha256(raw.encode("utf-8", "surrogateescape")).digest()
    return "v1_" + binascii.b2a_base64(digest, newline=False).decode("ascii").rstrip("=")


def check_files_access(
    token: str | None,
    header: str,
    query: dict[str, str],
    path: str,
    operation: str,
) -> None:
    """Raise a 401 `RpcError` unless the request may use /files.

    A header, when sent, must match; otherwise a valid, unexpired signature is needed.
    """
    if not token:
        return
    if header:
        if not tokens_equal(header, token):
            raise RpcError("unauthenticated", "access token present in header but does not match")
        return
    given = query.get("signature")
    if given is None:
        raise RpcError("unauthenticated", "missing signature query parameter")
    expiration: int | None = None
    if "signature_expiration" in query:
        try:
            expiration = int(query["signature_expiration"])
        except ValueError:
            raise RpcError("invalid_argument", "invalid signature_expiration") from None
    expected = signature(path, operation, query.get("username", ""), token, expiration)
    if not tokens_equal(given, expected):
        raise RpcError("unauthenticated", "invalid signature")
    if expiration is not None and expiration < time.time():
        raise RpcError("unauthenticated", "signature is already expired")
