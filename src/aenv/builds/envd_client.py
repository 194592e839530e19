"""A server-side client for one sandbox's envd: run a command, start one in the background,
upload a file.

Owns: the Connect JSON envelopes of `process.Process/Start` and the raw `POST /files` upload,
over connections that `SandboxManager.open_port` opens inside the sandbox (no host ports).
Must not touch: sandbox records or lifecycle (the manager's), build state (`builds.builder`).
"""

from __future__ import annotations

import asyncio
import base64
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpcore

from aenv.connect_frames import Frames, envelope
from aenv.errors import AenvError, ErrorCode

OpenPort = Callable[[str, int], Awaitable[socket.socket]]
OutputSink = Callable[[str, str], None]  # (stream "stdout"|"stderr", one line)

_UPLOAD_CHUNK = 256 * 1024


class _Stream(httpcore.AsyncNetworkStream):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        async with asyncio.timeout(timeout):
            return await self.reader.read(max_bytes)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        async with asyncio.timeout(timeout):
            self.writer.write(buffer)
            await self.writer.drain()

    async def aclose(self) -> None:
        self.writer.close()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        raise AenvError(ErrorCode.NOT_SUPPORTED, "envd speaks plain HTTP")


class _SandboxBackend(httpcore.AsyncNetworkBackend):
    """Every "TCP connection" is a socket inside the sandbox's network namespace."""

    def __init__(self, open_port: OpenPort, sandbox_id: str) -> None:
        self.open_port, self.sandbox_id = open_port, sandbox_id

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None
                          ) -> httpcore.AsyncNetworkStream:
        sock = await self.open_port(self.sandbox_id, port)
        reader, writer = await asyncio.open_connection(sock=sock)
        return _Stream(reader, writer)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class _Lines:
    """Splits a byte stream into text lines (a partial last line is kept until flushed)."""

    def __init__(self, stream: str, sink: OutputSink) -> None:
        self.stream, self.sink, self.buf = stream, sink, b""

    def feed(self, data: bytes) -> None:
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        for line in lines:
            self.sink(self.stream, line.decode(errors="replace").rstrip("\r"))

    def flush(self) -> None:
        if self.buf:
            self.sink(self.stream, self.buf.decode(errors="replace").rstrip("\r"))
            self.buf = b""


class SandboxEnvd:
    """envd of one sandbox, authenticated with its access token."""

    def __init__(self, open_port: OpenPort, sandbox_id: str, token: str, port: int) -> None:
        self.token = token
        self.base = f"http://envd:{port}"
        self.pool = httpcore.AsyncConnectionPool(
            network_backend=_SandboxBackend(open_port, sandbox_id), max_connections=4)

    async def aclose(self) -> None:
        await self.pool.aclose()

    def _headers(self, user: str | None, content_type: str) -> list[tuple[str, str]]:
        headers = [("Host", "envd"), ("X-Access-Token", self.token),
                   ("Content-Type", content_type), ("Connect-Protocol-Version", "1")]
        if user:
            headers.append(("Authorization",
                            "Basic " + base64.b64encode(f"{user}:".encode()).decode()))
        return headers

    async def _start(self, cmd: str, user: str, cwd: str | None, envs: dict[str, str],
                     timeout_s: float | None) -> AsyncIterator[dict[str, Any]]:
        """The events of `process.Process/Start` for `/bin/bash -l -c cmd` (envd falls back
        to /bin/sh where there is no bash), until the end-of-stream envelope."""
        process: dict[str, Any] = {"cmd": "/bin/bash", "args": ["-l", "-c", cmd], "envs": envs}
        if cwd:
            process["cwd"] = cwd
        headers = self._headers(user, "application/connect+json")
        if timeout_s is not None:
            headers.append(("Connect-Timeout-Ms", str(int(timeout_s * 1000))))
        body = envelope({"process": process, "stdin": False})
        try:
            async with self.pool.stream("POST", self.base + "/process.Process/Start",
                                        headers=headers, content=body) as resp:
                if resp.status != 200:
                    raw = b"".join([chunk async for chunk in resp.aiter_stream()])
                    raise AenvError(ErrorCode.INTERNAL, f"envd answered {resp.status}: "
                                    f"{raw[:300].decode(errors='replace')}")
                frames = Frames()
                async for chunk in resp.aiter_stream():
                    for end, msg in frames.feed(chunk):
                        if end:
                            error = msg.get("error")
                            if error:
                                raise AenvError(ErrorCode.INVALID_ARGUMENT if error.get("code") in
                                                ("invalid_argument", "not_found",
                                                 "unauthenticated")
                                                else ErrorCode.INTERNAL,
                                                f"envd: {error.get('message', error)}")
                            return
                        yield msg.get("event", {})
        except httpcore.TimeoutException:
            raise AenvError(ErrorCode.TIMEOUT, "envd did not answer in time") from None
        except httpcore.NetworkError as exc:
            raise AenvError(ErrorCode.UNAVAILABLE, f"connection to envd lost: {exc}") from None

    async def run(self, cmd: str, *, user: str, cwd: str | None = None,
                  envs: dict[str, str] | None = None, timeout_s: float | None = None,
                  output: OutputSink | None = None) -> int:
        """Run `cmd` to its end; every output line goes to `output`. Returns the exit code
        (-1 when it was killed by a signal, e.g. at `timeout_s`)."""
        sink: OutputSink = output or (lambda _s, _l: None)
        streams = {"stdout": _Lines("stdout", sink), "stderr": _Lines("stderr", sink)}
        code = -1
        async for event in self._start(cmd, user, cwd, envs or {}, timeout_s):
            data = event.get("data")
            if data:
                for name, lines in streams.items():
                    if data.get(name):
                        lines.feed(base64.b64decode(data[name]))
            end = event.get("end")
            if end is not None:
                code = int(end.get("exitCode", 0)) if end.get("exited", True) else -1
        for lines in streams.values():
            lines.flush()
        return code

    async def start(self, cmd: str, *, user: str, cwd: str | None = None,
                    envs: dict[str, str] | None = None) -> int:
        """Start `cmd` and return its pid as soon as it runs; it keeps running (envd keeps a
        process whose client went away)."""
        async for event in self._start(cmd, user, cwd, envs or {}, None):
            start = event.get("start")
            if start is not None:
                return int(start.get("pid", 0))
            end = event.get("end")
            if end is not None:
                raise AenvError(ErrorCode.INVALID_ARGUMENT,
                                f"start command ended at once: {end.get('status', end)}")
        raise AenvError(ErrorCode.INTERNAL, "envd did not report the start command's pid")

    async def upload(self, local: Path, remote: str, user: str = "root") -> None:
        """Write the local file `local` to `remote` in the sandbox (streamed)."""
        async def body() -> AsyncIterator[bytes]:
            with local.open("rb") as f:
                while chunk := await asyncio.to_thread(f.read, _UPLOAD_CHUNK):
                    yield chunk

        size = local.stat().st_size
        query = urlencode({"path": remote, "username": user})
        headers = [("Host", "envd"), ("X-Access-Token", self.token),
                   ("Content-Type", "application/octet-stream"), ("Content-Length", str(size))]
        try:
            resp = await self.pool.request("POST", f"{self.base}/files?{query}", headers=headers,
                                           content=body())
        except httpcore.NetworkError as exc:
            raise AenvError(ErrorCode.UNAVAILABLE, f"upload to the sandbox failed: {exc}") from None
        if resp.status >= 300:
            raise AenvError(ErrorCode.INTERNAL, f"upload to the sandbox failed ({resp.status}): "
                            f"{resp.content[:300].decode(errors='replace')}")
