from typing import Any
from urllib.parse import quote, urlencode

from aenv.api.proxy import Target, file_signature, route_by_headers, route_by_signature


def _scope(path: str = "/", query: bytes = b"", method: str = "GET", **headers: str) -> dict[str, Any]:
    return {"type": "http", "path": path, "query_string": query, "method": method,
            "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}


def test_header_and_host_routing() -> None:
    assert route_by_headers(_scope(e2b_sandbox_id="abc", e2b_sandbox_port="49999"), None) == Target("abc", 49999)
    assert route_by_headers(_scope(e2b_sandbox_id="abc"), None) == Target("abc", 49983)
    assert route_by_headers(_scope(host="8080-abc123.sbx.local:8000"), "sbx.local") == Target("abc123", 8080)
    assert route_by_headers(_scope(host="8080-abc123.other.local"), "sbx.local") is None
    assert route_by_headers(_scope(host="127.0.0.1:8000"), "sbx.local") is None


def test_signed_files_url_finds_its_sandbox() -> None:
    tokens = [("s1", "tok1"), ("s2", "tok2")]
    sig = file_signature("/home/user/a.txt", "read", "", "tok2", None)
    q = urlencode({"path": "/home/user/a.txt", "signature": sig}, quote_via=quote).encode()
    assert route_by_signature(_scope("/files", q), lambda: tokens) == Target("s2", 49983)
    # the same signature does not authorise a write, nor another path
    assert route_by_signature(_scope("/files", q, method="POST"), lambda: tokens) is None
    q2 = urlencode({"path": "/etc/passwd", "signature": sig}, quote_via=quote).encode()
    assert route_by_signature(_scope("/files", q2), lambda: tokens) is None
