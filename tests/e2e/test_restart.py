"""Tests that need their own `aenv serve` (not the session one): a fresh server taking
concurrent creates, and sandboxes outliving a server restart (same home, same port, so that
SDK objects created before the restart keep working after it)."""

from __future__ import annotations

import os
import shutil
import signal
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, SandboxQuery, SandboxState
from e2e_helpers import container_only, wait_until
from sandbox_helpers import runtime_env

from aenv.devserver import ServerProcess, prepare_home, remove_home
from aenv.runtime.container.layers import remove_layer


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


@container_only
@pytest.mark.slow
def test_a_snapshot_push_cut_by_a_crash_completes_after_the_restart(fresh_home: Path) -> None:
    """`create_snapshot()` returns before the repository has the snapshot (the push runs in
    the background); a `kill -9` of the server in the middle of that push loses nothing: the
    restarted server pushes it again, and the snapshot then comes back from the repository
    alone (local cache and sealed layer wiped)."""
    home = fresh_home
    srv = ServerProcess(home=home, api_key="push-key",
                        extra_env=runtime_env()).start(ready_timeout=300)
    opts = {"api_key": srv.api_key, "api_url": srv.url, "sandbox_url": srv.url}
    payload = os.urandom(96 << 20)  # random: chunked and uploaded in full, seconds here

    def detail(snapshot_id: str) -> dict[str, object]:
        resp = httpx.get(f"{srv.url}/snapshots/{snapshot_id}",
                         headers={"X-API-Key": srv.api_key}, timeout=30)
        resp.raise_for_status()
        return dict(resp.json())

    try:
        s = Sandbox.create(timeout=300, **opts)
        s.files.write("/home/user/payload.bin", payload)
        snap = s.create_snapshot(**opts)
        # positive control: the crash lands while the push is under way
        assert detail(snap.snapshot_id)["inRepository"] is False
        srv.stop(signal.SIGKILL)
        srv = ServerProcess(home=home, port=srv.port, api_key=srv.api_key,
                            extra_env=runtime_env()).start(ready_timeout=300)
        wait_until(lambda: detail(snap.snapshot_id)["inRepository"], 180,
                   what="the snapshot pushed again after the restart")
        assert int(str(detail(snap.snapshot_id)["storedBytes"])) > 90 << 20
        srv.stop()
        shutil.rmtree(home / "cache" / "snapshots" / snap.snapshot_id)
        for layer in (home / "layers").glob(f"seal-{snap.snapshot_id}*"):
            remove_layer(layer)
        srv = ServerProcess(home=home, port=srv.port, api_key=srv.api_key,
                            extra_env=runtime_env()).start(ready_timeout=300)
        copy = Sandbox.create(snap.snapshot_id, timeout=120, **opts)
        assert copy.files.read("/home/user/payload.bin", format="bytes") == payload
    finally:
        srv.shutdown()
