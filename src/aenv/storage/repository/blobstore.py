"""Content-addressed blob storage: the protocol, the on-store encoding, and shared checks.

Owns: what a blob is (bytes named by the sha256 of their *uncompressed* content), how it is
encoded at rest (one codec byte + payload), and verification on every read. Also small named
documents ("meta": manifests, push/gc markers) that are written whole and atomically.
Must not touch: snapshots, manifests' meaning, local caches. Backends (posix, s3) only move
opaque bytes; everything that decides whether bytes are trustworthy is here, once.

All methods are blocking; the repository calls them from worker threads.
"""

from __future__ import annotations

import builtins
import hashlib
import re
import threading
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from aenv.errors import invalid
from aenv.storage.repository.errors import BlobCorrupted

try:  # zstd is faster and smaller than zlib; zlib is the always-available fallback
    import zstandard
except ImportError:  # pragma: no cover - zstandard is a declared dependency
    zstandard = None  # type: ignore[assignment]

# zstandard (de)compressor objects are not thread-safe (sharing one segfaults): one per thread.
_tls = threading.local()


def _zstd_c() -> zstandard.ZstdCompressor:
    c: zstandard.ZstdCompressor | None = getattr(_tls, "c", None)
    if c is None:
        c = _tls.c = zstandard.ZstdCompressor(level=1)
    return c


def _zstd_d() -> zstandard.ZstdDecompressor:
    d: zstandard.ZstdDecompressor | None = getattr(_tls, "d", None)
    if d is None:
        d = _tls.d = zstandard.ZstdDecompressor()
    return d

_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
_META_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$")

# Codec byte at the start of every stored blob. The digest never covers it, so the same
# content stored raw by one writer and compressed by another is still the same blob.
RAW = b"\x00"
ZSTD = b"\x01"
ZLIB = b"\x02"


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def check_digest(digest: str) -> str:
    if not _DIGEST_RE.match(digest):
        raise invalid(f"not a sha256 hex digest: {digest!r}")
    return digest


def check_meta_name(name: str) -> str:
    # Meta names become file paths and object keys: no "..", no absolute paths, no surprises.
    if not _META_RE.match(name) or ".." in name:
        raise invalid(f"bad repository object name: {name!r}")
    return name


def encode(data: bytes) -> bytes:
    """Compress when it pays (>= 1/8 smaller); random or already-compressed data stays raw."""
    if zstandard is not None:
        packed, codec = _zstd_c().compress(data), ZSTD
    else:  # pragma: no cover
        packed, codec = zlib.compress(data, 1), ZLIB
    if len(packed) <= len(data) - len(data) // 8:
        return codec + packed
    return RAW + data


def decode(stored: bytes, digest: str, repository: str) -> bytes:
    """Decode and verify. Raises BlobCorrupted naming the blob and repository on any mismatch."""
    what = f"blob {digest}"
    if not stored:
        raise BlobCorrupted(repository, what, "empty object")
    codec, body = stored[:1], stored[1:]
    if codec not in (RAW, ZSTD, ZLIB):
        raise BlobCorrupted(repository, what, f"unknown codec byte {codec!r}")
    if codec == ZSTD and zstandard is None:  # pragma: no cover
        raise invalid(f"blob {digest} is zstd-compressed but zstandard is not installed")
    try:
        if codec == RAW:
            data = body
        elif codec == ZSTD:
            data = _zstd_d().decompress(body)
        else:
            data = zlib.decompress(body)
    except Exception as exc:  # noqa: BLE001 - any decoder failure on stored bytes is corruption
        raise BlobCorrupted(repository, what, f"cannot decompress: {exc}") from None
    actual = sha256_hex(data)
    if actual != digest:
        raise BlobCorrupted(repository, what, f"content hashes to {actual}")
    return data


@dataclass(frozen=True)
class MetaInfo:
    name: str
    mtime: float  # seconds since the epoch, as the backend reports it


class BlobStore(Protocol):
    """What the repository needs from a backend. Implementations must be thread-safe."""

    @property
    def description(self) -> str:
        """Human-readable location used in every error message, e.g. posix_fs:/srv/repo."""
        ...

    def has(self, digest: str) -> bool: ...

    def put(self, digest: str, data: bytes | Path) -> int:
        """Store a blob atomically (never visible half-written). Returns bytes stored at rest.

        The caller vouches that `digest` names `data`; `put` re-hashes anyway (cheap next to
        I/O) so a caller bug cannot plant a mislabelled blob."""
        ...

    def get(self, digest: str) -> bytes:
        """The verified content. Raises BlobCorrupted, or AenvError(not_found)."""
        ...

    def get_to(self, digest: str, path: Path) -> int:
        """Write the verified content to `path` (created/truncated). Returns its size."""
        ...

    def delete(self, digest: str) -> None: ...

    def list(self) -> Iterator[str]: ...

    def put_meta(self, name: str, data: bytes) -> None: ...

    def get_meta(self, name: str) -> bytes | None: ...

    def list_meta(self, prefix: str) -> builtins.list[MetaInfo]: ...

    def delete_meta(self, name: str) -> None: ...


class BlobStoreBase(ABC):
    """Shared logic over raw byte I/O. Backends implement the `_raw_*` methods only."""

    @property
    @abstractmethod
    def description(self) -> str: ...

    @abstractmethod
    def _raw_has(self, digest: str) -> bool: ...

    @abstractmethod
    def _raw_put(self, digest: str, stored: bytes) -> None: ...

    @abstractmethod
    def _raw_get(self, digest: str) -> bytes | None: ...

    @abstractmethod
    def delete(self, digest: str) -> None: ...

    @abstractmethod
    def list(self) -> Iterator[str]: ...

    @abstractmethod
    def put_meta(self, name: str, data: bytes) -> None: ...

    @abstractmethod
    def get_meta(self, name: str) -> bytes | None: ...

    @abstractmethod
    def list_meta(self, prefix: str) -> builtins.list[MetaInfo]: ...

    @abstractmethod
    def delete_meta(self, name: str) -> None: ...

    def has(self, digest: str) -> bool:
        return self._raw_has(check_digest(digest))

    def put(self, digest: str, data: bytes | Path) -> int:
        check_digest(digest)
        raw = data.read_bytes() if isinstance(data, Path) else data
        if sha256_hex(raw) != digest:
            raise invalid(f"put: content does not hash to {digest}")
        stored = encode(raw)
        self._raw_put(digest, stored)
        return len(stored)

    def get(self, digest: str) -> bytes:
        from aenv.errors import not_found

        stored = self._raw_get(check_digest(digest))
        if stored is None:
            raise not_found(f"snapshot repository {self.description}: blob {digest} is missing")
        return decode(stored, digest, self.description)

    def get_to(self, digest: str, path: Path) -> int:
        data = self.get(digest)  # verified before a single byte reaches `path`
        path.write_bytes(data)
        return len(data)
