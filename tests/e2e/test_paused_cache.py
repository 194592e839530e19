"""Paused sandboxes' images are a bounded local cache once they are in the repository
(`snapshot.paused_cache_mb`): the oldest are dropped locally, and a resume pulls them back
with memory, processes and files. This is what lets a node hold more paused sandboxes than
its disk holds images (an idle one's image is ~10 MiB, its new chunks ~1.7 MiB)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox
from e2e_helpers import container_only, wait_until
from sandbox_helpers import runtime_env

from aenv.devserver import ServerProcess, prepare_home, remove_home

pytestmark = container_only


@pytest.fixture
def small_cache_server() -> Iterator[ServerProcess]:
    home = prepare_home("aenv-e2e-pcache-")
    srv = ServerProcess(home=home, api_key="pcache-key", extra_env={
        **runtime_env(), "AENV_SNAPSHOT_PAUSED_CACHE_MB": "12"}).start(ready_timeout=300)
    yield srv
    srv.shutdown()
    remove_home(home)


def _images(home: Path, sandbox_id: str) -> list[str]:
    root = home / "sandboxes" / sandbox_id / "checkpoints"
    return sorted(p.name for p in root.iterdir() if p.name.startswith("pause-"))


def test_oldest_paused_images_are_dropped_and_pulled_back(
        small_cache_server: ServerProcess) -> None:
    server = small_cache_server
    opts = {"api_key": server.api_key, "api_url": server.url, "sandbox_url": server.url}
    boxes = []
    for i in range(3):
        sbx = Sandbox.create(timeout=300, **opts)
        sbx.files.write("/home/user/mark", f"box {i}")
        sbx.commands.run("i=0; while true; do i=$((i+1)); echo $i > /home/user/n; sleep 0.1; "
                         "done", background=True)
        time.sleep(0.3)
        assert sbx.pause() is True
        boxes.append(sbx.sandbox_id)
    # Three idle images (~10 MiB each) over a 12 MiB budget: once they are in the
    # repository, the two paused first are dropped locally, the newest is kept.
    wait_until(lambda: not _images(server.home, boxes[0]) and not _images(server.home, boxes[1]),
               60, what="the oldest local images dropped")
    assert len(_images(server.home, boxes[2])) == 1
    for i, sid in enumerate(boxes):
        back = Sandbox.connect(sid, timeout=300, **opts)  # pulls the image back if dropped
        assert back.files.read("/home/user/mark") == f"box {i}"
        first = int(back.commands.run("cat /home/user/n").stdout)
        time.sleep(0.4)
        assert int(back.commands.run("cat /home/user/n").stdout) > first  # processes kept
        back.kill()
