"""E2B volumes through the official SDK (`e2b.Volume`, `Sandbox.create(volume_mounts=...)`)
against the session's server: one volume mounted read-write by two sandboxes at once, read
and written through the volume content API without a sandbox, kept after a kill, seen by
fork children, kept across pause/resume (a process with a file open on it survives), never
copied by a pause, and a quota per volume.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from e2b import CommandExitException, Sandbox, Volume
from e2b.exceptions import NotFoundException
from e2e_helpers import assert_json_error, container_only, wait_until

from aenv.devserver import ServerProcess

pytestmark = container_only


@pytest.fixture(autouse=True, scope="module")
def _volume_api(server: ServerProcess) -> Iterator[None]:
    """The SDK sends volume content requests to E2B_VOLUME_API_URL: this server."""
    saved = os.environ.get("E2B_VOLUME_API_URL")
    os.environ["E2B_VOLUME_API_URL"] = server.url
    yield
    if saved is None:
        os.environ.pop("E2B_VOLUME_API_URL", None)
    else:
        os.environ["E2B_VOLUME_API_URL"] = saved


@pytest.fixture
def volume() -> Iterator[Volume]:
    vol = Volume.create(f"t-{uuid.uuid4().hex[:10]}")
    yield vol
    Volume.destroy(vol.volume_id)


def run(sbx: Sandbox, cmd: str, user: str = "root") -> str:
    return sbx.commands.run(cmd, user=user, timeout=60).stdout


def test_volume_api_shapes(api: httpx.Client, volume: Volume) -> None:
    info = Volume.get_info(volume.volume_id)
    assert (info.volume_id, info.name, info.token) == (volume.volume_id, volume.name,
                                                      volume.token)
    listed = {v.volume_id: v.name for v in Volume.list()}
    assert listed[volume.volume_id] == volume.name
    assert_json_error(api.post("/volumes", json={"name": volume.name}), 409)  # names unique
    assert_json_error(api.post("/volumes", json={"name": "../x"}), 400)
    assert_json_error(api.get("/volumes/vol-doesnotexist0000"), 404)
    # The content API wants the volume's own token, not the API key.
    url = f"/volumecontent/{volume.volume_id}/path"
    assert_json_error(api.get(url, params={"path": "/"}), 401)
    assert_json_error(api.get(url, params={"path": "/"},
                              headers={"Authorization": "Bearer wrong"}), 401)
    assert api.get(url, params={"path": "/"},
                   headers={"Authorization": f"Bearer {volume.token}"}).status_code == 200


def test_content_api_without_a_sandbox(volume: Volume) -> None:
    volume.make_dir("/in/deep", force=True)
    entry = volume.write_file("/in/deep/a.txt", "alpha", mode=0o640)
    assert (entry.name, entry.path, entry.size, entry.mode) == ("a.txt", "/in/deep/a.txt", 5,
                                                                0o640)
    volume.write_file("/in/b.bin", b"\x00\x01" * 70_000)  # several chunks each way
    assert volume.read_file("/in/deep/a.txt") == "alpha"
    assert volume.read_file("/in/b.bin", format="bytes") == b"\x00\x01" * 70_000
    assert [e.path for e in volume.list("/in")] == ["/in/b.bin", "/in/deep"]
    assert [e.path for e in volume.list("/", depth=3)] == [
        "/in", "/in/b.bin", "/in/deep", "/in/deep/a.txt"]
    assert volume.get_info("/in/deep").type.value == "directory"
    changed = volume.update_metadata("/in/deep/a.txt", uid=1234, gid=4321, mode=0o600)
    assert (changed.uid, changed.gid, changed.mode) == (1234, 4321, 0o600)
    assert volume.exists("/in/deep/a.txt") and not volume.exists("/nope")
    with pytest.raises(NotFoundException):
        volume.write_file("/missing/parent/x", "x")  # no force: parents are not made
    volume.remove("/in")
    assert volume.list("/") == []


def test_shared_by_two_sandboxes_and_kept_after_kill(volume: Volume, server: ServerProcess
                                                     ) -> None:
    a = Sandbox.create(volume_mounts={"/data": volume}, timeout=120)
    b = Sandbox.create(volume_mounts={"/mnt/shared": volume.name}, timeout=120)
    try:
        run(a, "echo from-a > /data/a.txt", user="user")  # the volume root is the user's
        assert run(b, "cat /mnt/shared/a.txt") == "from-a\n"
        run(b, "echo from-b > /mnt/shared/b.txt")
        assert volume.read_file("/b.txt") == "from-b\n"
        volume.write_file("/c.txt", "from-api")
        assert run(a, "cat /data/c.txt") == "from-api"
        # Outside the sandbox's writable layer: its upper holds only the mount point.
        upper = server.home / "sandboxes" / a.sandbox_id / "upper"
        assert (upper / "data").is_dir() and not any((upper / "data").iterdir())
        detail = httpx.get(f"{server.url}/sandboxes/{a.sandbox_id}",
                           headers={"X-API-Key": server.api_key}).json()
        assert detail["volumeMounts"] == [{"name": volume.name, "path": "/data"}]
    finally:
        a.kill()
    # The volume outlives the sandbox; another one sees what the killed one wrote.
    assert volume.read_file("/a.txt") == "from-a\n"
    assert run(b, "cat /mnt/shared/a.txt") == "from-a\n"
    b.kill()
    c = Sandbox.create(volume_mounts={"/data": volume}, timeout=120)
    try:
        assert run(c, "ls /data") == "a.txt\nb.txt\nc.txt\n"
    finally:
        c.kill()


def test_pause_resume_and_fork_children(volume: Volume, server: ServerProcess) -> None:
    sbx = Sandbox.create(volume_mounts={"/data": volume}, timeout=300)
    children: list[Sandbox] = []
    try:
        # 32 MiB on the volume: a pause must not copy it (the image stays far smaller).
        run(sbx, "head -c 33554432 /dev/urandom > /data/big.bin")
        # A process with a file open on the volume, appending a line every 0.1 s.
        sbx.commands.run("exec 3>>/data/ticks; while true; do echo t >&3; sleep 0.1; done",
                         background=True, user="root")
        wait_until(lambda: volume.exists("/ticks"), 10, what="ticks")
        sbx.pause()
        image = max((server.home / "sandboxes" / sbx.sandbox_id / "checkpoints").glob("pause-*"))
        image_bytes = sum(p.stat().st_size for p in image.rglob("*") if p.is_file())
        assert image_bytes < 24 * 2**20, image_bytes
        paused_ticks = len(volume.read_file("/ticks").split())
        time.sleep(0.5)
        assert len(volume.read_file("/ticks").split()) == paused_ticks  # nothing runs
        sbx = Sandbox.connect(sbx.sandbox_id)
        # The same process, its fd on the volume restored: the file grows again.
        wait_until(lambda: len(volume.read_file("/ticks").split()) > paused_ticks + 3, 10,
                   what="ticks after the resume")
        assert run(sbx, "stat -c %s /data/big.bin") == "33554432\n"
        children = [c for c in sbx.fork(count=2) if isinstance(c, Sandbox)]
        assert len(children) == 2
        for i, child in enumerate(children):
            run(child, f"echo {i} > /data/child-{i}")
        assert run(sbx, "cat /data/child-0 /data/child-1") == "0\n1\n"
        assert volume.read_file("/child-1") == "1\n"
        assert run(children[0], "cat /data/child-1") == "1\n"  # each child sees the others'
    finally:
        for child in children:
            child.kill()
        sbx.kill()


def test_content_api_stays_inside_the_volume(volume: Volume) -> None:
    """Symlinks a sandbox plants in a volume resolve inside it, never to the host's files
    (the content API runs as root on the host)."""
    sbx = Sandbox.create(volume_mounts={"/data": volume}, timeout=60)
    try:
        run(sbx, "ln -s /etc /data/etc-link; ln -s ../../../../../../etc/hostname /data/up; "
                 "ln -s /proc/1/root /data/proc-root; mkdir -p /data/etc; "
                 "echo inside > /data/etc/hostname")
    finally:
        sbx.kill()
    # /etc inside the volume is the volume's own etc/: its file, not the host's.
    assert volume.read_file("/etc-link/hostname") == "inside\n"
    assert volume.read_file("/up") == "inside\n"
    with pytest.raises(NotFoundException):
        volume.read_file("/proc-root/etc/hostname")  # no magic links, no host /proc
    assert volume.get_info("/etc-link").type.value == "symlink"
    assert volume.get_info("/etc-link").target == "/etc"
    volume.remove("/etc-link")  # the link goes, not what it names
    assert volume.read_file("/etc/hostname") == "inside\n"


def test_quota_enforced(api: httpx.Client) -> None:
    resp = api.post("/volumes", json={"name": f"q-{uuid.uuid4().hex[:8]}", "sizeMB": 16})
    assert resp.status_code == 201, resp.text
    body = resp.json()
    if not body["quota"]:
        pytest.skip("volumes are not on btrfs here: sizes are advisory")
    vol = Volume.connect(body["volumeID"])
    sbx = Sandbox.create(volume_mounts={"/q": vol}, timeout=120)
    try:
        with pytest.raises(CommandExitException) as exc:
            sbx.commands.run("dd if=/dev/zero of=/q/fill bs=1M count=64 conv=fsync", user="root",
                             timeout=60)
        assert "quota" in exc.value.stderr.lower(), exc.value.stderr
        written = int(run(sbx, "stat -c %s /q/fill"))
        assert written <= 17 * 2**20, written
        run(sbx, "rm /q/fill; sync")
        # The content API is held to the same size.
        resp = httpx.put(f"{api.base_url}/volumecontent/{vol.volume_id}/file",
                         params={"path": "/big"}, content=b"\0" * (32 * 2**20),
                         headers={"Authorization": f"Bearer {vol.token}",
                                  "Content-Type": "application/octet-stream"}, timeout=60)
        assert resp.status_code == 429, resp.text
        assert "full" in resp.json()["message"]
        # Mounted: not deleted under the sandbox.
        assert_json_error(api.delete(f"/volumes/{vol.volume_id}"), 409)
    finally:
        sbx.kill()
    assert api.delete(f"/volumes/{vol.volume_id}").status_code == 204
    assert_json_error(api.get(f"/volumes/{vol.volume_id}"), 404)


def test_bad_mounts_refused(api: httpx.Client, volume: Volume) -> None:
    base = {"templateID": "base", "timeout": 60}
    assert_json_error(api.post("/sandboxes", json={
        **base, "volumeMounts": [{"name": "no-such-volume", "path": "/data"}]}), 404)
    for path in ("relative", "/proc/x", "/", "/a/../b", "/etc"):
        assert_json_error(api.post("/sandboxes", json={
            **base, "volumeMounts": [{"name": volume.name, "path": path}]}), 400)
    assert_json_error(api.post("/sandboxes", json={**base, "volumeMounts": [
        {"name": volume.name, "path": "/a"}, {"name": volume.name, "path": "/a/b"}]}), 400)
