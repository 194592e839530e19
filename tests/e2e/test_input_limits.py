"""Hostile request bodies and queries against the control plane: each gets a `{code, message}`
4xx (never a 500, never a reset keep-alive connection), oversized bodies are refused while they
stream in, and `/openapi.json` describes exactly the routes the server serves. Ends with a
property-based fuzz (hypothesis) of every documented operation: 0 server errors."""

from __future__ import annotations

import json
import select
import socket
import string
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import pytest
from e2e_helpers import assert_json_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aenv.api.images import ImageRoutes
from aenv.api.routes import SandboxRoutes
from aenv.api.templates import TemplateRoutes
from aenv.api.volumes import VolumeRoutes
from aenv.devserver import ServerProcess

UNKNOWN_ID = "zzzzzzzzzzzzzzzzzzzz"


@pytest.fixture
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"X-API-Key": server.api_key},
                      timeout=60) as c:
        yield c


def peak_rss(server: ServerProcess) -> int:
    """The server's resident-memory high-water mark (VmHWM), bytes."""
    assert server.proc is not None
    status = open(f"/proc/{server.proc.pid}/status").read()  # noqa: SIM115
    return int(next(line.split()[1] for line in status.splitlines()
                    if line.startswith("VmHWM:"))) * 1024


def local_port(response: httpx.Response) -> int:
    """The client-side port of the connection that carried `response`."""
    stream = response.extensions["network_stream"]
    return int(stream.get_extra_info("client_addr")[1])


def assert_4xx_then_reused(client: httpx.Client, response: httpx.Response, status: int) -> None:
    """`response` is a JSON error with `status`, and its keep-alive connection still serves."""
    assert_json_error(response, status)
    follow = client.get("/v2/sandboxes")
    assert follow.status_code == 200, follow.text
    assert local_port(follow) == local_port(response), "the connection was not reused"


def post_raw(client: httpx.Client, path: str, raw: bytes | str) -> httpx.Response:
    return client.post(path, content=raw, headers={"Content-Type": "application/json"})


def test_deep_nesting_is_400_and_the_connection_survives(client: httpx.Client) -> None:
    deep = '{"templateID": "base", "metadata": ' + "[" * 100_000 + "]" * 100_000 + "}"
    assert_4xx_then_reused(client, post_raw(client, "/sandboxes", deep), 400)
    # Below Python's recursion limit but past ours: refused by the depth check, not pydantic.
    r = post_raw(client, "/sandboxes", '{"templateID": "base", "network": '
                 + '{"a": ' * 40 + "1" + "}" * 40 + "}")
    assert_4xx_then_reused(client, r, 400)
    assert "nested deeper" in r.json()["message"]


def test_huge_integer_is_400(client: httpx.Client) -> None:
    r = post_raw(client, "/sandboxes", '{"templateID": "base", "timeout": ' + "9" * 5000 + "}")
    assert_4xx_then_reused(client, r, 400)
    # 20 digits pass the parser; int32 bounds refuse it before it reaches a timedelta.
    r = post_raw(client, f"/sandboxes/{UNKNOWN_ID}/fork", '{"timeout": ' + "9" * 19 + "}")
    assert_4xx_then_reused(client, r, 400)
    r = post_raw(client, "/sandboxes", '{"templateID": "base", "timeout": NaN}')
    assert_4xx_then_reused(client, r, 400)


@pytest.mark.parametrize("path, body", [
    ("/sandboxes", {"templateID": "base", "timeout": True}),
    ("/sandboxes", {"templateID": "base", "timeout": "30"}),
    ("/sandboxes", {"templateID": "base", "timeout": 30.5}),
    ("/sandboxes", {"templateID": "base", "autoPause": "yes"}),
    ("/sandboxes", {"templateID": 7}),
    (f"/sandboxes/{UNKNOWN_ID}/fork", {"count": "3"}),
    (f"/sandboxes/{UNKNOWN_ID}/fork", {"count": True}),
    (f"/sandboxes/{UNKNOWN_ID}/timeout", {"timeout": True}),
])
def test_no_type_coercion(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    r = client.post(path, json=body)
    assert_4xx_then_reused(client, r, 400)
    assert "invalid request body" in r.json()["message"]


def test_well_typed_body_passes_validation(client: httpx.Client) -> None:
    """Positive control for the strict tests: the same bodies with proper types get past
    validation (to the sandbox lookup: 404)."""
    for path, body in ((f"/sandboxes/{UNKNOWN_ID}/fork", {"count": 3}),
                       (f"/sandboxes/{UNKNOWN_ID}/timeout", {"timeout": 30})):
        assert_json_error(client.post(path, json=body), 404)


@pytest.mark.parametrize("field, value", [
    ("metadata", {"k": "v" * 2000}),
    ("metadata", {f"k{i}": "v" for i in range(100)}),
    ("metadata", {"k" * 300: "v"}),
    ("envVars", {"K": "v" * 40_000}),
    ("envVars", {"": "v"}),
    ("metadata", {"k": 1}),
])
def test_metadata_and_env_limits(client: httpx.Client, field: str, value: Any) -> None:
    r = client.post("/sandboxes", json={"templateID": "base", field: value})
    assert_4xx_then_reused(client, r, 400)


def test_metadata_within_limits_passes_validation(client: httpx.Client) -> None:
    r = client.post("/sandboxes", json={"templateID": "no-such-template-h10",
                                        "metadata": {f"k{i}": "v" * 1000 for i in range(64)},
                                        "envVars": {"K": "v" * 32_000}})
    assert_json_error(r, 404)


def test_declared_oversized_body_is_413(client: httpx.Client, server: ServerProcess) -> None:
    rss_before = peak_rss(server)
    big = json.dumps({"templateID": "base", "metadata": {"k": "v" * (200 << 20)}})
    r = post_raw(client, "/sandboxes", big)
    assert_json_error(r, 413)
    assert "limit" in r.json()["message"]
    grown = peak_rss(server) - rss_before
    assert grown < 64 << 20, f"server peak grew by {grown >> 20} MiB for a refused body"
    assert client.get("/v2/sandboxes").status_code == 200


def test_chunked_oversized_body_is_413_without_reading_it_all(server: ServerProcess) -> None:
    """No Content-Length: the server counts as the chunks arrive and answers 413 long before
    the 200 MiB the client wants to send."""
    url = urlsplit(server.url)
    rss_before = peak_rss(server)
    sent = 0
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(f"POST /sandboxes HTTP/1.1\r\nHost: {url.netloc}\r\n"
                     f"X-API-Key: {server.api_key}\r\nContent-Type: application/json\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b'{"templateID": "base", "metadata": {"k": "' + b"v" * (1 << 20)
        try:
            while sent < 200 << 20 and not select.select([sock], [], [], 0)[0]:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
                chunk = b"v" * (1 << 20)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        while b"\r\n\r\n" not in answer:
            part = sock.recv(65536)
            if not part:
                break
            answer += part
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < 100 << 20, f"the client sent {sent >> 20} MiB before the refusal came"
    grown = peak_rss(server) - rss_before
    assert grown < 64 << 20, f"server peak grew by {grown >> 20} MiB for a refused body"


def test_bad_query_integers_are_400(client: httpx.Client) -> None:
    for query in ("limit=" + "9" * 5000, "limit=%C2%B2", "limit=-1"):
        assert_4xx_then_reused(client, client.get(f"/v2/sandboxes?{query}"), 400)
    for query in ("nextToken=" + "9" * 5000, "limit=%C2%B2"):
        assert_4xx_then_reused(client, client.get(f"/snapshots?{query}"), 400)
    assert client.get("/v2/sandboxes?limit=5").status_code == 200  # positive control


# ------------------------------------------------------------------------ OpenAPI


def served_operations() -> set[tuple[str, str]]:
    """(path, method) of every control-plane route, read from the route classes themselves
    (their `routes()` uses nothing of the instance but its bound handlers)."""
    ops = {("/health", "get"), ("/openapi.json", "get"), ("/metrics", "get")}
    for cls in (SandboxRoutes, ImageRoutes, TemplateRoutes, VolumeRoutes):
        for route in cls.routes(cls.__new__(cls)):  # type: ignore[arg-type]
            ops |= {(route.path, m.lower()) for m in route.methods or () if m != "HEAD"}
    return ops


@pytest.fixture(scope="module")
def openapi(server: ServerProcess) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/openapi.json")  # public: it describes, it reveals nothing
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = r.json()
    return doc


def test_openapi_lists_exactly_the_served_routes(openapi: dict[str, Any],
                                                 client: httpx.Client) -> None:
    documented = {(path, method) for path, ops in openapi["paths"].items() for method in ops}
    assert documented == served_operations()
    # ... and each documented operation is routed by the server (not the router's 404/405).
    for path, method in sorted(documented):
        if path.startswith("/aenv/templates/") or (path, method) == ("/aenv/images/pull", "post"):
            continue  # a real upload / a real pull
        url = path.replace("{", "fuzz-").replace("}", "")
        r = client.request(method, url, content=b"" if method != "get" else None)
        assert r.status_code != 405, (method, path, r.text)
        # The router's own 404 says "Not Found"; a handler's 404 names what it looked for.
        assert not (r.status_code == 404 and r.json()["message"] == "Not Found"), (method, path)


def test_openapi_bodies_are_the_parsers_models(openapi: dict[str, Any]) -> None:
    create = openapi["paths"]["/sandboxes"]["post"]["requestBody"]
    assert create["required"] is True
    schema = openapi["components"]["schemas"]["NewSandbox"]
    assert schema["required"] == ["templateID"]
    assert schema["properties"]["metadata"]["anyOf"][0]["maxProperties"] == 64
    fork = openapi["paths"]["/sandboxes/{sandbox_id}/fork"]["post"]
    assert fork["requestBody"]["required"] is False
    assert [p["name"] for p in fork["parameters"]] == ["sandbox_id"]
    listing = openapi["paths"]["/v2/sandboxes"]["get"]
    assert {p["name"] for p in listing["parameters"]} >= {"state", "limit", "nextToken"}


# ------------------------------------------------------------------------ fuzz

# Operations whose valid bodies have real side effects (a pull, a new template record, an
# upload): fuzzed elsewhere or not at all. Every path parameter is `fuzz-...`, so nothing the
# fuzz addresses exists and no sandbox is created, killed or changed.
NOT_FUZZED = {("/aenv/images/pull", "post"), ("/v3/templates", "post")}

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=4),
    max_leaves=20)
PATH_PART = st.text(alphabet=string.ascii_letters + string.digits + "-._~%: '\"<>", max_size=30)


def body_strategy(schema: dict[str, Any] | None) -> st.SearchStrategy[bytes]:
    """Objects with the schema's own field names (so validation goes deep) and any values,
    plus arbitrary JSON and arbitrary bytes."""
    names = list((schema or {}).get("properties", {})) or ["x"]
    shaped = st.dictionaries(st.sampled_from(names), JSON, max_size=len(names)).map(
        lambda d: json.dumps(d).encode())
    return st.one_of(shaped, JSON.map(lambda v: json.dumps(v).encode()),
                     st.binary(max_size=64), st.just(b""))


def fill_path_param(name: str) -> Callable[[tuple[str, str]], str]:
    def fill(parts: tuple[str, str]) -> str:
        return parts[0].replace("{" + name + "}", "fuzz-" + quote(parts[1], safe=""))
    return fill


def fuzz_cases(doc: dict[str, Any]) -> st.SearchStrategy[tuple[str, str, bytes, str]]:
    schemas = doc["components"]["schemas"]
    cases = []
    for path, ops in sorted(doc["paths"].items()):
        for method, op in sorted(ops.items()):
            if (path, method) in NOT_FUZZED or path.startswith("/aenv/templates/"):
                continue
            ref = op.get("requestBody", {}).get("content", {}).get(
                "application/json", {}).get("schema", {}).get("$ref", "")
            schema = schemas.get(ref.rsplit("/", 1)[-1]) if ref else None
            queries = [p["name"] for p in op.get("parameters", []) if p["in"] == "query"]
            path_s = st.just(path)
            for name in ("sandbox_id", "snapshot_id", "template_id", "build_id", "alias",
                         "files_hash"):
                if "{" + name + "}" in path:
                    path_s = st.tuples(path_s, PATH_PART).map(fill_path_param(name))
            query_s = (st.dictionaries(st.sampled_from(queries), st.text(max_size=30),
                                       max_size=len(queries)) if queries else st.just({}))
            cases.append(st.tuples(st.just(method), path_s,
                                   body_strategy(schema) if method != "get" else st.just(b""),
                                   query_s.map(lambda q: "&".join(
                                       f"{quote(k)}={quote(v, safe='')}" for k, v in q.items()))))
    return st.one_of(cases)


FUZZ_EXAMPLES = 2000


def run_fuzz(client: httpx.Client, doc: dict[str, Any], examples: int) -> dict[int, int]:
    statuses: dict[int, int] = {}

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(fuzz_cases(doc))
    def one(case: tuple[str, str, bytes, str]) -> None:
        method, path, body, query = case
        r = client.request(method, path + (f"?{query}" if query else ""), content=body or None,
                           headers={"Content-Type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (method, path, query, body[:200], r.text)
        if r.status_code >= 400:
            assert_json_error(r, r.status_code)

    one()
    return statuses


def test_fuzz_every_documented_operation(openapi: dict[str, Any], client: httpx.Client) -> None:
    statuses = run_fuzz(client, openapi, FUZZ_EXAMPLES)
    print(f"fuzz statuses over {FUZZ_EXAMPLES} examples: {sorted(statuses.items())}")
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) > 0  # the fuzz reached handlers


@pytest.mark.slow
def test_fuzz_long(openapi: dict[str, Any], client: httpx.Client) -> None:
    statuses = run_fuzz(client, openapi, 20_000)
    print(f"fuzz statuses over 20000 examples: {sorted(statuses.items())}")
