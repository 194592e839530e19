"""Fixtures for the end-to-end suite: a real `aenv serve` (the session `server` fixture from
tests/conftest.py), the unmodified `e2b` SDK, and plain httpx for wire-level checks.

Every e2e test depends on `server` (autouse), so E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY
point at the test server before any SDK call. A module-level guard kills and reports any
sandbox a test module leaves behind.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
from e2e_helpers import live_sandbox_ids

from aenv.devserver import ServerProcess


@pytest.fixture(autouse=True)
def _e2e_server(server: ServerProcess) -> ServerProcess:
    return server


@pytest.fixture(scope="session")
def api(server: ServerProcess) -> Iterator[httpx.Client]:
    """Authenticated control-plane client."""
    with httpx.Client(base_url=server.url, headers={"X-API-Key": server.api_key},
                      timeout=60) as client:
        yield client


@pytest.fixture(scope="session")
def raw_http(server: ServerProcess) -> Iterator[httpx.Client]:
    """Unauthenticated client on the same origin (for auth and envd-proxy checks)."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module", autouse=True)
def _no_leaked_sandboxes(server: ServerProcess, request: pytest.FixtureRequest) -> Iterator[None]:
    """Each module must remove what it created. Sandboxes created by the module and still
    present after all its fixtures are torn down are killed, then reported as an error."""
    with httpx.Client(base_url=server.url, headers={"X-API-Key": server.api_key},
                      timeout=60) as http:
        before = live_sandbox_ids(http)
        yield
        leaked = live_sandbox_ids(http) - before
        for sandbox_id in leaked:
            http.delete(f"/sandboxes/{sandbox_id}")
    assert not leaked, f"{request.module.__name__} leaked sandboxes: {sorted(leaked)}"


@pytest.fixture
def run_id() -> str:
    """A unique tag for metadata filters, file names and markers."""
    return uuid.uuid4().hex[:12]
