"""The Firecracker driver on a real KVM host: boot, exec through envd, pause/resume,
snapshot/fork. Skipped unless `firecracker_available()` says this host can run microVMs
(binary, KVM, guest kernel + rootfs from the configuration, and a test boot that reaches
userspace); on the development machines (no binary, PVM) they never run.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sandbox_helpers import new_id, run

from aenv.config import Config, load_config
from aenv.runtime.base import SandboxSpec
from aenv.runtime.firecracker.driver import FirecrackerDriver
from aenv.runtime.firecracker.probe import firecracker_available

AVAILABLE, WHY = firecracker_available()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not AVAILABLE, reason=f"no Firecracker here: {WHY}")]


@pytest.fixture(scope="module")
def fc_home() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="aenv-fc-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
async def fc(fc_home: Path) -> AsyncIterator[FirecrackerDriver]:
    cfg: Config = load_config()
    cfg.server.home = fc_home
    driver = FirecrackerDriver(cfg)
    await driver.start()
    yield driver
    await driver.close()


def fc_spec(home: Path, **kw: object) -> SandboxSpec:
    sid = str(kw.pop("sandbox_id", None) or new_id())
    fields: dict[str, object] = {
        "sandbox_id": sid, "lower_layers": (), "workspace": home / "sandboxes" / sid,
        "cpu_count": 1, "memory_mb": 256, "pids_max": 256, "default_user": "root",
        "envd_access_token": "t-" + sid, "allow_internet_access": False}
    fields.update(kw)
    return SandboxSpec(**fields)  # type: ignore[arg-type]


async def test_boot_exec_stats(fc: FirecrackerDriver, fc_home: Path) -> None:
    spec = fc_spec(fc_home)
    handle = await fc.create(spec)
    try:
        res = await run(fc, handle, "echo hello; hostname", token=spec.envd_access_token)
        assert res.exit_code == 0 and res.stdout.split() == ["hello", spec.sandbox_id]
        usage = await fc.stats(handle)
        assert usage.mem_total_bytes > 0 and usage.disk_total_bytes > 0
    finally:
        await fc.destroy(handle)
    assert not spec.workspace.exists()


async def test_pause_resume_keeps_memory(fc: FirecrackerDriver, fc_home: Path) -> None:
    spec = fc_spec(fc_home)
    handle = await fc.create(spec)
    try:
        tok = spec.envd_access_token
        assert (await run(fc, handle, "echo kept > /dev/shm/marker", token=tok)).exit_code == 0
        paused = await fc.pause(handle)
        assert paused.data["pid"] is None
        handle = await fc.resume(paused, spec)
        res = await run(fc, handle, "cat /dev/shm/marker", token=tok)
        assert res.stdout.strip() == "kept"
        # A second cycle takes a Diff snapshot merged over the first.
        handle = await fc.resume(await fc.pause(handle), spec)
        assert (await run(fc, handle, "cat /dev/shm/marker", token=tok)).stdout.strip() == "kept"
    finally:
        await fc.destroy(handle)


async def test_snapshot_and_fork(fc: FirecrackerDriver, fc_home: Path) -> None:
    parent_spec = fc_spec(fc_home)
    parent = await fc.create(parent_spec)
    images = fc_home / "images" / parent_spec.sandbox_id
    children = []
    try:
        tok = parent_spec.envd_access_token
        await run(fc, parent, "echo from-parent > /dev/shm/x; echo disk > /root/on-disk", token=tok)
        await fc.snapshot(parent, images)
        assert (await run(fc, parent, "cat /dev/shm/x", token=tok)).stdout.strip() == "from-parent"
        specs = [fc_spec(fc_home) for _ in range(2)]
        children = list(await asyncio.gather(*(fc.restore(s, images, tok) for s in specs)))
        for s, child in zip(specs, children, strict=True):
            t = s.envd_access_token
            res = await run(fc, child, "hostname; cat /dev/shm/x /root/on-disk", token=t)
            assert res.stdout.split() == [s.sandbox_id, "from-parent", "disk"]
        await run(fc, children[0], "echo changed > /root/on-disk", token=specs[0].envd_access_token)
        res = await run(fc, children[1], "cat /root/on-disk", token=specs[1].envd_access_token)
        assert res.stdout.strip() == "disk"  # disks are private copies
    finally:
        for h in (parent, *children):
            await fc.destroy(h)
