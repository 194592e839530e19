"""Proto3 JSON mapping for the hand-written envd messages (no generated code, no protobuf).

Owns: reading request fields leniently and writing response fields canonically.

Input: a field may arrive under its lowerCamelCase JSON name or its original snake_case
name; integers as numbers or strings; enums as names or numbers; bytes as standard or
URL-safe base64 with or without padding; `null` means "absent". A value of the wrong type
is an `invalid_argument` error, never a crash.

Output: int64 values are strings, bytes are standard padded base64, enums are names and
fields holding their default value are left out (the SDK fills in defaults).
"""

from __future__ import annotations

import binascii
import time
from typing import Any

from aenv.envd.errors import invalid

Msg = dict[str, Any]


def _raw(msg: Msg, name: str, snake: str | None) -> Any:
    value = msg.get(name)
    if value is None and snake is not None:
        value = msg.get(snake)
    return value


def get_msg(msg: Msg, name: str, snake: str | None = None) -> Msg:
    value = _raw(msg, name, snake)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(f"field {name}: expected an object")
    return value


def has(msg: Msg, name: str, snake: str | None = None) -> bool:
    return _raw(msg, name, snake) is not None


def get_str(msg: Msg, name: str, snake: str | None = None, default: str = "") -> str:
    value = _raw(msg, name, snake)
    if value is None:
        return default
    if not isinstance(value, str):
        raise invalid(f"field {name}: expected a string")
    return value


def get_opt_str(msg: Msg, name: str, snake: str | None = None) -> str | None:
    if _raw(msg, name, snake) is None:
        return None
    return get_str(msg, name, snake)


def get_int(msg: Msg, name: str, snake: str | None = None, default: int = 0) -> int:
    value = _raw(msg, name, snake)
    if value is None:
        return default
    if isinstance(value, bool):
        raise invalid(f"field {name}: expected an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise invalid(f"field {name}: expected an integer")


def get_bool(msg: Msg, name: str, snake: str | None = None, default: bool = False) -> bool:
    value = _raw(msg, name, snake)
    if value is None:
        return default
    if isinstance(value, bool):
        return bool(value)
    if value == "true":
        return True
    if value == "false":
        return False
    raise invalid(f"field {name}: expected a boolean")


def get_opt_bool(msg: Msg, name: str, snake: str | None = None) -> bool | None:
    if _raw(msg, name, snake) is None:
        return None
    return get_bool(msg, name, snake)


def get_bytes(msg: Msg, name: str, snake: str | None = None) -> bytes:
    value = _raw(msg, name, snake)
    if value is None:
        return b""
    if not isinstance(value, str):
        raise invalid(f"field {name}: expected base64 text")
    return decode_b64(value, name)


def get_enum(msg: Msg, name: str, values: dict[str, int], snake: str | None = None) -> int:
    value = _raw(msg, name, snake)
    if value is None:
        return 0
    if isinstance(value, str) and value in values:
        return values[value]
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise invalid(f"field {name}: unknown enum value {value!r}")


def get_str_map(msg: Msg, name: str, snake: str | None = None) -> dict[str, str]:
    value = _raw(msg, name, snake)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise invalid(f"field {name}: expected a map of strings")
    return value


def get_str_list(msg: Msg, name: str, snake: str | None = None) -> list[str]:
    value = _raw(msg, name, snake)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise invalid(f"field {name}: expected a list of strings")
    return value


def decode_b64(text: str, name: str = "bytes") -> bytes:
    # Proto3 JSON parsers must accept both alphabets and missing padding.
    data = text.strip().replace("-", "+").replace("_", "/")
    data += "=" * (-len(data) % 4)
    try:
        return binascii.a2b_base64(data)
    except ValueError:  # binascii.Error, and ValueError for text that is not ASCII
        raise invalid(f"field {name}: invalid base64") from None


def b64(data: bytes) -> str:
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def timestamp(ns: int) -> str:
    """RFC 3339 UTC with 0, 3, 6 or 9 fractional digits, as protojson prints Timestamps."""
    sec, nanos = divmod(ns, 1_000_000_000)
    base = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
    if nanos == 0:
        return base + "Z"
    if nanos % 1_000_000 == 0:
        return f"{base}.{nanos // 1_000_000:03d}Z"
    if nanos % 1_000 == 0:
        return f"{base}.{nanos // 1_000:06d}Z"
    return f"{base}.{nanos:09d}Z"
