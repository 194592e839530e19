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


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """One server for the whole session; tests must clean up the sandboxes they create."""
    home = prepare_home()
    srv = ServerProcess(home=home, extra_env={"AENV_SANDBOX_MAX_SANDBOXES": "200"})
    srv.start(ready_timeout=300)
    saved = dict(os.environ)
    os.environ.update(srv.sdk_env())
    yield srv
    srv.shutdown()
    os.environ.clear()
    os.environ.update(saved)
    shutil.rmtree(home, ignore_errors=True)
