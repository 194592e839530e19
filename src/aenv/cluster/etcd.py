"""A small asyncio client for etcd v3 over its JSON gateway (`/v3/kv/*`, `/v3/lease/*`).

Why the gateway and not gRPC: etcd serves it on the client port of every version we meet
(Debian's 3.4 included), it needs nothing beyond httpx (already a dependency), and the handful
of calls the cluster makes (put, range, delete, compare-and-swap, leases) map one to one.
Keys and values are base64 in the JSON; int64s are strings; zero values are omitted.

Several endpoints may be given (`http://a:2379,http://b:2379`): a request that cannot reach
one goes to the next. Every failure is an `AenvError(UNAVAILABLE)`.

Owns: the wire format of etcd's JSON API. Must not touch: what the keys mean (`keys.py`).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

import httpx

from aenv.errors import AenvError, ErrorCode

REQUEST_TIMEOUT_S = 5.0


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def _unb64(data: str) -> bytes:
    return base64.b64decode(data)


def prefix_end(prefix: str) -> bytes:
    """The `range_end` that makes a range cover every key starting with `prefix`."""
    raw = bytearray(prefix.encode())
    for i in range(len(raw) - 1, -1, -1):
        if raw[i] < 0xFF:
            raw[i] += 1
            return bytes(raw[: i + 1])
    return b"\0"


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int

    def json(self) -> Any:
        return json.loads(self.value)


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(key=_unb64(raw["key"]).decode(), value=_unb64(raw.get("value", "")),
                    mod_revision=int(raw.get("mod_revision", 0)),
                    create_revision=int(raw.get("create_revision", 0)),
                    lease=int(raw.get("lease", 0)))


def encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


class Etcd:
    """One client (an httpx connection pool) for a list of endpoints."""

    def __init__(self, endpoints: str, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.endpoints = [e.strip().rstrip("/") for e in endpoints.split(",") if e.strip()]
        if not self.endpoints:
            raise AenvError(ErrorCode.INVALID_ARGUMENT, "no etcd endpoint given")
        self._http = httpx.AsyncClient(timeout=timeout_s, trust_env=False)
        self._current = 0

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        last = ""
        for attempt in range(len(self.endpoints)):
            base = self.endpoints[(self._current + attempt) % len(self.endpoints)]
            try:
                resp = await self._http.post(base + path, json=body)
            except httpx.HTTPError as exc:
                last = f"{base}: {type(exc).__name__}: {exc}"
                continue
            if resp.status_code != 200:
                try:
                    message = resp.json().get("message") or resp.text
                except ValueError:
                    message = resp.text
                raise AenvError(ErrorCode.UNAVAILABLE,
                                f"etcd {path}: {resp.status_code} {message[:200]}")
            self._current = (self._current + attempt) % len(self.endpoints)
            data: dict[str, Any] = resp.json()
            return data
        raise AenvError(ErrorCode.UNAVAILABLE, f"etcd is unreachable ({last})")

    # ------------------------------------------------------------------ kv
    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Returns the revision of the write (the key's new mod_revision)."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        data = await self._call("/v3/kv/put", body)
        return int(data.get("header", {}).get("revision", 0))

    async def get(self, key: str) -> KeyValue | None:
        data = await self._call("/v3/kv/range", {"key": _b64(key)})
        kvs = data.get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    async def get_prefix(self, prefix: str, limit: int = 0) -> list[KeyValue]:
        body: dict[str, Any] = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        if limit:
            body["limit"] = str(limit)
        data = await self._call("/v3/kv/range", body)
        return [_kv(raw) for raw in data.get("kvs") or []]

    async def delete(self, key: str) -> int:
        """Returns how many keys were deleted (0 or 1)."""
        data = await self._call("/v3/kv/deleterange", {"key": _b64(key)})
        return int(data.get("deleted", 0))

    async def delete_prefix(self, prefix: str) -> int:
        data = await self._call("/v3/kv/deleterange",
                                {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        return int(data.get("deleted", 0))

    async def _txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]]) -> bool:
        data = await self._call("/v3/kv/txn", {"compare": compare, "success": success})
        return bool(data.get("succeeded", False))

    async def create(self, key: str, value: bytes, lease: int = 0) -> bool:
        """Put `key` only if it does not exist. True if this call created it."""
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        return await self._txn(
            [{"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}],
            [{"request_put": put}])

    async def replace(self, key: str, value: bytes, mod_revision: int, lease: int = 0) -> bool:
        """Put `key` only if it is still at `mod_revision` (0: only if absent)."""
        if mod_revision == 0:
            return await self.create(key, value, lease)
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        return await self._txn(
            [{"key": _b64(key), "result": "EQUAL", "target": "MOD",
              "mod_revision": str(mod_revision)}],
            [{"request_put": put}])

    async def delete_if(self, key: str, mod_revision: int) -> bool:
        """Delete `key` only if it is still at `mod_revision`."""
        return await self._txn(
            [{"key": _b64(key), "result": "EQUAL", "target": "MOD",
              "mod_revision": str(mod_revision)}],
            [{"request_delete_range": {"key": _b64(key)}}])

    # ------------------------------------------------------------------ leases
    async def grant(self, ttl_s: int) -> int:
        data = await self._call("/v3/lease/grant", {"TTL": str(ttl_s)})
        if data.get("error"):
            raise AenvError(ErrorCode.UNAVAILABLE, f"etcd lease grant: {data['error']}")
        return int(data["ID"])

    async def keepalive(self, lease: int) -> int:
        """Refresh `lease`; returns its TTL, 0 when it has expired (or never existed)."""
        data = await self._call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(data.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        try:
            await self._call("/v3/lease/revoke", {"ID": str(lease)})
        except AenvError as exc:
            if "not found" not in exc.message:
                raise

    async def healthy(self) -> bool:
        for base in self.endpoints:
            try:
                resp = await self._http.get(base + "/health")
                if resp.status_code == 200 and resp.json().get("health") == "true":
                    return True
            except (httpx.HTTPError, ValueError):
                continue
        return False
