"""Helpers shared by the runtime suites (tests/runtime, tests/vm): talk to envd inside a sandbox
over the socket a driver's `connect()` returns (raw HTTP/1.1, Connect JSON framing), and build a
`SandboxSpec`; and, for every suite that starts a server, its environment. Importable as `sandbox_helpers` because tests/ has a conftest.py and no __init__.py
(pytest's default prepend import mode puts tests/ on sys.path)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aenv.runtime.base import RuntimeDriver, RuntimeHandle, SandboxSpec


def runtime_env(**extra: str) -> dict[str, str]:
    """The environment of a test server: `extra`, and the runtime under test
    (AENV_TEST_RUNTIME=qemu runs the same suites against the qemu driver)."""
    env = dict(extra)
    if os.environ.get("AENV_TEST_RUNTIME"):
        env["AENV_RUNTIME_DRIVER"] = os.environ["AENV_TEST_RUNTIME"]
    return env


def new_id() -> str:
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(20))


async def http(driver: RuntimeDriver, handle: RuntimeHandle, method: str, path: str,
               body: bytes = b"", headers: dict[str, str] | None = None, port: int = 49983,
               timeout: float = 60) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection into the sandbox; (status, headers, body)."""
    sock = await driver.connect(handle, port)
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        head = [f"{method} {path} HTTP/1.1", "Host: sandbox", "Connection: close",
                f"Content-Length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    header_blob, _, rest = raw.partition(b"\r\n\r\n")
    lines = header_blob.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    if hdrs.get("transfer-encoding", "").lower() == "chunked":
        out = b""
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            out += rest[:size]
            rest = rest[size + 2:]
        rest = out
    return status, hdrs, rest


@dataclass
class Result:
    exit_code: int
    stdout: str
    stderr: str


async def run(driver: RuntimeDriver, handle: RuntimeHandle, cmd: str, user: str = "root",
              timeout: float = 60, token: str | None = None) -> Result:
    """Run `bash -c cmd` through envd's process service; wait for it to end."""
    message = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-c", cmd]},
                          "stdin": False}).encode()
    frame = bytes([0]) + len(message).to_bytes(4, "big") + message
    auth = base64.b64encode(f"{user}:".encode()).decode()
    status, _, body = await http(driver, handle, "POST", "/process.Process/Start", frame, {
        "Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
        "Authorization": f"Basic {auth}", "Connect-Timeout-Ms": str(int(timeout * 1000)),
        **({"X-Access-Token": token} if token else {}),
    }, timeout=timeout + 10)
    assert status == 200, (status, body[:500])
    out, err, code = b"", b"", None
    while body:
        length = int.from_bytes(body[1:5], "big")
        msg = json.loads(body[5:5 + length])
        body = body[5 + length:]
        event = msg.get("event", {})
        if "data" in event:
            out += base64.b64decode(event["data"].get("stdout", ""))
            err += base64.b64decode(event["data"].get("stderr", ""))
        if "end" in event:
            code = int(event["end"].get("exitCode", 0))
        if "error" in msg:
            raise AssertionError(f"envd error: {msg['error']}")
    assert code is not None, "process did not end"
    return Result(code, out.decode(errors="replace"), err.decode(errors="replace"))


def spec_for(home: Path, rootfs: Path, **overrides: Any) -> SandboxSpec:
    """A 1-cpu sandbox running as root on `rootfs`, workspace under `home`; the suites add their
    own limits, and keyword arguments override any field."""
    sid = overrides.pop("sandbox_id", None) or new_id()
    fields: dict[str, Any] = {
        "sandbox_id": sid, "lower_layers": (rootfs,), "workspace": home / "sandboxes" / sid,
        "cpu_count": 1, "default_user": "root"}
    fields.update(overrides)
    return SandboxSpec(**fields)
