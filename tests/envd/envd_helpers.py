"""Helpers for the envd suite: start a real envd subprocess, build SDK sandboxes for it,
and speak raw Connect envelopes where the SDK cannot reach."""

from __future__ import annotations

import grp
import json
import os
import pwd
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

SRC = Path(__file__).resolve().parents[2] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from e2b import AsyncSandbox, ConnectionConfig, Sandbox
from packaging.version import Version

TEST_USER = "aenvtest"
TEST_GROUP = "aenvtestgrp"  # a supplementary group of TEST_USER
TOKEN = "envd-test-token-" + uuid.uuid4().hex[:8]


@dataclass
class Envd:
    port: int
    token: str | None
    process: subprocess.Popen[bytes]
    log_path: Path
    metadata_dir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self) -> dict[str, str]:
        return {"X-Access-Token": self.token} if self.token else {}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_test_user() -> pwd.struct_passwd:
    try:
        pwd.getpwnam(TEST_USER)
    except KeyError:
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", TEST_USER], check=True)
    try:
        members = grp.getgrnam(TEST_GROUP).gr_mem
    except KeyError:
        subprocess.run(["groupadd", TEST_GROUP], check=True)
        members = []
    if TEST_USER not in members:
        subprocess.run(["usermod", "-aG", TEST_GROUP, TEST_USER], check=True)
    return pwd.getpwnam(TEST_USER)


def start_envd(
    tmp: Path,
    *,
    token: str | None = TOKEN,
    user: str = TEST_USER,
    extra: list[str] | None = None,
    wrapper: list[str] | None = None,
) -> Envd:
    port = free_port()
    log_path = tmp / f"envd-{port}.log"
    metadata_dir = tmp / f"metadata-{port}"
    args = [sys.executable, "-m", "aenv.envd", "--host", "127.0.0.1", "--port", str(port), "--user", user]
    args += ["--metadata-dir", str(metadata_dir)]
    if token:
        args += ["--token", token]
    args += extra if extra is not None else ["--not-init"]
    env = dict(os.environ, PYTHONPATH=str(SRC))
    log = open(log_path, "wb")  # noqa: SIM115 - owned by the process for its lifetime
    process = subprocess.Popen((wrapper or []) + args, stdout=log, stderr=subprocess.STDOUT, env=env)
    envd = Envd(port, token, process, log_path, metadata_dir)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"envd exited: {log_path.read_text()}")
        try:
            if httpx.get(envd.url + "/health", timeout=1).status_code == 204:
                return envd
        except httpx.HTTPError:
            time.sleep(0.05)
    envd.stop()
    raise RuntimeError(f"envd did not become healthy: {log_path.read_text()}")


def connection_config(envd: Envd, token: str | None = None) -> ConnectionConfig:
    headers = {"E2b-Sandbox-Id": "testsbx", "E2b-Sandbox-Port": "49983"}
    token = token if token is not None else envd.token
    if token:
        headers["X-Access-Token"] = token
    return ConnectionConfig(api_key="x", sandbox_url=envd.url, extra_sandbox_headers=headers)


def make_sandbox(envd: Envd, token: str | None = None) -> Sandbox:
    used = token if token is not None else envd.token
    return Sandbox(
        sandbox_id="testsbx",
        envd_version=Version("0.6.13"),
        envd_access_token=used,
        sandbox_domain=None,
        connection_config=connection_config(envd, token),
    )


def make_async_sandbox(envd: Envd) -> AsyncSandbox:
    return AsyncSandbox(
        sandbox_id="testsbx",
        envd_version=Version("0.6.13"),
        envd_access_token=envd.token,
        sandbox_domain=None,
        connection_config=connection_config(envd),
    )


def envelope(message: dict[str, object], flags: int = 0) -> bytes:
    payload = json.dumps(message).encode()
    return bytes([flags]) + len(payload).to_bytes(4, "big") + payload


def parse_envelopes(data: bytes) -> list[tuple[int, dict[str, object]]]:
    out = []
    while data:
        flags, length = data[0], int.from_bytes(data[1:5], "big")
        out.append((flags, json.loads(data[5 : 5 + length])))
        data = data[5 + length :]
    return out
