"""A client for the OCI distribution protocol (Docker Registry HTTP API v2), pull side.

Owns: talking to registries: the WWW-Authenticate challenge flow (bearer tokens and basic
auth), manifests and image indexes in OCI and Docker schema2 media types, `Docker-Content-
Digest` checks, and blob downloads that retry and resume (HTTP Range) and are verified by
sha256 before anyone may use them.
Must not touch: layer directories, templates, the record store (`images.pull` does that).

Plain HTTP is used only for registries the caller marks insecure (config
`images.insecure_registries` or the request's `insecure` flag); otherwise HTTPS with
certificate checks.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Self

import httpx

from aenv.config import ImagesConfig
from aenv.errors import AenvError, ErrorCode
from aenv.images.reference import ImageRef

log = logging.getLogger("aenv.images")

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEX_TYPES = frozenset({OCI_INDEX, DOCKER_LIST})
MANIFEST_TYPES = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
_ACCEPT = f"{OCI_INDEX}, {DOCKER_LIST}, {OCI_MANIFEST}, {DOCKER_MANIFEST}"
MAX_MANIFEST_BYTES = 4 << 20  # what containerd accepts; a bigger "manifest" is not one
_CHALLENGE_PARAM = re.compile(r'(\w+)=(?:"([^"]*)"|([^\s,]+))')
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Manifest:
    media_type: str
    digest: str  # sha256:<hex> of `data`
    data: bytes

    def json(self) -> dict[str, Any]:
        try:
            parsed = json.loads(self.data)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise AenvError(ErrorCode.INVALID_ARGUMENT,
                            f"manifest {self.digest} is not JSON") from None
        if not isinstance(parsed, dict):
            raise AenvError(ErrorCode.INVALID_ARGUMENT, f"manifest {self.digest} is not an object")
        return parsed


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def check_digest(digest: str) -> str:
    """The hex part of a sha256 digest; other algorithms are refused."""
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise AenvError(ErrorCode.NOT_SUPPORTED, f"unsupported digest {digest!r} (sha256 only)")
    return hexpart


def _parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    params = {m.group(1).lower(): m.group(2) if m.group(2) is not None else m.group(3)
              for m in _CHALLENGE_PARAM.finditer(rest)}
    return scheme.lower(), params


def load_auth_file(path: str) -> dict[str, tuple[str, str]]:
    """Credentials from a docker-style config.json (`auths.<host>.auth` or username/password)."""
    if not path:
        return {}
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as exc:
        raise AenvError(ErrorCode.INVALID_ARGUMENT, f"images.auth_file {path}: {exc}") from None
    out: dict[str, tuple[str, str]] = {}
    for host, entry in (data.get("auths") or {}).items():
        if not isinstance(entry, dict):
            continue
        # Docker writes Docker Hub as a URL; the other keys are plain hosts.
        key = re.sub(r"^https?://", "", host).split("/", 1)[0]
        if key == "index.docker.io":
            key = "docker.io"
        if entry.get("auth"):
            user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
            out[key] = (user, password)
        elif entry.get("username"):
            out[key] = (str(entry["username"]), str(entry.get("password", "")))
    return out


class RegistryClient:
    """One pull's connection to registries. Tokens are cached per (host, repository)."""

    def __init__(self, config: ImagesConfig, insecure: bool = False) -> None:
        self.config = config
        self.insecure = insecure
        creds = load_auth_file(config.auth_file)
        for host, entry in config.credentials.items():
            creds[host] = (str(entry.get("username", "")), str(entry.get("password", "")))
        self._credentials = creds
        self._auth: dict[tuple[str, str], str] = {}  # (host, repository) -> Authorization
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(30.0, read=60.0), follow_redirects=True,
            headers={"User-Agent": "aenv-pull/0.1"})

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    # ---------------------------------------------------------------- plumbing
    def check_allowed(self, ref: ImageRef) -> None:
        allowed = self.config.allowed_registries
        if allowed and ref.registry not in allowed and ref.api_host not in allowed:
            raise AenvError(ErrorCode.INVALID_ARGUMENT,
                            f"registry {ref.registry} is not in images.allowed_registries "
                            f"({', '.join(allowed)})")

    def _scheme(self, ref: ImageRef) -> str:
        plain = self.insecure or ref.registry in self.config.insecure_registries
        return "http" if plain else "https"

    def _url(self, ref: ImageRef, tail: str) -> str:
        return f"{self._scheme(ref)}://{ref.api_host}/v2/{ref.repository}/{tail}"

    async def _authorize(self, ref: ImageRef, challenge: str) -> str:
        """Answer a 401's challenge; returns the Authorization header to retry with."""
        scheme, params = _parse_challenge(challenge)
        creds = self._credentials.get(ref.registry) or self._credentials.get(ref.api_host)
        basic = ("Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
                 if creds else None)
        if scheme == "basic":
            if basic is None:
                raise AenvError(ErrorCode.UNAUTHENTICATED,
                                f"{ref.registry} requires credentials for {ref.repository}: "
                                "add them to images.credentials or images.auth_file")
            return basic
        if scheme != "bearer" or "realm" not in params:
            raise AenvError(ErrorCode.NOT_SUPPORTED,
                            f"{ref.registry}: unsupported authentication challenge {challenge!r}")
        query = {"scope": params.get("scope") or f"repository:{ref.repository}:pull"}
        if params.get("service"):
            query["service"] = params["service"]
        headers = {"Authorization": basic} if basic else {}
        try:
            resp = await self._http.get(params["realm"], params=query, headers=headers)
        except httpx.HTTPError as exc:
            raise AenvError(ErrorCode.UNAVAILABLE,
                            f"{ref.registry}: token service {params['realm']}: {exc}") from None
        if resp.status_code in (401, 403):
            raise AenvError(ErrorCode.UNAUTHENTICATED,
                            f"{ref.registry}: token service refused the "
                            f"{'credentials' if basic else 'anonymous request'} for {ref.repository}")
        if resp.status_code != 200:
            raise AenvError(ErrorCode.UNAVAILABLE,
                            f"{ref.registry}: token service answered {resp.status_code}")
        try:
            body = resp.json()
            token = body.get("token") or body.get("access_token")
        except ValueError:
            token = None
        if not token:
            raise AenvError(ErrorCode.UNAVAILABLE, f"{ref.registry}: token service gave no token")
        return f"Bearer {token}"

    async def _send(self, ref: ImageRef, method: str, tail: str,
                    headers: dict[str, str] | None = None) -> httpx.Response:
        """A streamed response (the caller closes it), authorised as the registry asks.
        Raises AenvError for every status >= 400."""
        key = (ref.api_host, ref.repository)
        url = self._url(ref, tail)
        for attempt in range(2):
            all_headers = dict(headers or {})
            if key in self._auth:
                all_headers["Authorization"] = self._auth[key]
            try:
                request = self._http.build_request(method, url, headers=all_headers)
                resp = await self._http.send(request, stream=True)
            except httpx.HTTPError as exc:
                hint = (" (a plain-HTTP registry must be marked insecure: --insecure or "
                        "images.insecure_registries)" if self._scheme(ref) == "https" else "")
                raise AenvError(ErrorCode.UNAVAILABLE,
                                f"cannot reach registry {ref.registry}: {exc or type(exc).__name__}"
                                f"{hint}") from None
            if resp.status_code != 401:
                break
            challenge = resp.headers.get("WWW-Authenticate", "")
            await resp.aclose()
            if attempt == 1 or not challenge:
                raise AenvError(ErrorCode.UNAUTHENTICATED,
                                f"{ref.registry} refused access to {ref.repository} "
                                "(wrong or missing credentials)")
            self._auth[key] = await self._authorize(ref, challenge)
        if resp.status_code >= 400:
            await resp.aread()
            await resp.aclose()
            raise self._status_error(ref, tail, resp)
        return resp

    def _status_error(self, ref: ImageRef, tail: str, resp: httpx.Response) -> AenvError:
        detail = ""
        try:
            errors = resp.json().get("errors") or []
            detail = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors)
        except (ValueError, AttributeError):
            detail = resp.text[:200]
        what = f"{ref.registry}/{ref.repository} {tail}"
        status = resp.status_code
        code = (ErrorCode.NOT_FOUND if status == 404 else
                ErrorCode.UNAUTHENTICATED if status in (401, 403) else
                ErrorCode.RESOURCE_EXHAUSTED if status == 429 else
                ErrorCode.UNAVAILABLE if status >= 500 else ErrorCode.INVALID_ARGUMENT)
        return AenvError(code, f"{what}: HTTP {status}{': ' + detail if detail else ''}")

    # ---------------------------------------------------------------- manifests and blobs
    async def manifest(self, ref: ImageRef, reference: str | None = None) -> Manifest:
        """The manifest or index at `reference` (default: the ref's digest or tag)."""
        reference = reference or ref.reference
        resp = await self._send(ref, "GET", f"manifests/{reference}", {"Accept": _ACCEPT})
        try:
            data = bytearray()
            async for chunk in resp.aiter_bytes():
                data += chunk
                if len(data) > MAX_MANIFEST_BYTES:
                    raise AenvError(ErrorCode.INVALID_ARGUMENT,
                                    f"{ref}: manifest larger than {MAX_MANIFEST_BYTES} bytes")
        except httpx.HTTPError as exc:
            raise AenvError(ErrorCode.UNAVAILABLE, f"{ref}: reading the manifest: {exc}") from None
        finally:
            await resp.aclose()
        body = bytes(data)
        digest = sha256_digest(body)
        expected = reference if reference.startswith("sha256:") else None
        header = resp.headers.get("Docker-Content-Digest")
        for claimed in (expected, header):
            if claimed and claimed != digest:
                raise AenvError(ErrorCode.DATA_LOSS,
                                f"{ref}: manifest digest mismatch (expected {claimed}, got {digest})")
        media_type = resp.headers.get("Content-Type", "").split(";")[0].strip()
        if media_type not in INDEX_TYPES | MANIFEST_TYPES:
            media_type = str(Manifest(media_type, digest, body).json().get("mediaType", ""))
        if media_type not in INDEX_TYPES | MANIFEST_TYPES:
            raise AenvError(ErrorCode.NOT_SUPPORTED,
                            f"{ref}: unsupported manifest type {media_type or 'unknown'!r} "
                            "(OCI or Docker schema2 only)")
        return Manifest(media_type, digest, body)

    async def blob_bytes(self, ref: ImageRef, digest: str, limit: int = 16 << 20) -> bytes:
        """A small blob (an image config) in memory, verified."""
        check_digest(digest)
        resp = await self._send(ref, "GET", f"blobs/{digest}")
        try:
            data = bytearray()
            async for chunk in resp.aiter_bytes():
                data += chunk
                if len(data) > limit:
                    raise AenvError(ErrorCode.INVALID_ARGUMENT, f"{ref}: blob {digest} too large")
        except httpx.HTTPError as exc:
            raise AenvError(ErrorCode.UNAVAILABLE, f"{ref}: reading blob {digest}: {exc}") from None
        finally:
            await resp.aclose()
        if sha256_digest(bytes(data)) != digest:
            raise AenvError(ErrorCode.DATA_LOSS, f"{ref}: blob {digest} failed its digest check")
        return bytes(data)

    async def download(self, ref: ImageRef, digest: str, size: int | None, dest: Path,
                       on_progress: Callable[[int], None] | None = None) -> Path:
        """Download blob `digest` to `dest`, verified. Bytes already in `dest`.partial (an
        interrupted attempt, also of an earlier pull) are kept and the rest is asked for with
        a Range request; a server that ignores Range makes us start over. On a digest or size
        mismatch nothing is kept and AenvError(DATA_LOSS) is raised."""
        hexpart = check_digest(digest)
        partial = dest.with_name(dest.name + ".partial")
        hasher = hashlib.sha256()
        done = 0
        if partial.exists():
            done = await asyncio.to_thread(_hash_file, partial, hasher)
        attempt = 0
        while True:
            if size is not None and done >= size:
                break
            # identity: a Range is about the bytes stored, never a re-encoded stream.
            headers = {"Accept-Encoding": "identity"}
            if done:
                headers["Range"] = f"bytes={done}-"
            try:
                resp = await self._send(ref, "GET", f"blobs/{digest}", headers)
            except AenvError as exc:
                # A registry that is briefly unavailable is retried like a dropped connection.
                if exc.code is not ErrorCode.UNAVAILABLE or attempt >= self.config.retries:
                    raise
                attempt += 1
                await asyncio.sleep(min(0.2 * 2 ** attempt, 5.0))
                continue
            try:
                if done and resp.status_code != 206:
                    log.info("%s: registry ignored the Range request; downloading %s again",
                             ref.registry, digest)
                    done, hasher = 0, hashlib.sha256()
                f = await asyncio.to_thread(_open_at, partial, done)
                pending = bytearray()
                try:
                    # Raw bytes as they arrive (no content decoding: we asked for identity),
                    # written and hashed off the event loop in batches of about _CHUNK.
                    async for piece in resp.aiter_raw():
                        pending += piece
                        if len(pending) >= _CHUNK:
                            done += await asyncio.to_thread(_append, f, hasher, pending)
                            pending = bytearray()
                            if size is not None and done > size:
                                break
                            if on_progress is not None:
                                on_progress(done)
                finally:
                    # Also on a broken connection: what arrived is kept for the resume.
                    done += await asyncio.to_thread(_append, f, hasher, pending)
                    await asyncio.to_thread(f.close)
                break
            except httpx.TransportError as exc:
                attempt += 1
                if attempt > self.config.retries:
                    raise AenvError(ErrorCode.UNAVAILABLE,
                                    f"{ref}: downloading {digest} failed {attempt} times, "
                                    f"last: {exc or type(exc).__name__}") from None
                log.info("%s: download of %s interrupted at %d bytes (%s); resuming",
                         ref.registry, digest, done, exc or type(exc).__name__)
                await asyncio.sleep(min(0.2 * 2 ** attempt, 5.0))
            finally:
                await resp.aclose()
        if hasher.hexdigest() != hexpart or (size is not None and done != size):
            partial.unlink(missing_ok=True)
            raise AenvError(ErrorCode.DATA_LOSS,
                            f"{ref}: blob {digest} failed verification (got {done} bytes with "
                            f"sha256:{hasher.hexdigest()}); nothing was kept")
        os.replace(partial, dest)
        return dest


def _open_at(path: Path, offset: int) -> BinaryIO:
    f = open(path, "r+b" if offset else "wb")  # noqa: SIM115 (closed by the caller)
    f.seek(offset)
    f.truncate()
    return f


def _append(f: BinaryIO, hasher: Any, chunk: bytes | bytearray) -> int:
    f.write(chunk)
    hasher.update(chunk)
    return len(chunk)


def _hash_file(path: Path, hasher: Any) -> int:
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            hasher.update(chunk)
            size += len(chunk)
    return size
