"""The sandbox proxy's HTTP/1.1 framing on the wire, as strict clients (undici, the JS SDK's
fetch) read it: one Content-Length, one Date, `Expect: 100-continue`, bodiless answers
(HEAD, 304) that carry a length, and upstream connections that must not be reused.

Each test reads raw bytes from a socket (httpx would forgive most of these) and, where a
broken answer would only show on the next request, sends that next request on the same
client connection. The sandbox runs tests/data/echo_server.py for the non-envd answers.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import httpx
import pytest
from e2b import Sandbox
from e2e_helpers import wait_until

from aenv.devserver import ServerProcess

PORT = 8765
SERVER = Path(__file__).resolve().parent.parent / "data" / "echo_server.py"


@pytest.fixture(scope="module")
def sbx() -> Iterator[Sandbox]:
    s = Sandbox.create(metadata={"suite": "e2e-proxy-wire"}, timeout=600)
    try:
        s.files.write("/home/user/server.py", SERVER.read_text())
        s.commands.run(f"python3 /home/user/server.py {PORT}", background=True)
        yield s
    finally:
        s.kill()


@pytest.fixture(scope="module")
def token(sbx: Sandbox, api: httpx.Client) -> str:
    return str(api.get(f"/sandboxes/{sbx.sandbox_id}").json()["envdAccessToken"])


@pytest.fixture(scope="module")
def port_ready(sbx: Sandbox, server: ServerProcess) -> None:
    wait_until(lambda: httpx.get(f"{server.url}/stats", headers=_route(sbx, PORT)).status_code == 200,
               20, what="the sandbox's test server")


def _route(sbx: Sandbox, port: int) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(port)}


class Raw:
    """One client connection to the server; requests and answers as bytes."""

    def __init__(self, server: ServerProcess) -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=20)
        self.file: BinaryIO = self.sock.makefile("rb")

    def send(self, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> None:
        lines = [f"{method} {path} HTTP/1.1", "Host: aenv-test"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)

    def head(self) -> tuple[int, list[tuple[str, str]]]:
        status_line = self.file.readline()
        assert status_line.startswith(b"HTTP/1.1 "), status_line
        headers = []
        while (line := self.file.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers.append((name.strip().lower(), value.strip()))
        return int(status_line.split()[1]), headers

    def response(self, method: str = "GET") -> tuple[int, list[tuple[str, str]], bytes]:
        """A whole answer, framed strictly: a length must be the one length."""
        status, headers = self.head()
        lengths = [v for k, v in headers if k == "content-length"]
        assert len(lengths) <= 1, f"{len(lengths)} Content-Length fields: {headers}"
        chunked = any(k == "transfer-encoding" for k, _ in headers)
        assert not (chunked and lengths), headers
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            return status, headers, b""
        if chunked:
            body = b""
            while (size := int(self.file.readline().split(b";")[0], 16)) > 0:
                body += self.file.read(size)
                assert self.file.read(2) == b"\r\n"
            assert self.file.readline() == b"\r\n"
            return status, headers, body
        assert lengths, f"a keep-alive answer without framing: {headers}"
        return status, headers, self.file.read(int(lengths[0]))

    def close(self) -> None:
        self.file.close()
        self.sock.close()


@pytest.fixture
def raw(server: ServerProcess) -> Iterator[Raw]:
    conn = Raw(server)
    yield conn
    conn.close()


def _multipart(content: bytes) -> tuple[str, bytes]:
    boundary = "aenvwireboundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n").encode() + content + \
        f"\r\n--{boundary}--\r\n".encode()
    return f"multipart/form-data; boundary={boundary}", body


def test_envd_answers_carry_one_content_length(raw: Raw, sbx: Sandbox, token: str) -> None:
    """The JS SDK's files.write failed with UND_ERR_RES_CONTENT_LENGTH_MISMATCH: the proxy
    sent `content-length: 52` twice."""
    envd = {**_route(sbx, 49983), "X-Access-Token": token}
    ctype, body = _multipart(b"one length only")
    raw.send("POST", "/files?path=/home/user/wire.txt&username=user",
             {**envd, "Content-Type": ctype, "Content-Length": str(len(body))}, body)
    status, headers, answer = raw.response()
    assert status == 200, answer
    assert [v for k, v in headers if k == "content-length"] == [str(len(answer))]
    assert b"/home/user/wire.txt" in answer
    # the same client connection goes on: a read, then an envd 204
    raw.send("GET", "/files?path=/home/user/wire.txt&username=user", envd)
    assert raw.response()[2] == b"one length only"
    raw.send("GET", "/health", envd)
    status, headers, _ = raw.response()
    assert status == 204 and not any(k == "content-length" for k, _ in headers)


def test_head_on_a_signed_download_url(server: ServerProcess, sbx: Sandbox) -> None:
    """fetch(url, {method: 'HEAD'}) on `downloadUrl()`: the signature is a read's, as for GET
    (it was checked as a write's, so the request fell through to the control plane's 401)."""
    sbx.files.write("/home/user/signed-head.txt", "0123456789")
    url = sbx.download_url("/home/user/signed-head.txt")
    head = httpx.head(url, timeout=20)
    assert head.status_code == 200, head.text
    assert head.headers["content-length"] == "10"
    assert httpx.get(url, timeout=20).text == "0123456789"
    # Still a read that needs a signature or the token: none of them, no access.
    unsigned = httpx.head(f"{server.url}/files", params={"path": "/home/user/signed-head.txt"},
                          headers=_route(sbx, 49983), timeout=20)
    assert unsigned.status_code == 401
    forged = httpx.head(url[:-4] + "AAAA", headers=_route(sbx, 49983), timeout=20)
    assert forged.status_code == 401


def test_one_date_and_no_proxy_server_header(raw: Raw, sbx: Sandbox, port_ready: None) -> None:
    raw.send("GET", "/sized", _route(sbx, PORT))
    _, headers, _ = raw.response()
    assert len([v for k, v in headers if k == "date"]) == 1, headers
    assert ("server", "uvicorn") not in headers


def test_expect_100_continue_upload(raw: Raw, sbx: Sandbox, token: str) -> None:
    """curl sends `Expect: 100-continue` for large uploads: uvicorn answers it, and envd must
    not be asked again (its interim 100 was relayed as the final answer, and the real one
    was then read as the next request's)."""
    envd = {**_route(sbx, 49983), "X-Access-Token": token}
    ctype, body = _multipart(b"y" * 5000)
    raw.send("POST", "/files?path=/home/user/expect.bin&username=user",
             {**envd, "Content-Type": ctype, "Content-Length": str(len(body)),
              "Expect": "100-continue"})
    status, _ = raw.head()
    assert status == 100
    raw.sock.sendall(body)
    status, headers, answer = raw.response()
    assert status == 200, (status, headers, answer)
    assert b"/home/user/expect.bin" in answer
    raw.send("GET", "/health", envd)
    assert raw.response()[0] == 204
    assert sbx.files.read("/home/user/expect.bin") == "y" * 5000


def test_304_that_states_a_length(raw: Raw, sbx: Sandbox, port_ready: None) -> None:
    """A 304 may carry the representation's Content-Length; relayed as is, uvicorn waited for
    a body that never comes and broke the client connection."""
    raw.send("GET", "/304-with-length", {**_route(sbx, PORT), "If-None-Match": '"v1"'})
    status, headers, _ = raw.response()
    assert status == 304
    assert ("etag", '"v1"') in headers
    raw.send("GET", "/sized", _route(sbx, PORT))
    status, _, body = raw.response()
    assert (status, body) == (200, b"x" * 100)


def test_head_keeps_the_length_and_the_connection(raw: Raw, sbx: Sandbox, port_ready: None) -> None:
    raw.send("HEAD", "/sized", _route(sbx, PORT))
    status, headers, _ = raw.response("HEAD")
    assert status == 200
    assert [v for k, v in headers if k == "content-length"] == ["100"]
    raw.send("GET", "/sized", _route(sbx, PORT))
    status, _, body = raw.response()
    assert (status, body) == (200, b"x" * 100)


def test_http10_answer_is_not_reused(server: ServerProcess, sbx: Sandbox, port_ready: None) -> None:
    """An HTTP/1.0 answer without keep-alive ends its connection even before the server
    closes it: pooled and reused, the next request went unanswered (a 502)."""
    with httpx.Client(base_url=server.url, headers=_route(sbx, PORT), timeout=20) as http:
        for _ in range(3):
            first = http.get("/http10")
            assert (first.status_code, first.text) == (200, "http10")
            started = time.monotonic()
            second = http.get("/sized")
            assert second.status_code == 200, second.text
            assert time.monotonic() - started < 0.9  # not after the 1 s the server lingers
