"""A disk that fills up under a pause and a snapshot: the server's storage volume made small
(1 GiB), then filled from the host until a checkpoint image no longer fits. Each operation
must fail with a clear error and leave the sandbox as it was: running, thawed, its files
intact, no partial image left; and work again once there is room."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox
from e2e_helpers import container_only
from faults_helpers import Node, assert_converged, assert_intact, listed, set_up_sandbox, snapshots

from aenv.devserver import free_port, prepare_home, remove_home

pytestmark = [container_only, pytest.mark.slow]


@pytest.fixture
def small_node(monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    monkeypatch.setenv("AENV_TEST_FS", "ext4")  # the server makes its own (small) volume
    home = prepare_home("aenv-diskfull-")
    node = Node(home=home, port=free_port())
    monkeypatch.setenv("AENV_STORAGE_VOLUME_SIZE_GB", "1")
    try:
        yield node
    finally:
        (home / "volume" / "filler").unlink(missing_ok=True)
        if node.server is None or node.server.proc is None or node.server.proc.poll() is not None:
            node.start()
        assert node.server is not None
        node.server.shutdown()
        remove_home(home)


def _fill(volume: Path, leave_mb: int) -> Path:
    """Take all but `leave_mb` MiB of the filesystem at `volume` with one file."""
    filler = volume / "filler"
    st = os.statvfs(volume)
    free = st.f_bavail * st.f_frsize - leave_mb * 2**20
    assert free > 0, "the volume is already full"
    subprocess.run(["fallocate", "-l", str(free), str(filler)], check=True)
    subprocess.run(["sync", "-f", str(volume)], check=True)
    return filler


def _hold_memory(sbx: Sandbox) -> None:
    """~150 MiB resident: an image that cannot fit in 20 MiB."""
    sbx.commands.run("python3 -c 'import time; b = bytearray(150 << 20); "
                     "b[::4096] = b\"x\" * len(b[::4096]); time.sleep(3600)'", background=True)
    sbx.commands.run("sleep 1.5")


def test_pause_and_snapshot_on_a_full_disk(small_node: Node, baseline: set[str]) -> None:
    node = small_node
    node.start()
    volume = node.home / "volume"
    assert os.path.ismount(volume), "the server should have made its storage volume"
    sbx, sums = set_up_sandbox(node)
    _hold_memory(sbx)
    filler = _fill(volume, leave_mb=20)
    with node.api() as api:
        for path in (f"/sandboxes/{sbx.sandbox_id}/pause", f"/sandboxes/{sbx.sandbox_id}/snapshots"):
            resp = api.post(path, json={} if path.endswith("snapshots") else None)
            assert 400 <= resp.status_code < 600, resp.text
            body = resp.json()
            assert body["code"] == resp.status_code and body["message"], body
            # As it was: running (thawed), its files there, nothing half-made. (Its counter
            # cannot write to the full disk either: processes are checked once there is room.)
            assert listed(node) == {sbx.sandbox_id: "running"}
            assert_intact(node, sbx.sandbox_id, sums, processes=False)
    assert snapshots(node) == []
    assert list((node.home / "snapshots").iterdir()) == []
    workspace = node.home / "sandboxes" / sbx.sandbox_id / "checkpoints"
    assert [p.name for p in workspace.iterdir()] == [], "a partial pause image was left"
    filler.unlink()
    assert_intact(node, sbx.sandbox_id, sums)  # its processes ran on, thawed
    with node.api() as api:  # room again: both work
        assert api.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 204
    assert_intact(node, sbx.sandbox_id, sums)
    with node.api() as api:
        resp = api.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={})
        assert resp.status_code in (200, 201), resp.text
    assert len(snapshots(node)) == 1
    assert_converged(node, baseline)
