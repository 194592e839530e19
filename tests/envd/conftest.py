"""Fixtures for the envd suite: a real envd subprocess on a loopback port, driven by the
unmodified e2b SDK (sync and async) and by raw HTTP where the SDK cannot reach.

Commands run as a throwaway user `aenvtest` (created here if missing) with a stock home
directory: the host's root profile may do slow things (pyenv) that have nothing to do
with envd.
"""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import AsyncSandbox, Sandbox
from envd_helpers import Envd, ensure_test_user, make_async_sandbox, make_sandbox, start_envd


@pytest.fixture(scope="session")
def test_user() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("the envd suite runs as root (it switches users)")
    return ensure_test_user()


@pytest.fixture(scope="session")
def session_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="aenv-envd-test-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def envd(test_user: pwd.struct_passwd, session_tmp: Path) -> Iterator[Envd]:
    server = start_envd(session_tmp, extra=["--not-init", "--env", "AENV_SANDBOX_VAR=sandbox", "--env", "SHARED=from-sandbox"])
    yield server
    server.stop()


@pytest.fixture(scope="session")
def sbx(envd: Envd) -> Sandbox:
    return make_sandbox(envd)


@pytest.fixture
def asbx(envd: Envd) -> AsyncSandbox:
    return make_async_sandbox(envd)


@pytest.fixture
def work(test_user: pwd.struct_passwd, session_tmp: Path) -> Iterator[Path]:
    """A fresh directory owned by the test user."""
    path = session_tmp / f"work-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    os.chown(path, test_user.pw_uid, test_user.pw_gid)
    yield path
    shutil.rmtree(path, ignore_errors=True)
