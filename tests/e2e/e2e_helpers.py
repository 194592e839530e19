"""Helpers shared by the e2e test modules (imported as `e2e_helpers`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

# Tests of container-runtime mechanics (CRIU failures, sealed overlay layers, ...), skipped
# when the suites run against another runtime (AENV_TEST_RUNTIME=qemu, see tests/conftest.py).
container_only = pytest.mark.skipif(
    os.environ.get("AENV_TEST_RUNTIME", "container") != "container",
    reason="container runtime mechanics")


def live_sandbox_ids(api: httpx.Client) -> set[str]:
    resp = api.get("/v2/sandboxes", params={"limit": 1000})
    assert resp.status_code == 200, resp.text
    return {s["sandboxID"] for s in resp.json()}


def assert_json_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    """An error answer: the expected status and an E2B-shaped JSON body {code:int, message:str}."""
    assert resp.status_code == status, f"expected {status}, got {resp.status_code}: {resp.text}"
    assert resp.headers.get("content-type", "").startswith("application/json"), resp.headers
    body = resp.json()
    assert isinstance(body, dict), body
    assert isinstance(body.get("code"), int) and not isinstance(body["code"], bool), body
    assert body["code"] == status, body
    assert isinstance(body.get("message"), str) and body["message"], body
    return body


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.2,
               what: str = "condition") -> Any:
    """Poll `predicate` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last value: {last!r})")


def lose_local_state(home: Path, sandbox_id: str) -> None:
    """What a node that lost a (stopped) paused sandbox's local files looks like: its
    workspace (a container's checkpoint image and writable layer, a VM's saved state and
    disk) and its cgroups (a container's) are gone."""
    from aenv.runtime.container import cgroups, layers

    workspace = home / "sandboxes" / sandbox_id
    assert workspace.is_dir(), workspace
    layers.remove_layer(workspace)
    for controller in cgroups.CONTROLLERS:
        path = cgroups.CGROUP_ROOT / controller / "aenv" / sandbox_id
        if path.exists():
            path.rmdir()
