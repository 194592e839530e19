"""The qemu runtime driver against real microVMs (TCG or KVM, whichever the host allows)."""

from __future__ import annotations

import asyncio
import contextlib
import platform
import shutil
import socket
import time
from pathlib import Path

import pytest
from conftest import CreateFn, make_driver
from net_helpers import in_netns, outside_host
from vm_helpers import run, spec_for

from aenv.errors import AenvError, ErrorCode
from aenv.runtime.base import PausableDriver, RuntimeDriver, SnapshotDriver
from aenv.runtime.container.linux import proc_start_time
from aenv.runtime.qemu.driver import QemuDriver
from aenv.runtime.registry import load_driver

pytestmark = pytest.mark.slow


def tok(handle_id: str) -> str:
    return f"token-{handle_id}"


async def test_protocols_and_registry(driver: QemuDriver, home: Path) -> None:
    assert isinstance(driver, RuntimeDriver)
    assert isinstance(driver, PausableDriver)
    assert isinstance(driver, SnapshotDriver)
    assert driver.accel in ("kvm", "tcg")
    assert isinstance(load_driver("qemu", driver.config), QemuDriver)


async def test_boot_runs_its_own_kernel(driver: QemuDriver, create: CreateFn) -> None:
    handle = await create()
    sid = handle.sandbox_id
    assert handle.data["accel"] == driver.accel
    res = await run(driver, handle, "uname -r; hostname; cat /proc/1/cmdline | tr '\\0' ' '",
                    token=tok(sid))
    assert res.exit_code == 0, res.stderr
    kernel, hostname, init = res.stdout.splitlines()[:3]
    assert kernel != platform.release()  # the host runs 6.18
    assert kernel.startswith("6.1.") and "amd64" in kernel
    assert hostname == sid
    assert "guest.py" in init  # PID 1 is our guest init, which became envd
    # The access token is never on the kernel command line (world-readable in the guest).
    res = await run(driver, handle, "cat /proc/cmdline", token=tok(sid))
    assert tok(sid) not in res.stdout
    usage = await driver.stats(handle)
    assert usage.mem_total_bytes == 512 * 2**20
    assert 0 < usage.mem_used_bytes < 2 * 512 * 2**20


async def test_qemu_runs_under_its_own_seccomp_filter(driver: QemuDriver,
                                                     create: CreateFn) -> None:
    """`-sandbox` (boot.SANDBOX): a QEMU exploited from its guest cannot mount, reboot,
    load modules or kexec; pause/resume and fork (exec:cat migrations) still work with it."""
    handle = await create()
    status = Path(f"/proc/{handle.data['pid']}/status").read_text()
    assert "-sandbox" in Path(f"/proc/{handle.data['pid']}/cmdline").read_text()
    assert [line.split()[1] for line in status.splitlines()
            if line.startswith("Seccomp:")] == ["2"], status


async def test_cold_boot_and_boot_snapshot(driver: QemuDriver, home: Path,
                                           rootfs: Path) -> None:
    """A create restores the boot snapshot of its shape; a cold boot gives the same guest."""
    cold = await driver._boot(spec_for(home, rootfs))
    try:
        warm = await driver.create(spec_for(home, rootfs))
        try:
            assert driver.last_timings.get("boot_snapshot") == 1.0
            outs = [await run(driver, h, "uname -r; hostname", token=tok(h.sandbox_id))
                    for h in (cold, warm)]
            assert outs[0].stdout.split()[0] == outs[1].stdout.split()[0]
            assert [o.stdout.split()[1] for o in outs] == [cold.sandbox_id, warm.sandbox_id]
        finally:
            await driver.destroy(warm)
    finally:
        await driver.destroy(cold)


async def test_connect_to_a_closed_port(driver: QemuDriver, create: CreateFn) -> None:
    handle = await create()
    with pytest.raises(AenvError) as exc:
        await driver.connect(handle, 4321)
    assert exc.value.code is ErrorCode.PORT_CLOSED
    await run(driver, handle, "nohup python3 -m http.server 4321 >/dev/null 2>&1 &",
              token=tok(handle.sandbox_id))
    for _ in range(100):
        try:
            sock = await driver.connect(handle, 4321)
        except AenvError:
            await asyncio.sleep(0.2)
            continue
        sock.close()
        break
    else:
        raise AssertionError("a user port never became reachable")


async def test_envd_requires_the_token(driver: QemuDriver, create: CreateFn) -> None:
    handle = await create()
    with pytest.raises(AssertionError):
        await run(driver, handle, "true", token="wrong")


async def test_host_files_are_not_visible(driver: QemuDriver, create: CreateFn,
                                          tmp_path: Path) -> None:
    marker = tmp_path / "host-secret"
    marker.write_text("secret")
    handle = await create()
    res = await run(driver, handle, f"test -e {marker} && echo visible; "
                    "test -e /work && echo work; ls /opt/aenv/runtime/py311 | wc -l",
                    token=tok(handle.sandbox_id))
    assert "visible" not in res.stdout and "work" not in res.stdout
    assert res.stdout.split()[-1] == "0"  # the host's Python bundle is not there


async def test_network_off_and_on(driver: QemuDriver, create: CreateFn) -> None:
    # An outside host (a namespace on this machine, behind the host's masquerade) is
    # reachable only with internet access; the host itself never is, not even at the
    # bridge's address (the guest's traffic leaves through a network slot like a container's).
    await driver.networks._ensure_pool()
    host = driver.networks.pool.host_address

    def listen(address: str) -> socket.socket:
        srv = socket.socket()
        srv.bind((address, 0))
        srv.listen(8)
        return srv

    def probe(address: str, port: int) -> str:
        return (f"python3 -c \"import socket; socket.create_connection(('{address}', {port}), 5);"
                " print('reached')\"")

    with outside_host() as outside:
        srv = in_netns(outside.netns, lambda: listen(outside.address))
        on_host = listen(host)
        port, host_port = srv.getsockname()[1], on_host.getsockname()[1]
        try:
            off, on = await asyncio.gather(create(allow_internet_access=False),
                                           create(allow_internet_access=True))
            res_off = await run(driver, off, probe(outside.address, port),
                                token=tok(off.sandbox_id))
            res_on = await run(driver, on, probe(outside.address, port),
                               token=tok(on.sandbox_id))
            res_host = await run(driver, on, probe(host, host_port), token=tok(on.sandbox_id))
        finally:
            srv.close()
            on_host.close()
    assert "reached" not in res_off.stdout
    assert "reached" in res_on.stdout, res_on.stderr
    assert "reached" not in res_host.stdout and "refused" in res_host.stderr, res_host


SPOOF = """
import socket, struct, sys
def checksum(data):
    total = sum(struct.unpack("!10H", data))
    total = (total & 0xFFFF) + (total >> 16)
    return ~(total + (total >> 16)) & 0xFFFF
dst, port = sys.argv[1], int(sys.argv[2])
raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)  # IP_HDRINCL
for src in sys.argv[3:]:
    udp = struct.pack("!HHHH", 40000, port, 8 + len(src), 0) + src.encode()
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                     socket.inet_aton(src), socket.inet_aton(dst))
    ip = ip[:10] + struct.pack("!H", checksum(ip)) + ip[12:]
    for _ in range(3):
        raw.sendto(ip + udp, (dst, 0))
honest = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
honest.sendto(b"honest", (dst, port))
"""


async def test_guest_cannot_send_spoofed_sources(driver: QemuDriver, create: CreateFn) -> None:
    """The guest's root has raw sockets (its own kernel); what it forges must still not leave
    its network slot: the host's per-port rules bind the slot to its address."""
    with outside_host() as outside:
        listener = in_netns(outside.netns,
                            lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
        listener.bind((outside.address, 0))
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        try:
            vm = await create(allow_internet_access=True)
            await run(driver, vm, f"cat > /tmp/spoof.py <<'EOF'\n{SPOOF}EOF",
                      token=tok(vm.sandbox_id))
            # Another sandbox's address, and one of the internet's (a reflection attack).
            spoofed = ("10.88.255.254", "203.0.113.9")
            res = await run(driver, vm, f"python3 /tmp/spoof.py {outside.address} {port} "
                            + " ".join(spoofed), token=tok(vm.sandbox_id))
            assert res.exit_code == 0, res.stderr
            heard: list[tuple[str, bytes]] = []
            with contextlib.suppress(TimeoutError):
                while True:
                    data, peer = listener.recvfrom(2048)
                    heard.append((peer[0], data))
        finally:
            listener.close()
    # Control: the guest's honest datagram arrived, masqueraded behind the host.
    assert (outside.host_address, b"honest") in heard, heard
    assert not [h for h in heard if h[1] != b"honest"], heard


async def test_pause_resume_keeps_processes(driver: QemuDriver, create: CreateFn,
                                            home: Path, rootfs: Path) -> None:
    handle = await create()
    sid = handle.sandbox_id
    await run(driver, handle, "nohup bash -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/n; "
              "sleep 0.1; done' >/dev/null 2>&1 &", token=tok(sid))
    await asyncio.sleep(1)
    before = int((await run(driver, handle, "cat /tmp/n", token=tok(sid))).stdout)
    pid = int(handle.data["pid"])
    paused = await driver.pause(handle)
    assert paused.data["pid"] is None
    assert proc_start_time(pid) is None  # no QEMU process (at most a zombie): no memory held
    await asyncio.sleep(1)
    resumed = await driver.resume(paused, spec_for(home, rootfs, sandbox_id=sid))
    handle.data.clear()
    handle.data.update(resumed.data)  # the fixture destroys the live one
    first = int((await run(driver, resumed, "cat /tmp/n", token=tok(sid))).stdout)
    await asyncio.sleep(1)
    second = int((await run(driver, resumed, "cat /tmp/n", token=tok(sid))).stdout)
    assert before <= first < second  # the same counter, still counting
    # The guest clock was set to the host's on resume.
    guest = float((await run(driver, resumed, "date +%s.%N", token=tok(sid))).stdout)
    assert abs(guest - time.time()) < 5


async def test_snapshot_and_fork_children_are_independent(
        driver: QemuDriver, create: CreateFn, home: Path, rootfs: Path) -> None:
    parent = await create()
    psid = parent.sandbox_id
    await run(driver, parent, "echo from-parent > /root/file; nohup sleep 1000 >/dev/null 2>&1 &",
              token=tok(psid))
    images = home / "images" / psid
    timings = await driver.snapshot(parent, images)
    assert timings["frozen_s"] < 5
    kids = []
    try:
        specs = [spec_for(home, rootfs) for _ in range(2)]
        kids = list(await asyncio.gather(*[driver.restore(s, images, tok(psid)) for s in specs]))
        outs = []
        for kid in kids:
            ksid = kid.sandbox_id
            res = await run(driver, kid, "cat /root/file; hostname; pgrep -c -x sleep; "
                            "head -c 16 /dev/urandom | od -An -tx1", token=tok(ksid))
            assert res.exit_code == 0, res.stderr
            outs.append(res.stdout.splitlines())
            # The new identity is in the files too (bind mounts of files on the guest's /run).
            res = await run(driver, kid, "cat /etc/hostname; grep -c -w " + ksid + " /etc/hosts; "
                            "grep -c ' /etc/hostname ' /proc/self/mountinfo", token=tok(ksid))
            assert res.stdout.split() == [ksid, "1", "1"], res.stdout
            await run(driver, kid, f"echo {ksid} > /root/file", token=tok(ksid))
        for kid, out in zip(kids, outs):
            assert out[0] == "from-parent" and out[1] == kid.sandbox_id and out[2] == "1"
        assert outs[0][3] != outs[1][3]  # fresh entropy per child
        for kid in kids:
            res = await run(driver, kid, "cat /root/file", token=tok(kid.sandbox_id))
            assert res.stdout.strip() == kid.sandbox_id
        res = await run(driver, parent, "cat /root/file", token=tok(psid))
        assert res.stdout.strip() == "from-parent"
        # The old token does not work on a child any more.
        with pytest.raises(AssertionError):
            await run(driver, kids[0], "true", token=tok(psid))
        # A child (its RAM a copy-on-write mapping of the snapshot) pauses and resumes too.
        kid = kids[0]
        paused = await driver.pause(kid)
        kids[0] = await driver.resume(paused, specs[0])
        res = await run(driver, kids[0], "cat /root/file; pgrep -c -x sleep",
                        token=tok(kid.sandbox_id))
        assert res.stdout.split() == [kid.sandbox_id, "1"]
    finally:
        for kid in kids:
            await driver.destroy(kid)
        shutil.rmtree(images, ignore_errors=True)


async def test_balloon_returns_freed_memory(driver: QemuDriver, create: CreateFn) -> None:
    handle = await create()
    sid = handle.sandbox_id
    idle = (await driver.memory(handle))["Rss"]
    script = ("python3 -c \"b = bytearray(256 << 20); "
              "[b.__setitem__(i, 1) for i in range(0, len(b), 4096)]\"")
    await run(driver, handle, script, token=tok(sid))
    peak = (await driver.memory(handle))["Rss"]
    assert peak > idle + 200 * 2**20
    deadline = time.monotonic() + 30
    now = peak
    while time.monotonic() < deadline:
        await asyncio.sleep(1)
        now = (await driver.memory(handle))["Rss"]
        if now < peak - 150 * 2**20:
            break
    assert now < peak - 150 * 2**20, (idle, peak, now)


async def test_attach_after_driver_restart(driver: QemuDriver, create: CreateFn,
                                           home: Path) -> None:
    handle = await create()
    other = make_driver(home)
    await other.start()
    try:
        assert await other.attach(handle)
        res = await run(other, handle, "echo ok", token=tok(handle.sandbox_id))
        assert res.stdout.strip() == "ok"
    finally:
        await other.close()


async def test_destroy_is_idempotent_and_complete(driver: QemuDriver, home: Path,
                                                   rootfs: Path) -> None:
    handle = await driver.create(spec_for(home, rootfs))
    pid = int(handle.data["pid"])
    await driver.destroy(handle)
    await driver.destroy(handle)
    assert proc_start_time(pid) is None
    assert not Path(handle.data["vm"]).exists()
    assert not Path(handle.data["netns"]).exists()
    assert not Path(handle.data["ram"]).exists()
    with pytest.raises(AenvError):
        await driver.connect(handle, 49983)
