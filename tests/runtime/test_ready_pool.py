"""The container driver's ready pool: fully started idle sandboxes that a matching create
claims (identity, limits, envd token and settings), refilled while the driver is idle,
removed on close() and, after a crash, by the next start(). Real namespaces, no mocks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from conftest import make_config
from runtime_helpers import cgroup_read, spec_for
from sandbox_helpers import http, run

from aenv.runtime.base import ReadyShape, RuntimeHandle
from aenv.runtime.container.driver import ContainerDriver

CONTROLLERS = ("memory", "cpu", "cpuacct", "pids", "freezer", "devices")
CGROUP = Path("/sys/fs/cgroup")


def shape(rootfs: Path, internet: bool = True) -> ReadyShape:
    return ReadyShape(lower_layers=(rootfs,), cpu_count=1, memory_mb=256, pids_max=256,
                      allow_internet_access=internet, default_user="root")


async def wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def pool_names(drv: ContainerDriver) -> list[str]:
    return [r.handle.sandbox_id for r in drv._ready]  # test-only peek


def pool_leftovers(name: str, home: Path) -> list[Path]:
    paths = [CGROUP / c / "aenv" / name for c in CONTROLLERS]
    paths.append(home / "runtime" / "container" / "pool" / name)
    return [p for p in paths if p.exists()]


@pytest.fixture
async def pool_driver(driver: ContainerDriver, rootfs: Path, home: Path
                      ) -> AsyncIterator[Callable[..., Awaitable[ContainerDriver]]]:
    """make(size) -> a started driver with a ready pool of `size` for the default shape.
    (Depends on the session driver so that the shared network is set up once.)"""
    made: list[ContainerDriver] = []

    async def make(size: int = 2, internet: bool = True) -> ContainerDriver:
        drv = ContainerDriver(make_config(home), warm_processes=2, build_bundle=False,
                              ready_pool=size)
        await drv.start()
        made.append(drv)
        drv.set_ready_shapes([shape(rootfs, internet)])
        await wait_for(lambda: drv.ready_count() == size)
        return drv

    yield make
    for drv in made:
        await drv.close()


async def test_claimed_sandbox_is_the_requested_one(pool_driver: Callable[..., Awaitable[
        ContainerDriver]], rootfs: Path, home: Path) -> None:
    drv = await pool_driver(2)
    pooled = drv._ready[0]  # test-only peek: the one the next create claims
    pool_name, pool_token = pooled.handle.sandbox_id, pooled.token
    pool_pid = pooled.handle.data["pid"]
    spec = spec_for(home, rootfs, cpu_count=2, pids_max=300,
                    env_vars={"FOO": "bar baz", "ONLY_HERE": "1"},
                    envd_access_token="the-real-token", default_workdir="/tmp")
    handle = await drv.create(spec)
    sid = handle.sandbox_id
    try:
        assert drv.last_timings["pooled"] == 1.0
        assert handle.data["pid"] == pool_pid and drv.ready_count() == 1
        # Identity: hostname, /etc files, cgroups and workspace all carry the new id.
        r = await run(drv, handle, "hostname; cat /etc/hostname; grep -c " + sid + " /etc/hosts;"
                      " echo $FOO; echo $ONLY_HERE; pwd", token="the-real-token")
        assert r.stdout.split("\n")[:6] == [sid, sid, "1", "bar baz", "1", "/tmp"], r
        assert not pool_leftovers(pool_name, home)
        assert all((CGROUP / c / "aenv" / sid).is_dir() for c in CONTROLLERS)
        assert str(pool_pid) in cgroup_read(sid, "pids", "cgroup.procs").split()
        assert handle.data["workspace"] == str(spec.workspace)
        assert (spec.workspace / "upper" / "etc" / "hostname").read_text() == sid + "\n"
        # Limits: memory from the pool shape (same), cpu and pids applied at the claim.
        assert cgroup_read(sid, "memory", "memory.limit_in_bytes").strip() == str(256 * 2**20)
        assert cgroup_read(sid, "cpu", "cpu.cfs_quota_us").strip() == "200000"
        assert cgroup_read(sid, "pids", "pids.max").strip() == "300"
        # Token: the pool's is rejected everywhere, the requested one accepted.
        status, _, _ = await http(drv, handle, "GET", "/envs", headers={
            "X-Access-Token": pool_token})
        assert status == 401
        status, _, _ = await http(drv, handle, "POST", "/init", b"{}", headers={
            "X-Access-Token": pool_token})
        assert status == 401
        status, _, body = await http(drv, handle, "GET", "/envs", headers={
            "X-Access-Token": "the-real-token"})
        assert status == 200 and json.loads(body) == {"FOO": "bar baz", "ONLY_HERE": "1"}
        usage = await drv.stats(handle)
        assert usage.mem_used_bytes > 0 and usage.mem_total_bytes == 256 * 2**20
        assert 0 <= usage.cpu_used_pct < 400
    finally:
        await drv.destroy(handle)
    assert not Path(f"/proc/{pool_pid}").exists() or _gone(pool_pid)
    assert not any((CGROUP / c / "aenv" / sid).exists() for c in CONTROLLERS)
    assert not spec.workspace.exists()


async def test_other_shapes_are_created_normally(pool_driver: Callable[..., Awaitable[
        ContainerDriver]], rootfs: Path, home: Path) -> None:
    drv = await pool_driver(1)
    handles = []
    try:
        for overrides in ({"memory_mb": 300}, {"allow_internet_access": False}):
            handles.append(await drv.create(spec_for(home, rootfs, **overrides)))
            assert drv.last_timings["pooled"] == 0.0
        assert drv.ready_count() == 1
        handles.append(await drv.create(spec_for(home, rootfs)))
        assert drv.last_timings["pooled"] == 1.0
        for h in handles:
            assert (await run(drv, h, "hostname")).stdout.strip() == h.sandbox_id
    finally:
        for h in handles:
            await drv.destroy(h)


async def test_pool_refills_only_once_idle(pool_driver: Callable[..., Awaitable[
        ContainerDriver]], rootfs: Path, home: Path) -> None:
    drv = await pool_driver(3)
    drv.ready_idle = 0.3  # wide enough to observe on a slow machine
    handles = list(await asyncio.gather(*[drv.create(spec_for(home, rootfs))
                                          for _ in range(5)]))
    # 3 claimed, 2 created; right after the burst nothing was refilled.
    assert len({h.data["pid"] for h in handles}) == 5
    assert drv.ready_count() == 0
    # A stream of creates with short gaps keeps the driver busy: still no refill.
    for _ in range(3):
        handles.append(await drv.create(spec_for(home, rootfs)))
        assert drv.ready_count() == 0
        await asyncio.sleep(0.05)
    # Then it refills, up to its size and not beyond.
    seen = 0
    deadline = time.monotonic() + 20
    while drv.ready_count() < 3:
        assert time.monotonic() < deadline
        seen = max(seen, drv.ready_count())
        await asyncio.sleep(0.01)
    for _ in range(25):
        seen = max(seen, drv.ready_count())
        await asyncio.sleep(0.02)
    assert seen <= 3 and drv.ready_count() == 3
    for h in handles:
        await drv.destroy(h)


async def test_close_removes_unclaimed_and_claimed_survive_a_restart(
        driver: ContainerDriver, rootfs: Path, home: Path) -> None:
    first = ContainerDriver(make_config(home), warm_processes=1, build_bundle=False,
                            ready_pool=2)
    await first.start()
    first.set_ready_shapes([shape(rootfs)])
    await wait_for(lambda: first.ready_count() == 2)
    spec = spec_for(home, rootfs, env_vars={"A": "1"}, envd_access_token="tok")
    handle = await first.create(spec)
    assert first.last_timings["pooled"] == 1.0
    stored = RuntimeHandle(handle.driver, handle.sandbox_id, dict(handle.data))
    await wait_for(lambda: first.ready_count() == 2)
    unclaimed = [(r.handle.sandbox_id, r.handle.data["pid"]) for r in first._ready]
    await first.close()
    for name, pid in unclaimed:
        assert _gone(pid)
        assert not pool_leftovers(name, home)
    # The claimed sandbox is a user sandbox: it outlives the server, and a new one attaches.
    second = ContainerDriver(make_config(home), warm_processes=1, build_bundle=False,
                             ready_pool=2)
    await second.start()
    try:
        assert await second.attach(stored)
        r = await run(second, stored, "hostname; echo $A", token="tok")
        assert r.stdout.split() == [spec.sandbox_id, "1"]
        assert (await second.stats(stored)).mem_used_bytes > 0
    finally:
        await second.destroy(stored)
        await second.close()
    assert not any((CGROUP / c / "aenv" / spec.sandbox_id).exists() for c in CONTROLLERS)
    assert not spec.workspace.exists()


_ORPHAN_SCRIPT = """
import asyncio, json, sys
from pathlib import Path
sys.path[:0] = [{tests!r}, str(Path({tests!r}).parent)]  # conftest, then sandbox_helpers
from conftest import make_config
from aenv.runtime.base import ReadyShape
from aenv.runtime.container.driver import ContainerDriver

async def main():
    drv = ContainerDriver(make_config(Path({home!r})), warm_processes=1, build_bundle=False,
                          ready_pool=2)
    await drv.start()
    drv.set_ready_shapes([ReadyShape(lower_layers=(Path({rootfs!r}),), cpu_count=1,
                                     memory_mb=256, pids_max=256, default_user="root")])
    while drv.ready_count() < 2:
        await asyncio.sleep(0.02)
    print(json.dumps([[r.handle.sandbox_id, r.handle.data["pid"], r.handle.data["slot"]]
                      for r in drv._ready]), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_start_removes_pool_of_a_killed_server(driver: ContainerDriver, rootfs: Path,
                                                     home: Path) -> None:
    code = _ORPHAN_SCRIPT.format(tests=str(Path(__file__).parent), home=str(home),
                                 rootfs=str(rootfs))
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code,
                                                stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        pooled = json.loads(line)
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    assert len(pooled) == 2
    for name, pid, _slot in pooled:
        assert not _gone(pid), "pool sandboxes outlive their server"
        assert pool_leftovers(name, home)
    drv = ContainerDriver(make_config(home), warm_processes=1, build_bundle=False)
    await drv.start()
    try:
        await drv._ensure_network()  # test-only: the background network start is done
        for name, pid, slot in pooled:
            assert _gone(pid)
            assert not pool_leftovers(name, home)
            assert not (Path("/run/aenv/netns") / slot).exists()
    finally:
        await drv.close()


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def test_pool_names_are_ids() -> None:
    from aenv.runtime.container import driver as mod

    assert mod._ID_RE.match(f"pool-{os.getpid()}-123456-7")
