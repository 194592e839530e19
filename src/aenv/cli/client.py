"""A small client for the control plane and for envd (through the server's proxy)."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from aenv.connect_frames import Frames, envelope

DEFAULT_URL = "http://127.0.0.1:8000"


def credentials_file() -> Path:
    base = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config"))
    return base / "aenv" / "credentials.json"


def save_credentials(url: str, api_key: str) -> Path:
    path = credentials_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "api_key": api_key}, f)
    os.replace(tmp, path)
    return path


def load_credentials() -> dict[str, str]:
    try:
        data = json.loads(credentials_file().read_text())
        return {k: str(v) for k, v in data.items()}
    except (OSError, ValueError):
        return {}


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


@dataclass
class Client:
    url: str
    api_key: str | None
    timeout: float = 60.0

    @classmethod
    def from_env(cls, url: str | None = None, api_key: str | None = None) -> Client:
        creds = load_credentials()
        return cls(
            url=(url or os.environ.get("AENV_URL") or creds.get("url") or DEFAULT_URL).rstrip("/"),
            api_key=api_key or os.environ.get("AENV_API_KEY") or creds.get("api_key"),
        )

    def _http(self) -> httpx.Client:
        headers = {"X-API-Key": self.api_key} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=self.timeout)

    def call(self, method: str, path: str, body: Any = None, expect: int | None = None
             ) -> httpx.Response:
        try:
            with self._http() as http:
                resp = http.request(method, path, json=body)
        except httpx.ConnectError:
            raise ApiError(0, f"cannot reach the aenv server at {self.url} "
                              "(start it with `aenv serve`, or set --url / AENV_URL)") from None
        if resp.status_code >= 400:
            try:
                message = str(resp.json().get("message", resp.text))
            except ValueError:
                message = resp.text
            raise ApiError(resp.status_code, message)
        return resp

    def stream_lines(self, method: str, path: str, body: Any = None) -> Iterator[dict[str, Any]]:
        """A request whose answer is NDJSON (e.g. pull progress): yields each object."""
        try:
            with self._http() as http, http.stream(method, path, json=body,
                                                   timeout=httpx.Timeout(self.timeout, read=None)
                                                   ) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    try:
                        message = str(resp.json().get("message", resp.text))
                    except ValueError:
                        message = resp.text
                    raise ApiError(resp.status_code, message)
                for line in resp.iter_lines():
                    if line.strip():
                        yield json.loads(line)
        except httpx.ConnectError:
            raise ApiError(0, f"cannot reach the aenv server at {self.url} "
                              "(start it with `aenv serve`, or set --url / AENV_URL)") from None
        except httpx.HTTPError as exc:
            raise ApiError(0, f"connection to the aenv server lost: {exc}") from None

    # ------------------------------------------------------------------ envd via the proxy
    def _envd_headers(self, sandbox_id: str, token: str | None, user: str | None = None
                      ) -> dict[str, str]:
        headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983"}
        if token:
            headers["X-Access-Token"] = token
        if user:
            headers["Authorization"] = "Basic " + b64(f"{user}:".encode())
        return headers

    def rpc(self, sandbox_id: str, token: str | None, method: str, message: dict[str, Any]
            ) -> dict[str, Any]:
        headers = {**self._envd_headers(sandbox_id, token), "Content-Type": "application/json",
                   "Connect-Protocol-Version": "1"}
        with httpx.Client(base_url=self.url, timeout=self.timeout) as http:
            resp = http.post(f"/{method}", content=json.dumps(message), headers=headers)
        if resp.status_code != 200:
            raise ApiError(resp.status_code, resp.text)
        result: dict[str, Any] = resp.json()
        return result

    def stream(self, sandbox_id: str, token: str | None, method: str, message: dict[str, Any],
               timeout_ms: int | None = None, user: str | None = None
               ) -> Iterator[dict[str, Any]]:
        """Server-streaming Connect call: yields each message, raises on an error trailer."""
        headers = {**self._envd_headers(sandbox_id, token, user),
                   "Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}
        if timeout_ms:
            headers["Connect-Timeout-Ms"] = str(timeout_ms)
        with httpx.Client(base_url=self.url, timeout=None) as http, \
                http.stream("POST", f"/{method}", content=envelope(message), headers=headers) as resp:
                if resp.status_code != 200:
                    raise ApiError(resp.status_code, resp.read().decode(errors="replace"))
                frames = Frames()
                for chunk in resp.iter_bytes():
                    for end, msg in frames.feed(chunk):
                        if end:
                            if msg.get("error"):
                                err = msg["error"]
                                raise ApiError(0, f"{err.get('code')}: {err.get('message')}")
                            return
                        yield msg


    # ------------------------------------------------------------------ envd's /files
    def upload_file(self, sandbox_id: str, token: str | None, remote: str,
                    chunks: Iterator[bytes], size: int, user: str | None = None) -> None:
        """Stream `chunks` (`size` bytes in all) into the sandbox's file `remote`."""
        headers = {**self._envd_headers(sandbox_id, token),
                   "Content-Type": "application/octet-stream", "Content-Length": str(size)}
        params = {"path": remote, **({"username": user} if user else {})}
        try:
            with httpx.Client(base_url=self.url, timeout=httpx.Timeout(self.timeout, write=None)
                              ) as http:
                resp = http.post("/files", params=params, content=chunks, headers=headers)
        except httpx.ConnectError:
            raise ApiError(0, f"cannot reach the aenv server at {self.url}") from None
        except httpx.HTTPError as exc:
            raise ApiError(0, f"upload to {remote} failed: {exc}") from None
        if resp.status_code >= 300:
            raise ApiError(resp.status_code, f"{remote}: {_envd_message(resp)}")

    def download_file(self, sandbox_id: str, token: str | None, remote: str,
                      user: str | None = None) -> Iterator[tuple[bytes, int | None]]:
        """The sandbox's file `remote` in chunks, each with the whole length when known."""
        # identity: envd would gzip on the fly otherwise, and the length would be unknown.
        headers = {**self._envd_headers(sandbox_id, token), "Accept-Encoding": "identity"}
        params = {"path": remote, **({"username": user} if user else {})}
        try:
            with httpx.Client(base_url=self.url, timeout=httpx.Timeout(self.timeout)) as http, \
                    http.stream("GET", "/files", params=params, headers=headers) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise ApiError(resp.status_code, f"{remote}: {_envd_message(resp)}")
                length = resp.headers.get("content-length")
                total = int(length) if length and length.isdigit() else None
                for chunk in resp.iter_raw(1 << 20):
                    yield chunk, total
        except httpx.ConnectError:
            raise ApiError(0, f"cannot reach the aenv server at {self.url}") from None
        except httpx.HTTPError as exc:
            raise ApiError(0, f"download of {remote} failed: {exc}") from None


def _envd_message(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("message", resp.text))
    except ValueError:
        return resp.text.strip()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
