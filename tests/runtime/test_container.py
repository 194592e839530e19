"""The container runtime driver against the real kernel: namespaces, cgroup v1, overlayfs,
the fork-server and network slots. Commands inside sandboxes run through the sandbox's own
envd, reached with `ContainerDriver.connect()`.

Every isolation check has a positive control, so that a broken probe cannot pass.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import CreateFn, make_config
from net_helpers import in_netns, outside_host
from runtime_helpers import cgroup_read, spec_for
from sandbox_helpers import http, new_id, run

from aenv.errors import AenvError, ErrorCode
from aenv.runtime.base import RuntimeDriver, RuntimeHandle, SandboxSpec
from aenv.runtime.container.checkpoint import CRIU
from aenv.runtime.container.driver import ContainerDriver
from aenv.runtime.container.network import BRIDGE_MAC
from aenv.runtime.pybundle import BUNDLE_DIR

CONTROLLERS = ("memory", "cpu", "cpuacct", "pids", "freezer", "devices")


def cgroup_dirs(sandbox_id: str) -> list[Path]:
    return [Path("/sys/fs/cgroup") / c / "aenv" / sandbox_id for c in CONTROLLERS]


# ------------------------------------------------------------------ lifecycle


async def test_protocol(driver: ContainerDriver) -> None:
    assert isinstance(driver, RuntimeDriver)
    assert driver.name == "container"


async def test_create_connect_destroy(driver: ContainerDriver, create: CreateFn) -> None:
    handle = await create(memory_mb=300, cpu_count=2, pids_max=300)
    assert handle.driver == "container" and handle.data["pid"] > 1
    status, _, _ = await http(driver, handle, "GET", "/health")
    assert status == 204
    sid = handle.sandbox_id
    assert all(d.is_dir() for d in cgroup_dirs(sid))
    assert cgroup_read(sid, "memory", "memory.limit_in_bytes").strip() == str(300 * 2**20)
    assert cgroup_read(sid, "cpu", "cpu.cfs_quota_us").strip() == "200000"
    assert cgroup_read(sid, "cpu", "cpu.cfs_period_us").strip() == "100000"
    assert cgroup_read(sid, "pids", "pids.max").strip() == "300"
    init = str(handle.data["pid"])
    for ctrl in CONTROLLERS:
        assert init in cgroup_read(sid, ctrl, "cgroup.procs").split()
    workspace = Path(handle.data["workspace"])
    assert (workspace / "upper").is_dir()

    await driver.destroy(handle)
    assert not Path(f"/proc/{init}").exists()
    assert not any(d.exists() for d in cgroup_dirs(sid))
    assert not workspace.exists()
    with pytest.raises(AenvError) as err:
        await driver.connect(handle, 49983)
    assert err.value.code == ErrorCode.UNAVAILABLE
    assert not await driver.attach(handle)
    await driver.destroy(handle)  # idempotent


async def test_bad_specs_are_rejected(driver: ContainerDriver, create: CreateFn,
                                      tmp_path: Path) -> None:
    with pytest.raises(AenvError) as err:
        await create(sandbox_id="Not/AnId")
    assert err.value.code == ErrorCode.INVALID_ARGUMENT
    with pytest.raises(AenvError) as err:
        await create(lower_layers=(tmp_path / "missing",))
    assert err.value.code == ErrorCode.INVALID_ARGUMENT
    handle = await create()
    with pytest.raises(AenvError) as err:
        await create(sandbox_id=handle.sandbox_id)
    assert err.value.code == ErrorCode.CONFLICT


async def test_failed_setup_leaves_nothing(driver: ContainerDriver, create: CreateFn,
                                           tmp_path: Path) -> None:
    sid = new_id()
    empty = tmp_path / "empty-layer"  # no /bin, /etc: envd cannot even find its log dir
    empty.mkdir()
    (tmp_path / "ws").write_text("a file where the workspace directory should be")
    with pytest.raises(AenvError) as err:
        await create(sandbox_id=sid, lower_layers=(empty,), workspace=tmp_path / "ws")
    assert err.value.code == ErrorCode.INTERNAL
    assert not any(d.exists() for d in cgroup_dirs(sid))


async def test_envd_is_pid1_on_the_bundled_python(driver: ContainerDriver,
                                                  create: CreateFn) -> None:
    handle = await create()
    r = await run(driver, handle, "cat /proc/1/comm; echo $$")
    comm, shell_pid = r.stdout.split()
    assert comm == "envd"
    assert int(shell_pid) > 1
    pid = handle.data["pid"]
    assert os.readlink(f"/proc/{pid}/exe") == f"{BUNDLE_DIR}/lib/ld-linux-x86-64.so.2"
    # Every file init maps lies in the read-only bundle, visible at the same path inside
    # (what CRIU needs), and no stray fd survived from the fork-server.
    mapped = {line.split()[5] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
              if len(line.split()) > 5 and line.split()[5].startswith("/")}
    assert mapped and all(p.startswith(f"{BUNDLE_DIR}/") for p in mapped), mapped
    r = await run(driver, handle, "for f in $(awk '{print $6}' /proc/1/maps | grep ^/ | sort -u);"
                  " do test -e $f || echo missing $f; done; grep ' /opt/aenv/runtime/py311 '"
                  " /proc/mounts")
    assert "missing" not in r.stdout and " ro," in r.stdout, r.stdout
    targets = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    files = [t for t in targets if t.startswith("/")]
    assert sorted(set(files)) == ["/dev/null", "/run/aenv/envd.log"], targets
    assert all(t.startswith(("socket:", "anon_inode:", "pipe:", "/")) for t in targets)


# ------------------------------------------------------------------ isolation


async def test_no_host_processes(driver: ContainerDriver, create: CreateFn) -> None:
    marker = f"aenv-host-marker-{uuid.uuid4().hex}"
    host = await asyncio.create_subprocess_exec(sys.executable, "-c",
                                                "import time; time.sleep(60)", marker)
    try:
        handle = await create()
        r = await run(driver, handle, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '; echo;"
                      " ls /proc | grep -c '^[0-9]'")
        assert marker not in r.stdout
        assert "envd" in (await run(driver, handle, "ps -eo comm")).stdout
        assert int(r.stdout.split()[-1]) < 10  # init, the shell, cat...: nothing else
        assert marker.encode() in Path(f"/proc/{host.pid}/cmdline").read_bytes()  # control
    finally:
        host.kill()
        await host.wait()


async def test_sandboxes_cannot_see_each_other(driver: ContainerDriver,
                                               create: CreateFn) -> None:
    a, b = await asyncio.gather(create(), create())
    token = uuid.uuid4().hex
    r = await run(driver, a, f"echo {token} > /tmp/mine; (exec -a sleeper-{token} sleep 60 &);"
                  f" sleep 0.2; cat /tmp/mine; cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
    assert r.stdout.count(token) >= 2  # control: visible in its own sandbox
    # (The probe's own text must not contain the token.)
    r = await run(driver, b, "cat /tmp/mine; cat /proc/[0-9]*/cmdline | tr '\\0' ' ';"
                  " cat /tmp/* 2>/dev/null; hostname")
    assert token not in r.stdout and b.sandbox_id in r.stdout
    # The file lives in a's upper dir on the host, nowhere in b's.
    assert (Path(a.data["workspace"]) / "upper/tmp/mine").read_text().strip() == token
    assert not (Path(b.data["workspace"]) / "upper/tmp/mine").exists()
    # No network path between two sandboxes without internet access.
    r = await run(driver, b, "ls /sys/class/net")
    assert r.stdout.split() == ["lo"]


async def test_host_files_are_not_reachable(driver: ContainerDriver, create: CreateFn,
                                            home: Path) -> None:
    secret = home / f"secret-{uuid.uuid4().hex}"
    secret.write_text("host-only")
    handle = await create()
    probe = (f"cat {secret}; ls {home}; cat /proc/1/root{secret}; ls /proc/1/root/;"
             " cat /proc/1/root/etc/debian_version; mount -t proc x /mnt 2>&1;"
             " ls /sys/fs/cgroup/memory 2>&1 | head -3; echo $(ls /dev)")
    r = await run(driver, handle, probe)
    assert "host-only" not in r.stdout
    assert "No such file" in r.stderr
    assert "permission denied" in r.stdout.lower() or "must be superuser" in r.stdout
    devs = r.stdout.strip().splitlines()[-1].split()
    assert "null" in devs and "vda" not in devs and "sda" not in devs
    # Control: the same path is readable on the host.
    assert secret.read_text() == "host-only"
    # Device nodes: mknod works (CAP_MKNOD), opening a disk does not (devices cgroup).
    r = await run(driver, handle, "mknod /tmp/disk b 254 0 && head -c1 /tmp/disk; echo rc=$?")
    assert "rc=0" not in r.stdout, r


# (Files and directories this host has: /proc/kcore, /proc/scsi... do not exist here.)
MASK_PROBE = ("wc -c < /proc/keys; wc -c < /proc/timer_list; ls -A /proc/acpi | wc -l;"
              " ls -A /sys/firmware | wc -l; touch /proc/acpi/x 2>/dev/null || echo ro;"
              " echo $(ls /dev); findmnt -n -o FSTYPE /dev/shm; findmnt -n -o FSTYPE /dev/pts;"
              " echo hi > /dev/shm/f && cat /dev/shm/f; ls /dev/pts | head -1")


async def test_host_information_is_masked_and_dev_is_ours(driver: ContainerDriver,
                                                          create: CreateFn, home: Path,
                                                          rootfs: Path) -> None:
    """/proc and /sys entries with host information read empty (and stay read-only, also
    for root); /dev holds only the driver's nodes (not the template's), with its own devpts
    and /dev/shm tmpfs. The same after a checkpoint and restore."""
    handle = await create()
    devices = ["core", "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin",
               "stdout", "tty", "urandom", "zero"]
    expected = ["0", "0", "0", "0", "ro", *devices, "tmpfs", "devpts", "hi", "ptmx"]
    # Controls: on the host these are not empty.
    assert Path("/proc/timer_list").stat().st_size == 0  # procfs reports 0; read it instead
    assert len(Path("/proc/timer_list").read_text()) > 0 and any(Path("/sys/firmware").iterdir())
    r = await run(driver, handle, MASK_PROBE)
    assert r.stdout.split() == expected, r
    if not CRIU.exists():
        return
    paused = await driver.pause(handle)
    handle = await driver.resume(paused, spec_for(home, rootfs, sandbox_id=handle.sandbox_id,
                                                  allow_internet_access=False))
    r = await run(driver, handle, MASK_PROBE)
    assert r.stdout.split() == expected, r


async def test_hostname_and_loopback(driver: ContainerDriver, create: CreateFn) -> None:
    handle = await create()
    r = await run(driver, handle, "hostname; cat /etc/hostname; grep -c \"$(hostname)\" /etc/hosts;"
                  " cat /sys/class/net/lo/operstate;"
                  " exec 3<>/dev/tcp/127.0.0.1/49983 && echo loopback-ok")
    lines = r.stdout.split()
    assert lines[0] == handle.sandbox_id and lines[1] == handle.sandbox_id
    assert lines[2] == "1"
    assert lines[-1] == "loopback-ok"


async def test_connect_reaches_any_port(driver: ContainerDriver, create: CreateFn) -> None:
    handle = await create()
    with pytest.raises(AenvError) as err:
        await driver.connect(handle, 8080)
    assert err.value.code == ErrorCode.PORT_CLOSED  # running, but nothing listens there
    server = ("python3 -c 'import socket; s=socket.socket(); s.setsockopt(1, 2, 1);"
              " s.bind((\"127.0.0.1\", 8080)); s.listen(); c, _ = s.accept();"
              " c.sendall(b\"hello from inside\"); c.close()' >/dev/null 2>&1 &")
    await run(driver, handle, f"{server} sleep 0.5")
    sock = await driver.connect(handle, 8080)
    loop = asyncio.get_running_loop()
    data = await asyncio.wait_for(loop.sock_recv(sock, 100), 10)
    sock.close()
    assert data == b"hello from inside"
    assert sock.family == socket.AF_INET


# ------------------------------------------------------------------ limits


async def test_memory_hog_is_oom_killed_in_its_cgroup(driver: ContainerDriver,
                                                      create: CreateFn) -> None:
    handle = await create(memory_mb=96)
    sid = handle.sandbox_id
    # `tail` keeps the whole "line" in memory; /dev/zero has no newline.
    r = await run(driver, handle, "head -c 400M /dev/zero | tail > /dev/null; echo rc=$?")
    assert "rc=137" in r.stdout or "rc=141" in r.stdout, r
    assert cgroup_read(sid, "memory", "memory.max_usage_in_bytes").strip() == str(96 * 2**20)
    kills = dict(line.split() for line in cgroup_read(sid, "memory",
                                                      "memory.oom_control").splitlines())
    assert int(kills["oom_kill"]) >= 1
    # envd (pid 1) and the driver live on.
    assert (await http(driver, handle, "GET", "/health"))[0] == 204
    assert (await run(driver, handle, "echo still-alive")).stdout.strip() == "still-alive"


async def test_fork_bomb_is_stopped_by_pids_limit(driver: ContainerDriver,
                                                  create: CreateFn) -> None:
    handle = await create(pids_max=64)
    sid = handle.sandbox_id
    if (await run(driver, handle, "command -v python3")).exit_code != 0:
        pytest.skip("the rootfs has no python3")
    bomb = ("import os, time\n"
            "n = 0\n"
            "try:\n"
            "    while n < 1000:\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(60); os._exit(0)\n"
            "        n += 1\n"
            "except OSError as exc:\n"
            "    print('stopped', n, exc.errno, flush=True)\n"
            "os.killpg(0, 9)\n")
    r = await run(driver, handle, f"setsid python3 -c \"{bomb}\"; true", timeout=60)
    words = r.stdout.split()
    assert words[:1] == ["stopped"] and int(words[2]) == 11, r  # EAGAIN
    assert 30 < int(words[1]) < 64
    events = cgroup_read(sid, "pids", "pids.events")
    assert int(events.split()[-1]) > 0, events
    assert int(cgroup_read(sid, "pids", "pids.current")) <= 64
    assert (await http(driver, handle, "GET", "/health"))[0] == 204
    # A classic bomb is contained too, and destroy still kills everything.
    await run(driver, handle, "(bash -c ':(){ :|:& };:' &) ; sleep 2; true", timeout=30)
    assert int(cgroup_read(sid, "pids", "pids.current")) <= 64
    await driver.destroy(handle)
    assert not any(d.exists() for d in cgroup_dirs(sid))


async def test_stats(driver: ContainerDriver, create: CreateFn) -> None:
    handle = await create(memory_mb=128)
    first = await driver.stats(handle)
    assert first.mem_total_bytes == 128 * 2**20
    assert 0 < first.mem_used_bytes < first.mem_total_bytes
    assert first.disk_total_bytes == driver.config.sandbox.disk_size_mb * 2**20
    await run(driver, handle, "head -c 5M /dev/urandom > /root/blob; timeout 1 sh -c"
              " 'while :; do :; done'; true")
    second = await driver.stats(handle)
    assert second.disk_used_bytes >= first.disk_used_bytes + 5 * 2**20
    assert second.cpu_used_pct > 10  # the busy loop, measured since the first sample
    assert second.mem_cache_bytes > 0


# ------------------------------------------------------------------ network


def _listen_on_host(address: str) -> socket.socket:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((address, 0))
    srv.listen()
    srv.settimeout(10)
    return srv


async def test_internet_access_on_and_off(driver: ContainerDriver, create: CreateFn) -> None:
    online = await create(allow_internet_access=True)
    offline = await create(allow_internet_access=False)
    # "The internet" is a namespace on this machine behind the host's masquerade; the host
    # itself is not reachable from a sandbox (tests/security/test_network.py).
    with outside_host() as outside:
        srv = in_netns(outside.netns, lambda: _listen_on_host(outside.address))
        port = srv.getsockname()[1]
        probe = (f"timeout 5 bash -c 'exec 3<>/dev/tcp/{outside.address}/{port}"
                 " && echo connected'; echo rc=$?")
        try:
            accepted = asyncio.get_running_loop().run_in_executor(None, srv.accept)
            r = await run(driver, online, probe)
            assert "connected" in r.stdout, r
            conn, peer = await accepted
            conn.close()
            assert peer[0] == outside.host_address  # masqueraded
            r = await run(driver, offline, probe)
            assert "connected" not in r.stdout and "rc=0" not in r.stdout, r
            r = await run(driver, online, "ls /sys/class/net; cat /proc/net/fib_trie")
            assert "eth0" in r.stdout and online.data["address"] in r.stdout
        finally:
            srv.close()
    slot = online.data["slot"]
    assert (driver.network.netns_dir / slot).exists()
    await driver.destroy(online)
    for _ in range(100):  # slots are deleted in the background
        if not (driver.network.netns_dir / slot).exists():
            break
        await asyncio.sleep(0.05)
    assert not (driver.network.netns_dir / slot).exists()


async def test_sandboxes_with_internet_cannot_reach_each_other(driver: ContainerDriver,
                                                               create: CreateFn) -> None:
    a, b = await asyncio.gather(create(allow_internet_access=True),
                                create(allow_internet_access=True))
    server = ("python3 -c 'import socket; s=socket.socket(); s.setsockopt(1, 2, 1);"
              " s.bind((\"0.0.0.0\", 9000)); s.listen(); [s.accept() for _ in range(9)]'"
              " >/dev/null 2>&1 &")
    await run(driver, a, f"{server} sleep 0.5")
    # Control: the listener answers from the host, through the bridge.
    _, writer = await asyncio.wait_for(asyncio.open_connection(a.data["address"], 9000), 5)
    writer.close()
    probe = (f"timeout 3 bash -c 'exec 3<>/dev/tcp/{a.data['address']}/9000 && echo connected';"
             " echo rc=$?")
    r = await run(driver, b, probe)
    assert "connected" not in r.stdout, r


async def test_gateway_mac_survives_slot_churn(driver: ContainerDriver, create: CreateFn) -> None:
    """A bridge left to itself takes the lowest MAC of its ports and changes it when that
    port goes: every sandbox's neighbour entry for its gateway would go stale at once."""
    bridge = Path(f"/sys/class/net/{driver.network.bridge}/address")
    handles = [await create(allow_internet_access=True) for _ in range(3)]
    for handle in handles:
        await driver.destroy(handle)
    await create(allow_internet_access=True)
    assert bridge.read_text().strip() == BRIDGE_MAC


# ------------------------------------------------------------------ restart, scale


async def test_attach_after_driver_restart(driver: ContainerDriver, rootfs: Path,
                                           home: Path) -> None:
    first = ContainerDriver(make_config(home), warm_processes=1, build_bundle=False)
    await first.start()
    sid = new_id()
    spec = SandboxSpec(sandbox_id=sid, lower_layers=(rootfs,), workspace=home / "sandboxes" / sid,
                       cpu_count=1, memory_mb=128, pids_max=128, default_user="root",
                       allow_internet_access=True)
    handle = await first.create(spec)
    stored = RuntimeHandle(handle.driver, handle.sandbox_id, dict(handle.data))
    zygote = first._zygote.pid if first._zygote else 0  # test-only peek
    await first.close()  # the server goes away; the fork-server exits, the sandbox stays
    assert not Path(f"/proc/{zygote}").exists() or _zombie(zygote)
    second = ContainerDriver(make_config(home), warm_processes=1, build_bundle=False)
    await second.start()
    try:
        assert await second.attach(stored)
        assert (await http(second, stored, "GET", "/health"))[0] == 204
        r = await run(second, stored, "hostname")
        assert r.stdout.strip() == sid
        assert (await second.stats(stored)).mem_used_bytes > 0
        dead = RuntimeHandle("container", "x" * 20, {**stored.data, "start_time": 1})
        assert not await second.attach(dead)  # same pid, another start time: not ours
    finally:
        await second.destroy(stored)
        await second.close()
    assert not any(d.exists() for d in cgroup_dirs(sid))


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


async def test_sixteen_concurrent_creates(driver: ContainerDriver, create: CreateFn) -> None:
    started = time.monotonic()
    handles = await asyncio.gather(*[create() for _ in range(16)])
    elapsed = time.monotonic() - started
    statuses = await asyncio.gather(*[http(driver, h, "GET", "/health") for h in handles])
    assert [s[0] for s in statuses] == [204] * 16
    assert len({h.data["pid"] for h in handles}) == 16
    assert elapsed < 10
    await asyncio.gather(*[driver.destroy(h) for h in handles])
    assert not any(d.exists() for h in handles for d in cgroup_dirs(h.sandbox_id))


async def test_registry(driver: ContainerDriver, home: Path) -> None:
    from aenv.runtime.registry import load_driver

    assert isinstance(load_driver("container", make_config(home)), ContainerDriver)
    with pytest.raises(AenvError) as err:
        load_driver("firecracker-someday", make_config(home))
    assert err.value.code == ErrorCode.INVALID_ARGUMENT


async def test_layer_mounted_after_the_warm_pool_was_made(driver: ContainerDriver,
                                                          create: CreateFn, rootfs: Path,
                                                          tmp_path: Path) -> None:
    """Warm children copied the host's mounts earlier; a layer on a filesystem mounted since
    must still be seen (the fork-server retries in a fresh child)."""
    await asyncio.sleep(1)  # the warm pool is full
    layer = tmp_path / "late-layer"
    layer.mkdir()
    await asyncio.to_thread(subprocess.run, ["mount", "-t", "tmpfs", "-o", "size=1m", "late",
                                             str(layer)], check=True)
    try:
        (layer / "etc").mkdir()
        (layer / "etc/late-marker").write_text("mounted late\n")
        handle = await create(lower_layers=(layer, rootfs))
        assert driver.last_timings["zygote_warm"] == 0.0  # retried in a fresh child
        r = await run(driver, handle, "cat /etc/late-marker; cat /etc/debian_version")
        assert r.stdout.startswith("mounted late"), r
        await driver.destroy(handle)
        assert (await run(driver, await create(), "echo warm-again")).stdout == "warm-again\n"
    finally:
        await asyncio.to_thread(subprocess.run, ["umount", "-l", str(layer)], check=True)


async def test_fork_server_crash_is_survived(driver: ContainerDriver, create: CreateFn) -> None:
    before = await create()
    assert driver._zygote is not None  # test-only peek
    old = driver._zygote.pid
    os.kill(old, 9)
    for _ in range(100):
        if driver._zygote.dead:
            break
        await asyncio.sleep(0.02)
    # Running sandboxes do not care; the next create starts a new fork-server.
    assert (await http(driver, before, "GET", "/health"))[0] == 204
    after = await create()
    assert driver._zygote.pid != old
    assert (await http(driver, after, "GET", "/health"))[0] == 204
    await asyncio.sleep(0.5)
    leftovers = [p for p in Path("/sys/fs/cgroup/pids/aenv").glob(f"warm-{old}-*")]
    assert not leftovers
    assert not list(driver.staging.glob(f"warm-{old}-*"))


async def test_same_id_twice_concurrently(driver: ContainerDriver, create: CreateFn) -> None:
    sid = new_id()
    results = await asyncio.gather(create(sandbox_id=sid), create(sandbox_id=sid),
                                   return_exceptions=True)
    ok = [r for r in results if isinstance(r, RuntimeHandle)]
    errors = [r for r in results if isinstance(r, AenvError)]
    assert len(ok) == 1 and len(errors) == 1 and errors[0].code == ErrorCode.CONFLICT
    assert (await http(driver, ok[0], "GET", "/health"))[0] == 204
