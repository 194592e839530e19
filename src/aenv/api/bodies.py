"""Bounded, strict parsing of control-plane JSON bodies, and what each endpoint accepts.

Owns: the body size limit (enforced while the body streams in, so an oversized or chunked body
is never held whole in memory), the JSON nesting and integer-size bounds (checked before
pydantic sees the value), strict validation (no `true` -> 1, no `"3"` -> 3), and the
`accepts` declaration that the OpenAPI document (`api/openapi.py`) reads, so that the document
and the parser use the same models. It must not touch the sandbox proxy's streams or the
template file uploads: those are not JSON and may be large.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from aenv.config import ServerConfig
from aenv.errors import AenvError, ErrorCode, invalid

M = TypeVar("M", bound=BaseModel)
F = TypeVar("F", bound=Callable[..., Any])

# JSON integers longer than this are refused before Python converts them (int() of a
# 5000-digit string costs, and above 4300 digits it raises); 20 digits hold any 64-bit value.
MAX_INTEGER_DIGITS = 20


@dataclass(frozen=True)
class InputLimits:
    max_body_bytes: int = ServerConfig.max_body_bytes
    max_json_depth: int = ServerConfig.max_json_depth

    @classmethod
    def from_config(cls, server: ServerConfig) -> InputLimits:
        return cls(max_body_bytes=server.max_body_bytes, max_json_depth=server.max_json_depth)


@dataclass(frozen=True)
class QueryParam:
    name: str
    type: Literal["string", "integer"] = "string"
    description: str = ""


@dataclass(frozen=True)
class Accepts:
    """What an endpoint reads from a request, as declared next to its handler."""
    body: type[BaseModel] | None = None
    body_required: bool = True
    query: tuple[QueryParam, ...] = ()


def accepts(body: type[BaseModel] | None = None, *, body_required: bool = True,
            query: tuple[QueryParam, ...] = ()) -> Callable[[F], F]:
    def mark(handler: F) -> F:
        handler.__aenv_accepts__ = Accepts(body, body_required, query)  # type: ignore[attr-defined]
        return handler
    return mark


def accepted_by(endpoint: object) -> Accepts:
    found = getattr(endpoint, "__aenv_accepts__", None)
    return found if isinstance(found, Accepts) else Accepts()


def limits_of(request: Request) -> InputLimits:
    found = getattr(request.app.state, "input_limits", None)
    return found if isinstance(found, InputLimits) else InputLimits()


def too_large(limit: int) -> AenvError:
    return AenvError(ErrorCode.PAYLOAD_TOO_LARGE,
                     f"request body is larger than the server's limit of {limit} bytes")


async def read_bounded(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it passes `limit` (a lying or absent Content-Length too)."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INTEGER_DIGITS:
        raise invalid(f"integer with {len(digits)} digits in the JSON body is out of range")
    return int(digits)


def _no_constant(name: str) -> object:
    raise invalid(f"{name} is not valid JSON")


def _check_depth(value: object, max_depth: int) -> None:
    # Iterative: the value already parsed, so this is linear in its containers.
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children: list[Any]
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise invalid(f"JSON body is nested deeper than {max_depth} levels")
        stack.extend((child, depth + 1) for child in children)


def decode_json(raw: bytes, limits: InputLimits) -> object:
    try:
        data = json.loads(raw, parse_int=_bounded_int, parse_constant=_no_constant)
    except RecursionError:
        # Deeper than the interpreter's recursion limit (~1000): far past ours.
        raise invalid(f"JSON body is nested deeper than {limits.max_json_depth} levels") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(f"malformed JSON body: {exc}") from None
    _check_depth(data, limits.max_json_depth)
    return data


async def parse_body(request: Request, model: type[M], allow_empty: bool = False) -> M:
    limits = limits_of(request)
    raw = await read_bounded(request, limits.max_body_bytes)
    if not raw.strip():
        if allow_empty:
            return model.model_validate({})
        raise invalid("request body is required (JSON)")
    data = decode_json(raw, limits)
    try:
        # Strict: the official SDKs send real JSON types, and coercing `true` into a timeout
        # or `"3"` into a count only hides a client's bug.
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in exc.errors()
        )
        raise invalid(f"invalid request body: {problems}") from None
