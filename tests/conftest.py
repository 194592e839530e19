"""Shared fixtures: a real `aenv serve` process on a private AENV_HOME, driven over HTTP.

The base template layer is built once per machine into AENV_TEST_LAYER_CACHE (default
/var/cache/aenv-test/layers) and linked into each test home (`aenv.devserver.prepare_home`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from aenv.devserver import ServerProcess, prepare_home


def kill_all(srv: ServerProcess) -> None:
    """Sandboxes outlive their server by design (restarts re-attach), so tests remove them."""
    import httpx

    headers = {"X-API-Key": srv.api_key}
    with httpx.Client(base_url=srv.url, headers=headers, timeout=60) as http:
        for sbx in http.get("/v2/sandboxes", params={"limit": 1000}).json():
            http.delete(f"/sandboxes/{sbx['sandboxID']}")


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """One server for the whole session; tests must clean up the sandboxes they create."""
    home = prepare_home()
    srv = ServerProcess(home=home, extra_env={"AENV_SANDBOX_MAX_SANDBOXES": "200"})
    srv.start(ready_timeout=300)
    saved = dict(os.environ)
    os.environ.update(srv.sdk_env())
    yield srv
    kill_all(srv)
    srv.stop()
    os.environ.clear()
    os.environ.update(saved)
    shutil.rmtree(home, ignore_errors=True)
