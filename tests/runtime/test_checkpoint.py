"""CRIU checkpoint/restore of real container sandboxes (`aenv.runtime.container.checkpoint`):
pause/resume, snapshot, fork, and their timings (run with -s to see them).

Needs CRIU >= 4.2 at /usr/local/sbin/criu (`scripts/install-criu.sh`); skipped otherwise.
Restored sandboxes are described by plain `RuntimeHandle`s, so the driver's connect() and
destroy() work on them as on any sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from conftest import CreateFn
from runtime_helpers import cgroup_read, spec_for
from sandbox_helpers import http, new_id, run

from aenv.config import Config
from aenv.errors import AenvError, ErrorCode
from aenv.runtime import pybundle
from aenv.runtime.base import RuntimeHandle
from aenv.runtime.container import checkpoint as ck
from aenv.runtime.container import linux
from aenv.runtime.container.driver import ContainerDriver

pytestmark = pytest.mark.skipif(
    not ck.CRIU.exists(), reason="CRIU not installed: run scripts/install-criu.sh")

FREEZER = Path("/sys/fs/cgroup/freezer/aenv")
COUNTER = ("(nohup bash -c 'i=0; while :; do i=$((i+1)); echo $i > /root/cnt.tmp; "
           "mv /root/cnt.tmp /root/cnt; sleep 0.05; done' >/dev/null 2>&1 &)")
# A python process that keeps a random secret and a request count in memory only; a request
# is a line written to one FIFO, the answer comes back on another.
HOLDER = r"""
import secrets
secret, n = secrets.token_hex(8), 0
while True:
    with open('/root/req') as f:
        f.read()
    n += 1
    with open('/root/resp', 'w') as f:
        f.write(f'{secret} {n}\n')
"""
ASK = "echo > /root/req && cat /root/resp"

RestoreFn = Callable[..., Awaitable[RuntimeHandle]]


async def start_workload(driver: ContainerDriver, handle: RuntimeHandle,
                         token: str | None = None) -> None:
    holder = HOLDER.replace("'", "'\"'\"'")
    r = await run(driver, handle,
                  f"mkfifo /root/req /root/resp && echo before > /root/file && {COUNTER} && "
                  f"(nohup python3 -c '{holder}' >/dev/null 2>&1 &) && "
                  "until [ -s /root/cnt ]; do sleep 0.01; done", token=token)
    assert r.exit_code == 0, r


async def counter(driver: ContainerDriver, handle: RuntimeHandle,
                  token: str | None = None) -> int:
    r = await run(driver, handle, "cat /root/cnt", token=token)
    assert r.exit_code == 0, r
    return int(r.stdout)


async def ask(driver: ContainerDriver, handle: RuntimeHandle,
              token: str | None = None) -> tuple[str, int]:
    r = await run(driver, handle, ASK, token=token, timeout=10)
    assert r.exit_code == 0, r
    secret, n = r.stdout.split()
    return secret, int(n)


def freezer(sandbox_id: str) -> Path:
    return FREEZER / sandbox_id


@pytest.fixture
async def restore_new(driver: ContainerDriver, rootfs: Path, home: Path
                      ) -> AsyncIterator[RestoreFn]:
    """restore_new(images, netns=None, lazy=False) -> handle of a new sandbox (own id,
    workspace with an empty upper over the image's sealed one, cgroups), destroyed
    afterwards."""
    made: list[RuntimeHandle] = []
    daemons: list[asyncio.subprocess.Process] = []

    async def _restore(images: Path, netns: Path | None = None,
                       lazy: bool = False) -> RuntimeHandle:
        sid = new_id()
        ws = home / "sandboxes" / sid
        handle = RuntimeHandle("container", sid, {"workspace": str(ws), "envd_port": 49983})
        made.append(handle)
        await ck.prepare_workspace(ws)
        dirs = await asyncio.to_thread(ck.create_cgroups, driver.cgroups, sid, memory_mb=256,
                                       cpu_count=1, pids_max=256)
        seal = ck.seal_layer(images)
        assert seal is not None
        res = await ck.restore(images, workspace=ws,
                               lower=[driver.driver_layer, seal / "upper", rootfs],
                               cgroup_dirs=dirs, netns=netns, lazy=lazy)
        handle.data |= {"pid": res.pid, "start_time": res.start_time,
                        "restore_timings": res.timings}
        assert (res.lazy_daemon is not None) == lazy
        if res.lazy_daemon is not None:
            daemons.append(res.lazy_daemon)
        return handle

    yield _restore
    for daemon in daemons:  # each exits by itself once it has pushed every page
        assert await asyncio.wait_for(daemon.wait(), 60) == 0
    for handle in made:
        await asyncio.to_thread(ck.unmount_root, Path(handle.data["workspace"]))
        await driver.destroy(handle)


def forget(driver: ContainerDriver, sandbox_id: str) -> None:
    """Drop the driver's cached pid/netns of a sandbox that was paused (what the driver's
    own resume will do)."""
    live = driver._live.pop(sandbox_id, None)
    if live is not None and live.netns_fd is not None:
        os.close(live.netns_fd)


# ------------------------------------------------------------------ semantics


async def test_criu_version() -> None:
    version = await ck.check_criu()
    assert tuple(int(x) for x in version.split(".")[:2]) >= (4, 2)
    with pytest.raises(AenvError) as err:
        await ck.check_criu(Path("/nonexistent/criu"))
    assert err.value.code == ErrorCode.NOT_SUPPORTED
    assert "install-criu.sh" in err.value.message


async def test_a_criu_without_our_patches_is_refused(tmp_path: Path) -> None:
    """A stock criu 4.2.1 ignores CRIU_ENTER_CGROUPS: restored tasks would silently stay in
    the server's cgroups. It is refused with a clear error instead."""
    stock = tmp_path / "criu"
    stock.write_text("#!/bin/sh\necho 'Version: 4.2.1'\n")
    stock.chmod(0o755)
    with pytest.raises(AenvError) as err:
        await ck.check_criu(stock)
    assert err.value.code == ErrorCode.NOT_SUPPORTED
    assert "lacks aenv's patches" in err.value.message


@pytest.mark.slow
async def test_pause_resume(driver: ContainerDriver, create: CreateFn, rootfs: Path,
                            tmp_path: Path) -> None:
    token = secrets.token_urlsafe(16)
    handle = await create(envd_access_token=token)
    sid, pid = handle.sandbox_id, handle.data["pid"]
    await start_workload(driver, handle, token)
    secret, n0 = await ask(driver, handle, token)
    await asyncio.sleep(0.3)
    before = await counter(driver, handle, token)
    mem_before = int(cgroup_read(sid, "memory", "memory.usage_in_bytes"))

    stats = await ck.dump(pid, tmp_path / "img", freezer=freezer(sid), leave_running=False)
    print(f"\npause: frozen {stats.frozen_s * 1e3:.0f} ms, criu {stats.criu_s * 1e3:.0f} ms, "
          f"total {stats.total_s * 1e3:.0f} ms, image {stats.image_bytes / 2**20:.1f} MiB")
    assert linux.proc_start_time(pid) is None  # gone
    assert driver.cgroups.pids(sid) == []
    assert int(cgroup_read(sid, "memory", "memory.usage_in_bytes")) < mem_before
    assert cgroup_read(sid, "freezer", "freezer.state").strip() == "THAWED"

    forget(driver, sid)
    ws = Path(handle.data["workspace"])
    res = await ck.restore(tmp_path / "img", workspace=ws, lower=[driver.driver_layer, rootfs],
                           cgroup_dirs=ck.cgroup_dirs(driver.cgroups, sid))
    print(f"resume: {res.timings}")
    handle.data |= {"pid": res.pid, "start_time": res.start_time}
    assert not (ws / ck.ROOTFS).exists()  # nothing of the restore stays mounted on the host
    assert str(res.pid) in cgroup_read(sid, "pids", "cgroup.procs").split()
    after = await counter(driver, handle, token)
    assert after >= before  # continued, not restarted
    assert await ask(driver, handle, token) == (secret, n0 + 1)
    r = await run(driver, handle, "cat /root/file; hostname; cat /proc/self/cgroup", token=token)
    assert r.stdout.splitlines()[:2] == ["before", sid]
    assert "/aenv/" not in r.stdout  # the cgroup namespace is rooted at the sandbox's set
    await asyncio.sleep(0.2)
    assert await counter(driver, handle, token) > after  # still counting
    status, _, _ = await http(driver, handle, "GET", "/envs")
    assert status == 401  # the same token is still required


@pytest.mark.slow
async def test_snapshot_restore_is_independent(driver: ContainerDriver, create: CreateFn,
                                               restore_new: RestoreFn, tmp_path: Path) -> None:
    src = await create()
    await start_workload(driver, src)
    secret, n0 = await ask(driver, src)
    before = await counter(driver, src)
    ws = Path(src.data["workspace"])
    stats = await ck.dump(src.data["pid"], tmp_path / "img", freezer=freezer(src.sandbox_id),
                          leave_running=True, upper=ws / "upper")
    print(f"\nsnapshot: source frozen {stats.frozen_s * 1e3:.0f} ms (upper copy "
          f"{stats.copy_s * 1e3:.0f} ms), criu {stats.criu_s * 1e3:.0f} ms, "
          f"total {stats.total_s * 1e3:.0f} ms")
    # The source keeps running.
    assert linux.proc_start_time(src.data["pid"]) == src.data["start_time"]
    assert cgroup_read(src.sandbox_id, "freezer", "freezer.state").strip() == "THAWED"
    assert await ask(driver, src) == (secret, n0 + 1)
    await asyncio.sleep(0.2)
    assert await counter(driver, src) > before

    copy = await restore_new(tmp_path / "img")
    print(f"restore: {copy.data['restore_timings']}")
    assert str(copy.data["pid"]) in cgroup_read(copy.sandbox_id, "pids", "cgroup.procs").split()
    assert await counter(driver, copy) >= before
    assert await ask(driver, copy) == (secret, n0 + 1)  # memory as it was at the snapshot
    assert (await run(driver, copy, "cat /root/file")).stdout == "before\n"
    await run(driver, copy, "echo copy > /root/only-copy && echo copy > /root/file")
    await run(driver, src, "echo src > /root/only-src")
    assert (await run(driver, src, "cat /root/file; ls /root")).stdout.split()[0] == "before"
    assert "only-copy" not in (await run(driver, src, "ls /root")).stdout
    assert "only-src" not in (await run(driver, copy, "ls /root")).stdout
    # Killing the copy leaves the source alone.
    await driver.destroy(copy)
    assert await ask(driver, src) == (secret, n0 + 2)


@pytest.mark.slow
async def test_fork_four(driver: ContainerDriver, create: CreateFn, restore_new: RestoreFn,
                         tmp_path: Path) -> None:
    src = await create()
    await start_workload(driver, src)
    secret, n0 = await ask(driver, src)
    ws = Path(src.data["workspace"])
    await ck.dump(src.data["pid"], tmp_path / "img", freezer=freezer(src.sandbox_id),
                  leave_running=True, upper=ws / "upper")
    # One copy joins an existing network namespace (as a network slot would be), the others
    # get a fresh one from CRIU.
    ns = f"aenv-ckpt-{secrets.token_hex(4)}"
    await asyncio.to_thread(subprocess.run, ["ip", "netns", "add", ns], check=True)
    try:
        await asyncio.to_thread(subprocess.run, ["ip", "-n", ns, "link", "set", "lo", "up"],
                                check=True)
        t0 = time.monotonic()
        forks = await asyncio.gather(
            restore_new(tmp_path / "img", netns=Path(f"/run/netns/{ns}")),
            *[restore_new(tmp_path / "img", lazy=(i == 0)) for i in range(3)])
        print(f"\nfork x4 (one lazy, one joining a netns): {time.monotonic() - t0:.3f} s")
        pids = {f.data["pid"] for f in forks}
        assert len(pids) == 4
        joined = os.stat(f"/proc/{forks[0].data['pid']}/ns/net")
        slot = os.stat(f"/run/netns/{ns}")
        assert (joined.st_dev, joined.st_ino) == (slot.st_dev, slot.st_ino)
        inodes = {os.stat(f"/proc/{f.data['pid']}/ns/net").st_ino for f in forks}
        assert len(inodes) == 4
        for f in forks:
            assert await ask(driver, f) == (secret, n0 + 1)
            await run(driver, f, f"echo {f.sandbox_id} > /root/me")
        for f in forks:
            assert (await run(driver, f, "cat /root/me")).stdout.strip() == f.sandbox_id
            procs = cgroup_read(f.sandbox_id, "pids", "cgroup.procs").split()
            assert str(f.data["pid"]) in procs
        assert "me" not in (await run(driver, src, "ls /root")).stdout.split()
        assert await ask(driver, src) == (secret, n0 + 1)
        for f in forks:
            await driver.destroy(f)
    finally:
        await asyncio.to_thread(subprocess.run, ["ip", "netns", "del", ns], check=False)


async def test_errors_carry_the_log(driver: ContainerDriver, create: CreateFn,
                                    tmp_path: Path) -> None:
    handle = await create()
    # A wrong freezer: the pre-dump hook fails, CRIU gives up, the sandbox runs on.
    with pytest.raises(AenvError) as err:
        await ck.dump(handle.data["pid"], tmp_path / "img", freezer=tmp_path / "nofreezer",
                      leave_running=True)
    assert err.value.code == ErrorCode.INTERNAL
    assert str(tmp_path / "img" / ck.DUMP_LOG) in err.value.message
    assert "Error" in err.value.message
    assert linux.proc_start_time(handle.data["pid"]) == handle.data["start_time"]
    assert (await run(driver, handle, "echo ok")).stdout == "ok\n"
    # An image directory with no image.
    ws = tmp_path / "ws"
    (ws / "upper").mkdir(parents=True)
    with pytest.raises(AenvError) as err:
        await ck.restore(tmp_path / "empty", workspace=ws, lower=[driver.driver_layer],
                         cgroup_dirs=())
    assert err.value.code == ErrorCode.INTERNAL
    assert "restore.log" in err.value.message
    assert not (ws / ck.ROOTFS).exists()


# ------------------------------------------------------------------ numbers


def _ms(values: list[float]) -> str:
    return f"p50 {statistics.median(values) * 1e3:.0f} ms (n={len(values)})"


@pytest.mark.slow
async def test_bench_idle(driver: ContainerDriver, create: CreateFn, restore_new: RestoreFn,
                          rootfs: Path, tmp_path: Path) -> None:
    """Timings for an idle sandbox (envd only), printed with -s."""
    frozen: list[float] = []
    dumps: list[float] = []
    pauses: list[float] = []
    resumes: list[float] = []
    forks: dict[int, list[float]] = {1: [], 4: [], 16: []}
    image = tmp_path / "snap-0"
    for i in range(3):
        src = await create()
        ws = Path(src.data["workspace"])
        stats = await ck.dump(src.data["pid"], tmp_path / f"snap-{i}",
                              freezer=freezer(src.sandbox_id), leave_running=True,
                              upper=ws / "upper")
        frozen.append(stats.frozen_s)
        dumps.append(stats.total_s)
        stats = await ck.dump(src.data["pid"], tmp_path / f"pause-{i}",
                              freezer=freezer(src.sandbox_id), leave_running=False)
        pauses.append(stats.total_s)
        forget(driver, src.sandbox_id)
        t0 = time.monotonic()
        res = await ck.restore(tmp_path / f"pause-{i}", workspace=ws,
                               lower=[driver.driver_layer, rootfs],
                               cgroup_dirs=ck.cgroup_dirs(driver.cgroups, src.sandbox_id))
        resumes.append(time.monotonic() - t0)
        src.data |= {"pid": res.pid, "start_time": res.start_time}
        await driver.destroy(src)
    for n, runs in ((1, 3), (4, 3), (16, 2)):
        for _ in range(runs):
            t0 = time.monotonic()
            made = await asyncio.gather(*[restore_new(image) for _ in range(n)])
            forks[n].append(time.monotonic() - t0)
            for h in made:
                await driver.destroy(h)
    print(f"\nidle sandbox, CRIU {await ck.check_criu()}:\n"
          f"  snapshot: source frozen {_ms(frozen)}, total {_ms(dumps)}\n"
          f"  pause (dump + kill): {_ms(pauses)}\n"
          f"  resume -> envd ready: {_ms(resumes)}\n"
          + "".join(f"  fork x{n} -> all envds ready: {_ms(v)}\n" for n, v in forks.items()))



@pytest.mark.slow
async def test_an_image_restores_with_the_runtime_bundle_it_was_taken_with(
        rootfs: Path, tmp_path: Path) -> None:
    """A paused sandbox's processes have the runtime bundle's files mapped; CRIU restores
    them only with those exact files. A rebuild of the bundle (an upgrade of envd) keeps the
    version it replaces, and the restore finds it; if it is gone, the error says so."""
    bundle = tmp_path / "py311"
    await asyncio.to_thread(subprocess.run, ["cp", "-al", str(pybundle.BUNDLE_DIR), str(bundle)],
                            check=True)
    # Make the copy an "older build": one file differs from what a build now writes.
    manifest = (bundle / pybundle.MANIFEST)
    data = json.loads(manifest.read_text())
    rel = "app/aenv/envd/__init__.py"
    data["files"][rel][2] -= 1
    manifest.unlink()  # a hard link to the real bundle's manifest: write a file of our own
    manifest.write_text(json.dumps(data))
    old_version = pybundle.bundle_id(bundle)
    assert old_version is not None
    home = tmp_path / "home"
    home.mkdir()
    config = Config()
    config.server.home = home
    drv = ContainerDriver(config, bundle=bundle, build_bundle=False,
                          warm_processes=1, ready_pool=0)
    await drv.start()
    handle = None
    try:
        handle = await drv.create(spec_for(home, rootfs, allow_internet_access=False))
        await run(drv, handle, "echo kept > /root/file")
        paused = await drv.pause(handle)
        images = Path(paused.data["images"])
        assert (images / ck.BUNDLE_MARK).read_text() == old_version

        report = await asyncio.to_thread(pybundle.build, bundle)  # the upgrade
        assert report.copied >= 1
        archive = pybundle.archived(bundle, old_version)
        assert pybundle.bundle_id(bundle) != old_version
        assert pybundle.bundle_id(archive) == old_version

        spec = spec_for(home, rootfs, allow_internet_access=False,
                        sandbox_id=handle.sandbox_id)
        handle = await drv.resume(paused, spec)
        r = await run(drv, handle, "cat /root/file")
        assert r.stdout == "kept\n"
        mounts = Path(f"/proc/{handle.data['pid']}/mountinfo").read_text()
        assert f"py311-{old_version}" in mounts  # the archived files, not the rebuilt ones

        paused = await drv.pause(handle)
        await asyncio.to_thread(subprocess.run, ["rm", "-rf", str(archive)], check=True)
        with pytest.raises(AenvError) as err:
            await drv.resume(paused, spec)
        assert err.value.code is ErrorCode.UNAVAILABLE
        assert "no longer installed" in err.value.message
        handle = paused
    finally:
        if handle is not None:
            await drv.destroy(handle)
        await drv.close()


@pytest.mark.slow
async def test_checkpoints_of_a_shell_loop_spawning_commands(driver: ContainerDriver,
                                                            create: CreateFn, rootfs: Path,
                                                            home: Path) -> None:
    """A shell forever spawning commands is, much of the time, a parent waiting in vfork for
    a child that has not exec'd yet: frozen then, the parent can be neither frozen nor
    seized by CRIU. Every pause and snapshot must still succeed (the freeze is retried
    until no task sits in vfork), and the loop keeps going."""
    handle = await create()
    await run(driver, handle, "(nohup sh -c 'while :; do /bin/true; echo x >> /root/n; done' "
                              ">/dev/null 2>&1 &)")
    await asyncio.sleep(0.3)
    sid = handle.sandbox_id
    for _ in range(10):
        paused = await driver.pause(handle)
        handle = await driver.resume(paused, spec_for(home, rootfs, sandbox_id=sid,
                                                      allow_internet_access=False))
    before = int((await run(driver, handle, "wc -l < /root/n")).stdout)
    await asyncio.sleep(0.2)
    assert int((await run(driver, handle, "wc -l < /root/n")).stdout) > before  # still looping
    for i in range(5):
        stats = await driver.snapshot(handle, home / "snapshots" / f"{sid}-{i}")
        assert stats["frozen_s"] < 2.0


async def test_a_sandbox_being_restored_weighs_more_on_the_cpu(driver: ContainerDriver,
                                                                create: CreateFn, rootfs: Path,
                                                                home: Path) -> None:
    """While criu restores a sandbox (and until its envd has answered), its cpu cgroup has a
    large weight, so restores in flight run ahead of busy running sandboxes; afterwards it
    weighs as much as any other sandbox. Its tasks are in its own cgroups (criu entered
    them itself: CRIU_ENTER_CGROUPS)."""
    handle = await create()
    sid = handle.sandbox_id
    paused = await driver.pause(handle)
    seen: set[str] = set()
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            seen.add(cgroup_read(sid, "cpu", "cpu.shares").strip())
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch())
    try:
        handle = await driver.resume(paused, spec_for(home, rootfs, sandbox_id=sid,
                                                      allow_internet_access=False))
    finally:
        done.set()
        await watcher
    assert "16384" in seen
    assert cgroup_read(sid, "cpu", "cpu.shares").strip() == "1024"
    for controller in ("memory", "cpu", "pids", "freezer"):
        assert str(handle.data["pid"]) in cgroup_read(sid, controller, "cgroup.procs").split()
    assert (await run(driver, handle, "echo alive")).stdout.strip() == "alive"



def _resident_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        if line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError(f"no Rss for {pid}")


def _ballast_pid(sandbox_id: str) -> int:
    for pid in cgroup_read(sandbox_id, "pids", "cgroup.procs").split():
        with contextlib.suppress(OSError):
            if b"bytearray" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
    raise AssertionError("the ballast process is not running")


@pytest.mark.slow
async def test_a_resumed_process_holds_no_more_memory_than_before(
        driver: ContainerDriver, create: CreateFn, rootfs: Path, home: Path) -> None:
    """The restore populates exactly the page ranges in the image (our CRIU patch's
    MADV_POPULATE_WRITE per range): a process comes back with the memory it had, not more."""
    handle = await create()
    sid = handle.sandbox_id
    await run(driver, handle, "(nohup python3 -c 'import time; b = bytearray(64 << 20); "
                              "b[::4096] = b\"x\" * len(b[::4096]); time.sleep(1e9)' "
                              ">/dev/null 2>&1 &); sleep 1")
    before = _resident_kib(_ballast_pid(sid))
    assert before > 64 << 10
    paused = await driver.pause(handle)
    handle = await driver.resume(paused, spec_for(home, rootfs, sandbox_id=sid,
                                                  allow_internet_access=False))
    after = _resident_kib(_ballast_pid(sid))
    # Not more; a little less is normal (file pages, such as libraries, fault back in on
    # use); the 64 MiB are back.
    assert 64 << 10 <= after <= before + 1024, (before, after)


@pytest.mark.slow
async def test_a_sandbox_root_is_volatile_and_is_mounted_again_after_each_pause(
        driver: ContainerDriver, create: CreateFn, rootfs: Path, home: Path) -> None:
    """The overlay root is `volatile` (no syncfs of the whole upper filesystem at each
    unmount: a pause's criu would wait for it); overlayfs flags such a work dir, and a
    resume mounts it again (twice here, straight after each pause) all the same."""
    handle = await create()
    sid = handle.sandbox_id
    spec = spec_for(home, rootfs, sandbox_id=sid, allow_internet_access=False)
    await run(driver, handle, "echo kept > /root/f")
    for _ in range(2):
        root = Path(f"/proc/{handle.data['pid']}/mountinfo").read_text().splitlines()
        assert any(" / / " in line and "volatile" in line for line in root), root
        handle = await driver.resume(await driver.pause(handle), spec)
        assert (await run(driver, handle, "cat /root/f")).stdout == "kept\n"
    assert (Path(handle.data["workspace"]) / "work" / "work" / "incompat" / "volatile").is_dir()


def _dirty_pages(path: Path) -> int:
    """Dirty page-cache pages of a file, by cachestat(2) (Linux 6.5)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    whole = (ctypes.c_uint64 * 2)(0, 0)  # offset 0, length 0: to the end
    stat = (ctypes.c_uint64 * 5)()
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.syscall(451, fd, ctypes.byref(whole), ctypes.byref(stat), 0) != 0:
            raise OSError(ctypes.get_errno(), "cachestat")
    finally:
        os.close(fd)
    return int(stat[1])


@pytest.mark.slow
async def test_a_paused_sandbox_is_on_disk_a_moment_after_its_pause(
        driver: ContainerDriver, create: CreateFn) -> None:
    """With volatile overlays nothing syncs a workspace by itself: the driver writes a
    paused sandbox's image out once it has stayed paused PAUSED_SYNC_DELAY_S."""
    from aenv.runtime.container.driver import PAUSED_SYNC_DELAY_S

    handle = await create()
    await run(driver, handle, "(nohup python3 -c 'import os, time; "
                              "b = bytearray(os.urandom(1)) * (16 << 20); time.sleep(1e9)' "
                              ">/dev/null 2>&1 &); sleep 0.5")
    paused = await driver.pause(handle)
    pages = max(Path(paused.data["images"]).glob("pages-*.img"), key=lambda p: p.stat().st_size)
    assert _dirty_pages(pages) > 0  # just written, in the page cache
    await asyncio.sleep(PAUSED_SYNC_DELAY_S + 1.0)
    assert _dirty_pages(pages) == 0
