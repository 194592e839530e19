"""`GET /files` (download) and `POST /files` (upload).

Owns: the plain-HTTP file transfer API. Downloads stream the file (zero-copy `sendfile`,
single byte ranges honoured) or gzip it on the fly when gzip is what the client asks for
(see `accepts_gzip`). Uploads are written to disk as they arrive — multipart bodies (one or more
`file` parts whose filename is the destination path; a `?path=` wins for a single file)
are parsed incrementally and `application/octet-stream` bodies (optionally
`Content-Encoding: gzip`) are decompressed incrementally — so a large upload never sits
in memory. Parent directories are created for, and new files owned by, the user.

Every path is resolved and opened with the requesting user's credentials
(`FsCredentials.as_user`): the kernel checks permissions, symlinks and `..` as for that
user's own processes. Only the open happens as the user; reading from or writing to the
descriptor it gave, and the metadata of the file, are then envd's business.

Errors are `{"code": <http status>, "message": ...}`: 400 bad input, 401 auth or unknown
user, 403 permission denied (the SDK raises SandboxException with the message), 404
missing file, 507 disk full.
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
import zlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, BinaryIO

from aenv.envd.auth import TOKEN_HEADER, check_files_access
from aenv.envd.entries import chown, client_status, ensure_dirs, go_base, resolve_path, validate_metadata
from aenv.envd.errors import RpcError
from aenv.envd.http import Body, ClientGone, Request, Response
from aenv.envd.users import User

if TYPE_CHECKING:
    from aenv.envd.server import App

CHUNK = 256 * 1024
METADATA_PREFIX = "x-metadata-"
GZIP_LEVEL = 1  # on-the-fly compression: speed matters more than the last few percent


class FileError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _from_rpc(error: RpcError) -> FileError:
    return FileError(error.http_status, error.message)


# -- helpers ---------------------------------------------------------------------------


def parse_params(value: str) -> tuple[str, dict[str, str]]:
    """`type; key=value; key="quoted \\" value"` → (type, params), keys lowercased."""
    main, _, rest = value.partition(";")
    params: dict[str, str] = {}
    i, n = 0, len(rest)
    while i < n:
        while i < n and rest[i] in " \t;":
            i += 1
        start = i
        while i < n and rest[i] not in "=;":
            i += 1
        key = rest[start:i].strip().lower()
        if i >= n or rest[i] != "=":
            continue
        i += 1
        if i < n and rest[i] == '"':
            i += 1
            chars = []
            while i < n and rest[i] != '"':
                if rest[i] == "\\" and i + 1 < n:
                    i += 1
                chars.append(rest[i])
                i += 1
            i += 1
            text = "".join(chars)
        else:
            start = i
            while i < n and rest[i] != ";":
                i += 1
            text = rest[start:i].strip()
        if key.endswith("*"):
            # RFC 5987/2231 extended value: charset'lang'percent-encoded
            key = key[:-1]
            charset, _, encoded = text.partition("'")
            _, _, encoded = encoded.partition("'")
            try:
                text = _pct(encoded, charset or "utf-8")
            except (LookupError, ValueError):
                continue
            params[key] = text
        elif key:
            params.setdefault(key, text)
    return main.strip().lower(), params


def _pct(text: str, charset: str) -> str:
    raw = text.encode("latin-1", "replace")
    out = bytearray()
    i = 0
    while i < len(raw):
        if raw[i] == 0x25 and i + 3 <= len(raw):
            try:
                out.append(int(raw[i + 1 : i + 3], 16))
                i += 3
                continue
            except ValueError:
                pass
        out.append(raw[i])
        i += 1
    return out.decode(charset)


def accepts_gzip(header: str) -> bool | None:
    """Whether to gzip a download: True gzip, False identity, None nothing acceptable.

    Only when gzip is the one coding the client offers (the SDK's `gzip=True` sends just
    `gzip`) or identity is refused. For httpx's default `gzip, deflate` the file goes out
    uncompressed with zero-copy sendfile: deflating in Python runs at ~50 MB/s and would
    be the bottleneck of every large download. (Go envd gzips whenever gzip is merely
    acceptable; either answer is valid HTTP and transparent to clients.)
    """
    if not header.strip():
        return False
    offered: dict[str, float] = {}
    for item in header.split(","):
        name, params = parse_params(item)
        if not name:
            continue
        try:
            offered[name] = float(params.get("q", "1"))
        except ValueError:
            offered[name] = 1.0
    gzip_ok = offered.get("gzip", offered.get("*", 0.0)) > 0
    identity = offered.get("identity", offered.get("*", 1.0))
    if identity == 0:
        return True if gzip_ok else None
    others = [name for name, q in offered.items() if q > 0 and name not in ("gzip", "identity")]
    return offered.get("gzip", 0.0) > 0 and not others


def parse_range(header: str, size: int) -> tuple[int, int] | None | bool:
    """A single `bytes=` range → (start, end exclusive); None to ignore; False unsatisfiable."""
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = spec.strip().partition("-")
    if not dash:
        return None
    try:
        if first == "":
            length = int(last)
            if length <= 0:
                return False
            return max(0, size - length), size
        start = int(first)
        end = int(last) + 1 if last else size
    except ValueError:
        return None
    if start >= size or start < 0 or end <= start:
        return False
    return start, min(end, size)


def content_disposition(name: str) -> str:
    if name.isascii() and name.isprintable():
        escaped = name.replace("\\", "\\\\").replace('"', '\\"')
        return f'inline; filename="{escaped}"'
    encoded = "".join(
        chr(b) if chr(b).isalnum() or chr(b) in "-._~" else f"%{b:02X}"
        for b in name.encode("utf-8", "surrogateescape")
    )
    return f"inline; filename*=utf-8''{encoded}"


def _open_binary(path: str) -> BinaryIO:
    # A local open() does not block for long; envd has no threads to hand it to.
    return open(path, "rb")  # the caller closes it


def _denied(status: int, error: OSError) -> int:
    """403 for what the kernel refused the user (EACCES, EPERM), 400 for a path the client
    got wrong (a name too long, a symlink loop, ...), else `status`."""
    client = client_status(error)
    return status if client is None else client


class Source:
    """The request body, gunzipped incrementally when `Content-Encoding: gzip`."""

    def __init__(self, body: Body, gzipped: bool) -> None:
        self._body = body
        self._inflate = zlib.decompressobj(wbits=31) if gzipped else None

    async def read(self) -> bytes:
        inflate = self._inflate
        if inflate is None:
            return await self._body.read(CHUNK)
        try:
            while True:
                if inflate.unconsumed_tail:
                    out = inflate.decompress(inflate.unconsumed_tail, CHUNK)
                    if out:
                        return out
                if inflate.eof:
                    await self._body.discard()
                    return b""
                raw = await self._body.read(CHUNK)
                if not raw:
                    out = inflate.flush()
                    if not inflate.eof:
                        raise FileError(400, "error decompressing request body: unexpected EOF")
                    return out
                # Bounded output per step: a small gzip bomb cannot allocate gigabytes.
                out = inflate.decompress(raw, CHUNK)
                if out:
                    return out
        except zlib.error as e:
            raise FileError(400, f"error decompressing request body: {e}") from None


class Multipart:
    """Incremental multipart/form-data parser (parts are read strictly in order)."""

    def __init__(self, source: Source, boundary: str) -> None:
        self._source = source
        # Pretend the body starts after a line break, so the first boundary matches
        # the same delimiter as all later ones.
        self._buf = bytearray(b"\r\n")
        self._delim = b"\r\n--" + boundary.encode("latin-1")
        self._in_part = False

    async def _fill(self) -> None:
        data = await self._source.read()
        if not data:
            raise FileError(400, "error reading form: multipart: unexpected EOF")
        self._buf += data

    async def next_part(self) -> dict[str, str] | None:
        """Headers of the next part (lowercased names), or None after the last one."""
        while self._in_part:
            await self.read()
        delim = self._delim
        while True:
            index = self._buf.find(delim)
            if index >= 0:
                del self._buf[: index + len(delim)]
                break
            keep = len(delim) - 1
            if len(self._buf) > keep:
                del self._buf[: len(self._buf) - keep]
            await self._fill()
        while len(self._buf) < 2:
            await self._fill()
        if self._buf[:2] == b"--":
            self._buf.clear()
            return None
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(self._buf) > 64 * 1024:
                raise FileError(400, "error reading form: part headers too large")
            await self._fill()
        head = bytes(self._buf[:end])
        del self._buf[: end + 4]
        headers: dict[str, str] = {}
        for line in head.split(b"\r\n")[1:]:  # [0] is the rest of the boundary line
            name, sep, value = line.partition(b":")
            if sep:
                headers[name.decode("latin-1").strip().lower()] = value.decode("utf-8", "surrogateescape").strip()
        self._in_part = True
        return headers

    async def read(self) -> bytes:
        """The next piece of the current part's data; b"" at its end."""
        if not self._in_part:
            return b""
        delim = self._delim
        while True:
            index = self._buf.find(delim)
            if index >= 0:
                data = bytes(self._buf[:index])
                del self._buf[:index]
                self._in_part = False
                return data
            safe = len(self._buf) - (len(delim) - 1)
            if safe > 0:
                data = bytes(self._buf[:safe])
                del self._buf[:safe]
                return data
            await self._fill()


# -- the handler -------------------------------------------------------------------------


class FilesApi:
    def __init__(self, app: App) -> None:
        self.app = app

    def _user(self, request: Request) -> tuple[str, User]:
        query = request.query
        name = query.get("username", self.app.settings.default_user)
        user = self.app.users.lookup(name)
        if user is None:
            raise FileError(401, f"error looking up user '{name}': user: unknown user {name}")
        return name, user

    def _authorize(self, request: Request, path: str, operation: str) -> None:
        try:
            check_files_access(
                self.app.settings.access_token,
                request.header(TOKEN_HEADER),
                request.query,
                path,
                operation,
            )
        except RpcError as e:
            raise FileError(e.http_status, e.message) from None

    async def handle(self, request: Request, response: Response) -> None:
        try:
            if request.method in ("GET", "HEAD"):
                await self.download(request, response)
            elif request.method == "POST":
                await self.upload(request, response)
            else:
                raise FileError(405, f"method {request.method} not allowed")
        except FileError as e:
            if response.started:
                response.connection.abort()
                return
            await response.send_error(e.status, str(e))

    # -- download -----------------------------------------------------------------------

    async def download(self, request: Request, response: Response) -> None:
        raw_path = request.query.get("path", "")
        self._authorize(request, raw_path, "read")
        _, user = self._user(request)
        try:
            path = resolve_path(raw_path, user, self.app.settings.default_workdir)
        except RpcError as e:
            raise FileError(400, f"error expanding and resolving path '{raw_path}': {e.message}") from None
        with self.app.creds.as_user(user):
            f, st = self._open_for_reading(path)
        try:
            await self._send_file(request, response, path, f, st)
        finally:
            f.close()

    @staticmethod
    def _open_for_reading(path: str) -> tuple[BinaryIO, os.stat_result]:
        """Stat and open `path` (as the requesting user: inside `as_user`)."""
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise FileError(404, f"path '{path}' does not exist") from None
        except OSError as e:
            raise FileError(_denied(500, e), f"error checking if path exists '{path}': {e.strerror}") from None
        if stat.S_ISDIR(st.st_mode):
            raise FileError(400, f"path '{path}' is a directory")
        try:
            f = _open_binary(path)
        except OSError as e:
            raise FileError(_denied(500, e), f"error opening file '{path}': {e.strerror}") from None
        try:
            # What was opened, not what the path named a moment earlier.
            st = os.fstat(f.fileno())
        except BaseException:
            f.close()
            raise
        if stat.S_ISDIR(st.st_mode):
            f.close()
            raise FileError(400, f"path '{path}' is a directory")
        return f, st

    async def _send_file(
        self, request: Request, response: Response, path: str, f: BinaryIO, st: os.stat_result
    ) -> None:
        gzipped = accepts_gzip(request.header("accept-encoding"))
        byte_range: tuple[int, int] | None | bool = None
        if request.header("range"):
            gzipped = False  # ranges address the file's own bytes
            byte_range = parse_range(request.header("range"), st.st_size)
        if gzipped is None:
            raise FileError(406, "error parsing Accept-Encoding: no acceptable encoding found, supported: [gzip]")
        headers = [
            ("Content-Type", "application/octet-stream"),
            ("Content-Disposition", content_disposition(go_base(path))),
            ("Vary", "Accept-Encoding"),
        ]
        if gzipped:
            await self._send_gzip(f, headers, response)
            return
        headers.append(("Accept-Ranges", "bytes"))
        if byte_range is False:
            headers.append(("Content-Range", f"bytes */{st.st_size}"))
            await response.send(416, b"", None, headers)
            return
        start, end, status = 0, st.st_size, 200
        if isinstance(byte_range, tuple):
            start, end = byte_range
            status = 206
            headers.append(("Content-Range", f"bytes {start}-{end - 1}/{st.st_size}"))
        if not stat.S_ISREG(st.st_mode) or (st.st_size == 0 and status == 200):
            # /proc files, pipes, devices: the stat size means nothing; stream it.
            await response.start(200, headers)
            while data := f.read(CHUNK):
                await response.write(data)
            await response.end()
            return
        await response.start(status, headers, end - start)
        if end > start and request.method != "HEAD":
            transport = response.connection.transport
            assert transport is not None
            try:
                await asyncio.get_running_loop().sendfile(transport, f, start, end - start)
            except (ConnectionError, OSError, RuntimeError) as e:
                raise ClientGone(str(e)) from None
        await response.end()

    async def _send_gzip(self, f: BinaryIO, headers: list[tuple[str, str]], response: Response) -> None:
        headers.append(("Content-Encoding", "gzip"))
        await response.start(200, headers)
        deflate = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)
        while data := f.read(CHUNK):
            out = deflate.compress(data)
            if out:
                await response.write(out)
        await response.write(deflate.flush())
        await response.end()

    # -- upload -------------------------------------------------------------------------

    async def upload(self, request: Request, response: Response) -> None:
        query = request.query
        path_param = query.get("path")
        self._authorize(request, path_param or "", "write")
        _, user = self._user(request)

        encoding = request.header("content-encoding").split(";")[0].strip().lower()
        if encoding not in ("", "identity", "gzip"):
            raise FileError(
                400,
                f"error decompressing request body: unsupported Content-Encoding: {encoding}, supported: [gzip]",
            )
        metadata = {
            name[len(METADATA_PREFIX) :]: value
            for name, value in request.headers.items()
            if name.startswith(METADATA_PREFIX) and len(name) > len(METADATA_PREFIX)
        }
        try:
            validate_metadata(metadata)
        except RpcError as e:
            raise _from_rpc(e) from None

        content_type = request.header("content-type")
        media, params = parse_params(content_type)
        source = Source(request.body, encoding == "gzip")
        results: list[dict[str, object]] = []
        if media == "application/octet-stream":
            if path_param is None:
                raise FileError(400, "path query parameter is required for raw body upload")
            path = self._resolve(path_param, user)
            stored = await self._write(path, user, self._chunks(source), metadata)
            results.append(self._result(path, stored))
        elif media.startswith("multipart/"):
            boundary = params.get("boundary")
            if not boundary:
                raise FileError(400, "error parsing multipart form: no multipart boundary param in Content-Type")
            # RFC 2046 allows 70 characters of printable ASCII; a little more is tolerated, but
            # no byte the delimiter line could not carry (e.g. from `boundary*=utf-8''%E2%82%AC`).
            if len(boundary) > 200 or not (boundary.isascii() and boundary.isprintable()):
                raise FileError(400, "error parsing multipart form: invalid multipart boundary")
            form = Multipart(source, boundary)
            seen: list[str] = []
            while (headers := await form.next_part()) is not None:
                _, disposition = parse_params(headers.get("content-disposition", ""))
                if disposition.get("name") != "file":
                    continue
                if path_param is not None:
                    target = path_param
                elif "filename" in disposition:
                    target = disposition["filename"]
                else:
                    raise FileError(400, "error getting multipart custom part file name: filename not found in Content-Disposition header")
                path = self._resolve(target, user)
                if path in seen:
                    raise FileError(
                        400,
                        f"you cannot upload multiple files to the same path '{path}' in one upload "
                        "request, only the first specified file was uploaded",
                    )
                seen.append(path)
                stored = await self._write(path, user, self._part(form), metadata)
                results.append(self._result(path, stored))
        else:
            raise FileError(
                400,
                f"unsupported content type: {content_type}, expected multipart/form-data or application/octet-stream",
            )
        await response.send_json(200, results)

    def _resolve(self, raw: str, user: User) -> str:
        try:
            return resolve_path(raw, user, self.app.settings.default_workdir)
        except RpcError as e:
            raise FileError(400, f"error resolving path: {e.message}") from None

    async def _chunks(self, source: Source) -> AsyncIterator[bytes]:
        while data := await source.read():
            yield data

    async def _part(self, form: Multipart) -> AsyncIterator[bytes]:
        while data := await form.read():
            yield data

    def _result(self, path: str, metadata: dict[str, str]) -> dict[str, object]:
        result: dict[str, object] = {"path": path, "name": go_base(path), "type": "file"}
        if metadata:
            result["metadata"] = metadata
        return result

    async def _write(
        self, path: str, user: User, chunks: AsyncIterator[bytes], metadata: dict[str, str]
    ) -> dict[str, str]:
        """Write the upload to `path`; the file's metadata afterwards."""
        with self.app.creds.as_user(user):
            fd = self._open_for_writing(path, user)
        try:
            try:
                async for data in chunks:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                # On the descriptor the user opened for writing, whatever the path names now.
                self.app.entries.metadata.replace(fd, metadata)
                return self.app.entries.metadata.read(fd)
            except ClientGone:  # an OSError too, but the body's end, not the disk's
                raise
            except OSError as e:
                raise self._disk_error(e, "error writing file") from None
        finally:
            os.close(fd)

    def _open_for_writing(self, path: str, user: User) -> int:
        """Create the parents and open `path` for writing (as the requesting user: inside
        `as_user`, where what is created belongs to the user already)."""
        try:
            ensure_dirs(os.path.dirname(path), user.uid, user.gid)
        except RpcError as e:
            raise FileError(min(500, e.http_status),
                            f"error ensuring directories: {e.message}") from None
        try:
            if stat.S_ISDIR(os.stat(path).st_mode):
                raise FileError(400, f"path is a directory: {path}")
        except FileNotFoundError:
            pass
        except OSError as e:
            raise FileError(_denied(500, e), f"error getting file info: {e.strerror}") from None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        except OSError as e:
            raise self._disk_error(e, "error opening file") from None
        if not self.app.creds.switches_for(user):
            # Opened by envd as itself (root for root, or an unprivileged envd): give it to
            # the user as Go envd does. Created as the user, it is the user's already.
            try:
                chown(fd, user.uid, user.gid)
            except OSError as e:
                os.close(fd)
                raise FileError(500, f"error changing file ownership: {e.strerror}") from None
        return fd

    @staticmethod
    def _disk_error(error: OSError, action: str) -> FileError:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            return FileError(507, f"{action}: not enough disk space available")
        return FileError(_denied(500, error), f"{action}: {error.strerror}")

