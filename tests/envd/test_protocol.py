"""The wire below the SDK: Connect framing, keepalives, deadlines, proto3 JSON leniency,
auth answers, plain-HTTP endpoints, /init, HTTP/1.1 details and concurrency."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import AsyncSandbox, AuthenticationException
from envd_helpers import Envd, envelope, make_sandbox, parse_envelopes, start_envd


def stream_call(envd: Envd, path: str, message: dict[str, object], headers: dict[str, str] | None = None,
                timeout: float = 30) -> tuple[httpx.Response, list[tuple[int, dict[str, object]]]]:
    def body() -> Iterator[bytes]:  # a generator makes httpx send it chunked, like the SDK
        yield envelope(message)

    response = httpx.post(
        envd.url + path,
        content=body(),
        headers={**envd.headers(), "Content-Type": "application/connect+json", **(headers or {})},
        timeout=timeout,
    )
    return response, parse_envelopes(response.content)


def unary_call(envd: Envd, path: str, message: object, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        envd.url + path,
        content=json.dumps(message),
        headers={**envd.headers(), "Content-Type": "application/json", **(headers or {})},
    )


def test_stream_framing_and_keepalive(envd: Envd) -> None:
    response, frames = stream_call(
        envd,
        "/process.Process/Start",
        {"process": {"cmd": "/bin/sh", "args": ["-c", "printf hi; sleep 1.3"]}, "stdin": False},
        {"Keepalive-Ping-Interval": "1"},
    )
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/connect+json"
    kinds = [next(iter(f[1].get("event", {"<eos>": 0}))) for f in frames]
    assert kinds[0] == "start" and kinds[-2] == "end" and kinds[-1] == "<eos>"
    assert "keepalive" in kinds
    assert frames[-1] == (2, {})
    data = [f[1]["event"]["data"]["stdout"] for f in frames if "data" in f[1].get("event", {})]
    assert base64.b64decode("".join(data)) == b"hi"
    assert frames[-2][1]["event"]["end"] == {"exitCode": 0, "exited": True, "status": "exit status 0"}


def test_start_deadline_ends_with_deadline_exceeded(envd: Envd) -> None:
    started = time.monotonic()
    _, frames = stream_call(
        envd, "/process.Process/Start", {"process": {"cmd": "sleep", "args": ["5"]}}, {"Connect-Timeout-Ms": "300"}
    )
    assert time.monotonic() - started < 2
    assert frames[0][1]["event"]["start"]["pid"] > 0
    flags, end = frames[-1]
    assert flags == 2 and end["error"]["code"] == "deadline_exceeded"  # type: ignore[index]


def test_proto_json_leniency(envd: Envd, work: Path) -> None:
    (work / "f.txt").write_text("12345")
    stat = unary_call(envd, "/filesystem.Filesystem/Stat", {"path": f"{work}/f.txt"})
    assert stat.status_code == 200 and stat.headers["content-type"] == "application/json"
    assert stat.json()["entry"]["size"] == "5"  # int64 as a string
    assert stat.json()["entry"]["type"] == "FILE_TYPE_FILE"  # enums by name
    listed = unary_call(envd, "/filesystem.Filesystem/ListDir", {"path": str(work), "depth": "1"})
    assert [e["name"] for e in listed.json()["entries"]] == ["f.txt"]
    watcher = unary_call(envd, "/filesystem.Filesystem/CreateWatcher", {"path": str(work)}).json()["watcherId"]
    assert unary_call(envd, "/filesystem.Filesystem/GetWatcherEvents", {"watcher_id": watcher}).status_code == 200
    assert unary_call(envd, "/filesystem.Filesystem/RemoveWatcher", {"watcherId": watcher}).json() == {}


def test_signal_with_numeric_enum_and_string_pid(envd: Envd) -> None:
    sbx = make_sandbox(envd)
    handle = sbx.commands.run("sleep 5", background=True)
    reply = unary_call(envd, "/process.Process/SendSignal", {"process": {"pid": str(handle.pid)}, "signal": 9})
    assert reply.status_code == 200 and reply.json() == {}
    with pytest.raises(Exception, match="-1"):
        handle.wait()
    bad = unary_call(envd, "/process.Process/SendSignal", {"process": {"pid": 1}, "signal": "SIGNAL_SIGHUP"})
    assert bad.json()["code"] in ("not_found", "invalid_argument")


def test_connect_errors_are_json(envd: Envd, work: Path) -> None:
    missing = unary_call(envd, "/filesystem.Filesystem/Stat", {"path": f"{work}/missing"})
    assert missing.status_code == 404 and missing.json()["code"] == "not_found"
    exists = unary_call(envd, "/filesystem.Filesystem/MakeDir", {"path": str(work)})
    assert exists.status_code == 409 and exists.json()["code"] == "already_exists"
    malformed = httpx.post(envd.url + "/filesystem.Filesystem/Stat", content=b"{not json",
                           headers={**envd.headers(), "Content-Type": "application/json"})
    assert malformed.status_code == 400 and malformed.json()["code"] == "invalid_argument"
    wrong_type = unary_call(envd, "/filesystem.Filesystem/Stat", {"path": 5})
    assert wrong_type.json()["code"] == "invalid_argument"
    unknown = unary_call(envd, "/filesystem.Filesystem/Nope", {})
    assert unknown.status_code == 404 and unknown.json()["code"] == "unimplemented"
    for response in (missing, exists, malformed, wrong_type):
        assert "Traceback" not in response.text


def test_auth_answers(envd: Envd) -> None:
    no_token = httpx.post(envd.url + "/process.Process/List", content="{}", headers={"Content-Type": "application/json"})
    assert no_token.status_code == 401
    assert no_token.json() == {
        "code": 401,
        "message": "unauthorized access, please provide a valid access token or method signing if supported",
    }
    with pytest.raises(AuthenticationException):
        make_sandbox(envd, token="bad").commands.run("true")
    basic = base64.b64encode(b"ghost:").decode()
    unknown_user = unary_call(envd, "/process.Process/List", {}, {"Authorization": f"Basic {basic}"})
    assert unknown_user.status_code == 401 and unknown_user.json()["code"] == "unauthenticated"
    root = base64.b64encode(b"root:").decode()
    assert unary_call(envd, "/process.Process/List", {}, {"Authorization": f"Basic {root}"}).status_code == 200


def test_plain_endpoints(envd: Envd) -> None:
    health = httpx.get(envd.url + "/health")
    assert health.status_code == 204 and health.content == b""
    assert httpx.get(envd.url + "/envs").status_code == 401
    envs = httpx.get(envd.url + "/envs", headers=envd.headers()).json()
    assert envs["AENV_SANDBOX_VAR"] == "sandbox"
    metrics = httpx.get(envd.url + "/metrics", headers=envd.headers()).json()
    for key in ("ts", "cpu_count", "cpu_used_pct", "mem_total", "mem_used", "mem_cache", "disk_used", "disk_total"):
        assert key in metrics
    assert metrics["cpu_count"] >= 1 and metrics["mem_total"] > 0 and metrics["disk_total"] > 0
    missing = httpx.get(envd.url + "/nope", headers=envd.headers())
    assert missing.status_code == 404 and missing.json()["code"] == 404


def test_keep_alive_and_query_decoding(envd: Envd, work: Path) -> None:
    (work / "a b+c.txt").write_text("spaced")
    with httpx.Client(base_url=envd.url, headers=envd.headers()) as client:
        for _ in range(5):
            assert client.get("/health").status_code == 204
        # httpx encodes a space as "+"; download_url uses %20 — both must work
        plus = client.get("/files", params={"path": f"{work}/a b+c.txt"})
        assert plus.text == "spaced"
        raw = client.get(f"/files?path={work}/a%20b%2Bc.txt")
        assert raw.text == "spaced"


def test_head_states_the_length_and_keeps_the_connection(envd: Envd, work: Path) -> None:
    (work / "sized.txt").write_text("0123456789")
    with httpx.Client(base_url=envd.url, headers=envd.headers()) as client:
        head = client.head("/files", params={"path": f"{work}/sized.txt"})
        assert head.status_code == 200
        assert head.headers["content-length"] == "10" and head.content == b""
        assert client.get("/files", params={"path": f"{work}/sized.txt"}).text == "0123456789"


def test_expect_continue_upload_with_curl(envd: Envd, work: Path) -> None:
    source = work / "source.bin"
    source.write_bytes(b"z" * (2 * 1024 * 1024))
    result = subprocess.run(
        ["curl", "-sS", "-X", "POST", "-H", f"X-Access-Token: {envd.token}", "-H", "Content-Type: application/octet-stream",
         "--data-binary", f"@{source}", f"{envd.url}/files?path={work}/copy.bin"],
        capture_output=True, text=True, timeout=20, check=True,
    )
    assert json.loads(result.stdout)[0]["path"] == f"{work}/copy.bin"
    assert (work / "copy.bin").stat().st_size == 2 * 1024 * 1024


async def test_many_concurrent_streams(asbx: AsyncSandbox) -> None:
    started = time.monotonic()
    results = await asyncio.gather(*(asbx.commands.run(f"sleep 1; echo {i}") for i in range(25)))
    assert sorted(int(r.stdout) for r in results) == list(range(25))
    assert time.monotonic() - started < 5


def test_init_sets_token_env_user_and_workdir(session_tmp: Path, test_user: object) -> None:
    envd = start_envd(session_tmp, token=None)
    try:
        open_sbx = make_sandbox(envd)
        assert open_sbx.commands.run("id -un").stdout.strip() == "aenvtest"
        body = {"accessToken": "fresh", "envVars": {"FROM_INIT": "yes"}, "defaultUser": "root", "defaultWorkdir": "/tmp"}
        assert httpx.post(envd.url + "/init", json=body).status_code == 204
        assert httpx.get(envd.url + "/envs").status_code == 401
        envd.token = "fresh"
        sbx = make_sandbox(envd)
        result = sbx.commands.run('id -un; pwd; echo "$FROM_INIT"')
        assert result.stdout.split() == ["root", "/tmp", "yes"]
        # once a token is set, /init must prove it knows it
        assert httpx.post(envd.url + "/init", json={"accessToken": "stolen"}).status_code == 401
        rotated = httpx.post(envd.url + "/init", json={"accessToken": "rotated"}, headers={"X-Access-Token": "fresh"})
        assert rotated.status_code == 204
        assert httpx.get(envd.url + "/envs", headers={"X-Access-Token": "fresh"}).status_code == 401
        assert httpx.get(envd.url + "/envs", headers={"X-Access-Token": "rotated"}).json() == {"FROM_INIT": "yes"}
    finally:
        envd.stop()


def test_watch_stream_keepalive_and_deadline(envd: Envd, work: Path) -> None:
    _, frames = stream_call(
        envd,
        "/filesystem.Filesystem/WatchDir",
        {"path": str(work)},
        {"Keepalive-Ping-Interval": "1", "Connect-Timeout-Ms": "1600"},
    )
    assert frames[0] == (0, {"start": {}})
    assert (0, {"keepalive": {}}) in frames
    assert frames[-1][0] == 2 and frames[-1][1]["error"]["code"] == "deadline_exceeded"  # type: ignore[index]


def test_tags_stream_input_and_list(envd: Envd) -> None:
    def body() -> Iterator[bytes]:
        yield envelope({"process": {"cmd": "cat"}, "tag": "my-tag"})

    with httpx.Client(base_url=envd.url, headers={**envd.headers(), "Content-Type": "application/connect+json"}) as client:
        with client.stream("POST", "/process.Process/Start", content=body(), timeout=10) as stream:
            chunks = stream.iter_bytes()
            first = next(chunks)
            pid = parse_envelopes(first)[0][1]["event"]["start"]["pid"]  # type: ignore[index]
            listed = unary_call(envd, "/process.Process/List", {}).json()["processes"]
            assert {"config": {"cmd": "cat", "args": [], "envs": {}}, "pid": pid, "tag": "my-tag"} in listed

            def inputs() -> Iterator[bytes]:
                yield envelope({"start": {"process": {"tag": "my-tag"}}})
                yield envelope({"data": {"input": {"stdin": base64.b64encode(b"via tag\n").decode()}}})
                yield envelope({"keepalive": {}})

            reply = client.post("/process.Process/StreamInput", content=inputs())
            assert parse_envelopes(reply.content) == [(0, {}), (2, {})]  # exactly one message, then the end
            assert unary_call(envd, "/process.Process/CloseStdin", {"process": {"tag": "my-tag"}}).json() == {}
            rest = b"".join(chunks)
        events = [f[1] for f in parse_envelopes(first + rest)]
        output = b"".join(base64.b64decode(e["event"]["data"]["stdout"]) for e in events if "data" in e.get("event", {}))  # type: ignore[index, union-attr]
        assert output == b"via tag\n"
        _, frames = stream_call(envd, "/process.Process/Connect", {"process": {"tag": "my-tag"}})
        assert frames[1][1]["event"]["end"]["exitCode"] == 0  # type: ignore[index]


def test_invalid_environment_is_rejected(envd: Envd) -> None:
    _, frames = stream_call(envd, "/process.Process/Start", {"process": {"cmd": "true", "envs": {"A=B": "x"}}})
    assert frames[-1][1]["error"]["code"] == "invalid_argument"  # type: ignore[index]
    _, frames = stream_call(envd, "/process.Process/Start", {"process": {"cmd": "no-such-binary-xyz"}})
    assert frames[-1][1]["error"]["code"] == "invalid_argument"  # type: ignore[index]
    assert "executable file not found" in frames[-1][1]["error"]["message"]  # type: ignore[index]
