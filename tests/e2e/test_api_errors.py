"""Error paths of the control plane and of the sandbox proxy, on the wire (httpx) and through
the official SDK. Every error must be JSON `{"code": <int>, "message": <str>}`, and a failed
create must not leave a sandbox behind."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import (
    AuthenticationException,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxQuery,
)
from e2e_helpers import assert_json_error, live_sandbox_ids

from aenv.devserver import ServerProcess

UNKNOWN_ID = "zzzzzzzzzzzzzzzzzzzz"


def sdk_count() -> int:
    paginator = Sandbox.list()
    n = 0
    while paginator.has_next:
        n += len(paginator.next_items())
    return n


@pytest.fixture(scope="module")
def sbx() -> Iterator[Sandbox]:
    s = Sandbox.create(metadata={"suite": "e2e-api-errors"}, timeout=600)
    try:
        yield s
    finally:
        s.kill()


@pytest.fixture(scope="module")
def token(sbx: Sandbox, server: ServerProcess) -> str:
    detail = httpx.get(f"{server.url}/sandboxes/{sbx.sandbox_id}",
                       headers={"X-API-Key": server.api_key}).json()
    tok = detail.get("envdAccessToken")
    assert tok, detail
    return str(tok)


def envd_headers(sandbox_id: str, token: str | None) -> dict[str, str]:
    headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983"}
    if token is not None:
        headers["X-Access-Token"] = token
    return headers


# ------------------------------------------------------------------ create failures


def test_unknown_template(api: httpx.Client) -> None:
    before = live_sandbox_ids(api)
    count = sdk_count()
    resp = api.post("/v2/sandboxes", json={"templateID": "no-such-template-e2e",
                                           "metadata": {}, "envVars": {}})
    body = assert_json_error(resp, 404)
    assert "no-such-template-e2e" in body["message"]
    with pytest.raises(SandboxException) as exc_info:
        Sandbox.create("no-such-template-e2e")
    assert exc_info.value.status_code == 404  # type: ignore[attr-defined]
    assert "404" in str(exc_info.value)
    assert live_sandbox_ids(api) == before
    assert sdk_count() == count


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'"base"', b"",
                                     b'{"templateID": 5}', b'{"metadata": {}}',
                                     b'{"templateID": "base", "metadata": {"k": 1}}',
                                     b'{"templateID": "base", "envVars": ["A=1"]}',
                                     b'{"templateID": "base", "timeout": "soon"}',
                                     b"\xff\xfe"])
def test_malformed_create_body(api: httpx.Client, content: bytes) -> None:
    before = live_sandbox_ids(api)
    resp = api.post("/v2/sandboxes", content=content, headers={"Content-Type": "application/json"})
    assert_json_error(resp, 400)
    assert live_sandbox_ids(api) == before


@pytest.mark.parametrize("timeout", [-5, 0, 10 ** 9])
def test_bad_timeout_on_create(api: httpx.Client, timeout: int) -> None:
    before = live_sandbox_ids(api)
    resp = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": timeout})
    assert_json_error(resp, 400)
    assert live_sandbox_ids(api) == before


def test_negative_timeout_via_sdk(api: httpx.Client) -> None:
    count = sdk_count()
    with pytest.raises(SandboxException) as exc_info:
        Sandbox.create(timeout=-1)
    assert exc_info.value.status_code == 400  # type: ignore[attr-defined]
    assert sdk_count() == count


def test_runtime_per_sandbox(api: httpx.Client) -> None:
    """A sandbox's runtime is chosen at create (field `runtime`, or metadata `aenv.runtime`
    from the SDK); an unknown one is a 400 naming the available ones, with nothing created."""
    before = live_sandbox_ids(api)
    resp = api.post("/v2/sandboxes", json={"templateID": "base", "runtime": "nosuch"})
    body = assert_json_error(resp, 400)
    assert "nosuch" in body["message"] and "container" in body["message"]
    with pytest.raises(SandboxException) as exc_info:
        Sandbox.create(metadata={"aenv.runtime": "nosuch"})
    assert exc_info.value.status_code == 400  # type: ignore[attr-defined]
    assert live_sandbox_ids(api) == before
    resp = api.post("/v2/sandboxes", json={"templateID": "base", "runtime": "container"})
    assert resp.status_code == 201, resp.text
    sandbox_id = resp.json()["sandboxID"]
    try:
        assert api.get(f"/sandboxes/{sandbox_id}").json()["runtime"] == "container"
    finally:
        api.delete(f"/sandboxes/{sandbox_id}")


# ------------------------------------------------------------------ authentication


@pytest.mark.parametrize("headers", [{}, {"X-API-Key": "wrong-key"}, {"X-API-Key": ""},
                                     {"Authorization": "Bearer aenv_test_key"}])
def test_bad_or_missing_api_key(raw_http: httpx.Client, api: httpx.Client,
                                headers: dict[str, str]) -> None:
    before = live_sandbox_ids(api)
    for method, path, body in [("GET", "/v2/sandboxes", None),
                               ("GET", "/sandboxes", None),
                               ("POST", "/v2/sandboxes", {"templateID": "base"}),
                               ("POST", "/sandboxes", {"templateID": "base"}),
                               ("GET", f"/sandboxes/{UNKNOWN_ID}", None),
                               ("DELETE", f"/sandboxes/{UNKNOWN_ID}", None)]:
        resp = raw_http.request(method, path, json=body, headers=headers)
        assert_json_error(resp, 401)
    assert live_sandbox_ids(api) == before


def test_health_needs_no_key(raw_http: httpx.Client) -> None:
    assert raw_http.get("/health").status_code == 204


def test_sdk_bad_api_key(api: httpx.Client) -> None:
    before = live_sandbox_ids(api)
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="definitely-wrong")
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="definitely-wrong").next_items()
    with pytest.raises(AuthenticationException):
        Sandbox.kill(UNKNOWN_ID, api_key="definitely-wrong")
    assert live_sandbox_ids(api) == before


# ------------------------------------------------------------------ unknown sandbox


def test_unknown_sandbox_http(api: httpx.Client) -> None:
    assert_json_error(api.get(f"/sandboxes/{UNKNOWN_ID}"), 404)
    assert_json_error(api.delete(f"/sandboxes/{UNKNOWN_ID}"), 404)
    assert_json_error(api.post(f"/sandboxes/{UNKNOWN_ID}/timeout", json={"timeout": 30}), 404)
    assert_json_error(api.post(f"/v2/sandboxes/{UNKNOWN_ID}/connect", json={}), 404)
    assert_json_error(api.post(f"/sandboxes/{UNKNOWN_ID}/connect", json={"timeout": 30}), 404)
    assert_json_error(api.get(f"/sandboxes/{UNKNOWN_ID}/metrics"), 404)
    assert_json_error(api.post(f"/sandboxes/{UNKNOWN_ID}/pause", json={}), 404)


def test_unknown_sandbox_sdk() -> None:
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(UNKNOWN_ID)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.set_timeout(UNKNOWN_ID, 30)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(UNKNOWN_ID)
    assert Sandbox.kill(UNKNOWN_ID) is False


def test_unknown_sandbox_envd_traffic(raw_http: httpx.Client) -> None:
    """The proxy answers like E2B's edge, so the SDK raises its 'not running' errors."""
    resp = raw_http.get("/health", headers=envd_headers(UNKNOWN_ID, "x"))
    body = assert_json_error(resp, 502)
    assert "was not found" in body["message"]
    resp = raw_http.post("/process.Process/List", json={}, headers=envd_headers(UNKNOWN_ID, "x"))
    assert_json_error(resp, 502)


def test_other_bad_requests(api: httpx.Client, sbx: Sandbox) -> None:
    assert_json_error(api.get("/v2/no-such-route"), 404)
    assert_json_error(api.put("/v2/sandboxes", json={}), 405)
    assert_json_error(api.get("/v2/sandboxes", params={"limit": "abc"}), 400)
    assert_json_error(api.get("/v2/sandboxes", params={"limit": "0"}), 400)
    assert_json_error(api.get("/v2/sandboxes", params={"state": "exploded"}), 400)
    assert_json_error(api.get("/v2/sandboxes", params={"nextToken": "garbage!"}), 400)
    assert_json_error(api.get("/v2/sandboxes", params={"order": "sideways"}), 400)
    sid = sbx.sandbox_id
    assert_json_error(api.post(f"/sandboxes/{sid}/timeout", json={"timeout": -1}), 400)
    assert_json_error(api.post(f"/sandboxes/{sid}/timeout", json={}), 400)
    assert_json_error(api.post(f"/sandboxes/{sid}/timeout", content=b"{oops",
                               headers={"Content-Type": "application/json"}), 400)
    # none of that hurt the sandbox
    assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
    assert sbx.commands.run("echo fine").stdout == "fine\n"


# ------------------------------------------------------------------ envd access token


def test_envd_requires_the_sandbox_token(raw_http: httpx.Client, api: httpx.Client,
                                         sbx: Sandbox, token: str) -> None:
    sid = sbx.sandbox_id
    rpc_headers = {"Content-Type": "application/json", "Connect-Protocol-Version": "1"}
    # positive control: the right token works
    ok = raw_http.post("/process.Process/List", json={},
                       headers={**envd_headers(sid, token), **rpc_headers})
    assert ok.status_code == 200, ok.text
    assert "processes" in ok.json() or ok.json() == {}

    for bad in ("wrong-token", None, token + "x"):
        resp = raw_http.post("/process.Process/List", json={},
                             headers={**envd_headers(sid, bad), **rpc_headers})
        assert resp.status_code == 401, resp.text
        assert resp.headers["content-type"].startswith("application/json")
        resp = raw_http.get("/files", params={"path": "/etc/hostname"},
                            headers=envd_headers(sid, bad))
        assert resp.status_code == 401, resp.text
        resp = raw_http.post("/files", params={"path": "/home/user/forged.txt"},
                             files={"file": ("forged.txt", b"x")}, headers=envd_headers(sid, bad))
        assert resp.status_code == 401, resp.text
    assert sbx.files.exists("/home/user/forged.txt") is False

    # a bad signature is no better than a bad token
    resp = raw_http.get("/files", params={"path": "/etc/hostname", "signature": "v1_bogus"},
                        headers=envd_headers(sid, None))
    assert resp.status_code == 401, resp.text
    # another sandbox's token does not open this one
    other = Sandbox.create(metadata={"suite": "e2e-api-errors", "kind": "other"}, timeout=120)
    try:
        other_token = api.get(f"/sandboxes/{other.sandbox_id}").json()["envdAccessToken"]
        assert other_token != token
        resp = raw_http.get("/files", params={"path": "/etc/hostname"},
                            headers=envd_headers(sid, other_token))
        assert resp.status_code == 401, resp.text
    finally:
        other.kill()


def test_rejected_uploads_always_get_their_401(raw_http: httpx.Client, sbx: Sandbox) -> None:
    """An upload refused before its body is read must still deliver the whole 401 answer
    (through the proxy) every time, not a reset or truncated response."""
    failures: list[str] = []
    for i in range(40):
        try:
            resp = raw_http.post("/files", params={"path": f"/home/user/rejected-{i}.txt"},
                                 files={"file": ("r.txt", b"x" * (i * 50))},
                                 headers=envd_headers(sbx.sandbox_id, "wrong-token"))
            if resp.status_code != 401 or resp.json().get("code") != 401:
                failures.append(f"{i}: {resp.status_code} {resp.text[:80]}")
        except httpx.HTTPError as exc:
            failures.append(f"{i}: {type(exc).__name__}: {exc}")
    assert not failures, f"{len(failures)}/40 rejected uploads broke: {failures[:5]}"


# ------------------------------------------------------------------ path traversal


def test_files_path_traversal_stays_inside(raw_http: httpx.Client, sbx: Sandbox,
                                           token: str) -> None:
    name = f"aenv-e2e-trav-{uuid.uuid4().hex[:10]}"
    host_file = Path("/tmp") / name
    host_file.write_text("HOST")
    try:
        sbx.commands.run(f"echo -n SANDBOX > /tmp/{name}")
        sandbox_hostname_file = sbx.commands.run("cat /etc/hostname").stdout
        for path in (f"/../../../tmp/{name}", f"../../../../../../tmp/{name}",
                     f"/home/user/../../../../tmp/{name}", f"/tmp/./../tmp//{name}"):
            assert sbx.files.read(path) == "SANDBOX", path
            resp = raw_http.get("/files", params={"path": path},
                                headers=envd_headers(sbx.sandbox_id, token))
            assert resp.status_code == 200 and resp.content == b"SANDBOX", (path, resp.text)
        assert sbx.files.read("/../../../etc/hostname") == sandbox_hostname_file
        root_names = {e.name for e in sbx.files.list("/")}
        assert {"etc", "home", "tmp"} <= root_names
        assert {e.name for e in sbx.files.list("/../../..")} == root_names

        # writes with traversal land inside the sandbox too
        sbx.files.write(f"/../../../tmp/{name}-w", "written")
        assert not (Path("/tmp") / f"{name}-w").exists()
        assert sbx.commands.run(f"cat /tmp/{name}-w").stdout == "written"
        assert host_file.read_text() == "HOST"
    finally:
        host_file.unlink(missing_ok=True)
        (Path("/tmp") / f"{name}-w").unlink(missing_ok=True)


def test_list_after_failures_is_consistent(api: httpx.Client) -> None:
    """After all the failed creates above, the SDK's and the wire's counts agree."""
    assert sdk_count() == len(live_sandbox_ids(api))
    assert not Sandbox.list(query=SandboxQuery(metadata={"e2e-never": "created"})).next_items()


def test_not_found_is_not_found_exception() -> None:
    # SandboxNotFoundException is the SDK's NotFound family
    with pytest.raises(NotFoundException):
        Sandbox.get_info(UNKNOWN_ID)
