"""Tests that need their own `aenv serve` (not the session one): a fresh server taking
concurrent creates, and sandboxes outliving a server restart (same home, same port, so that
SDK objects created before the restart keep working after it)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from e2b import Sandbox, SandboxQuery, SandboxState
from sandbox_helpers import runtime_env

from aenv.devserver import ServerProcess, prepare_home, remove_home


@pytest.fixture
def fresh_home() -> Iterator[Path]:
    home = prepare_home("aenv-e2e-own-")
    yield home
    remove_home(home)


def test_concurrent_creates_on_a_fresh_server(fresh_home: Path) -> None:
    """The very first creates of a new server arrive together (a batch job starting up)."""
    srv = ServerProcess(home=fresh_home, api_key="fresh-key",
                        extra_env=runtime_env()).start(ready_timeout=300)
    opts = {"api_key": srv.api_key, "api_url": srv.url, "sandbox_url": srv.url}
    created: list[Sandbox] = []
    errors: list[Exception] = []

    def create(i: int) -> None:
        try:
            s = Sandbox.create(metadata={"i": str(i)}, timeout=120, **opts)
            created.append(s)
            assert s.commands.run("hostname").stdout.strip() == s.sandbox_id
        except Exception as exc:  # noqa: BLE001 - collected: every create must succeed
            errors.append(exc)

    try:
        with ThreadPoolExecutor(5) as pool:
            list(pool.map(create, range(5)))
        assert not errors, f"{len(errors)}/5 concurrent creates failed: {errors!r}"
        assert len({s.sandbox_id for s in created}) == 5
    finally:
        srv.shutdown()


@pytest.mark.slow
def test_sandboxes_survive_a_server_restart(fresh_home: Path) -> None:
    home = fresh_home
    srv = ServerProcess(home=home, api_key="restart-key",
                        extra_env=runtime_env()).start(ready_timeout=300)
    opts = {"api_key": srv.api_key, "api_url": srv.url, "sandbox_url": srv.url}
    tag = {"e2e-restart": uuid.uuid4().hex[:10]}
    try:
        s = Sandbox.create(metadata=tag, envs={"KEEP": "me"}, timeout=300, **opts)
        s.files.write("/home/user/before-restart.txt", "persisted")
        bg = s.commands.run("exec -a e2e-survivor sleep 1000", background=True, timeout=0)
        bg.disconnect()

        srv.stop()
        srv = ServerProcess(home=home, port=srv.port, api_key=srv.api_key,
                            extra_env=runtime_env()).start(ready_timeout=300)

        paginator = Sandbox.list(query=SandboxQuery(metadata=tag), **opts)
        listed = paginator.next_items()
        assert [x.sandbox_id for x in listed] == [s.sandbox_id]
        # the SDK object from before the restart still works (same token, same URL)
        assert s.files.read("/home/user/before-restart.txt") == "persisted"
        again = Sandbox.connect(s.sandbox_id, **opts)
        assert again.get_info().state == SandboxState.RUNNING
        assert again.get_info().metadata == tag
        assert again.commands.run("echo $KEEP; hostname").stdout.split() == ["me", s.sandbox_id]
        assert "e2e-survivor" in again.commands.run("ps -eo args").stdout
        assert bg.pid in {p.pid for p in again.commands.list()}
        assert again.kill() is True
        assert Sandbox.list(query=SandboxQuery(metadata=tag), **opts).next_items() == []
    finally:
        srv.shutdown()
