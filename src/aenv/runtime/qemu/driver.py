"""`QemuDriver`: every sandbox a QEMU `microvm` with its own Linux kernel.

Owns: QEMU processes (each in its own session and network namespace, so they survive a server
restart), the files of a VM in its workspace (`disk.qcow2` overlay, `qmp.sock`, `ctl.sock`,
`qemu.pid`, `console.log`, `qemu.log`, `paused/`), guest RAM files under
/dev/shm/aenv-vm/<home hash>/ (tmpfs) and /run/aenv/vmram/<home hash>/ (a ramfs, see below),
boot snapshots under <home>/runtime/qemu/boot/, VM network namespaces (`network.py`), shared
root images (`images.py`).
Must not touch: the container runtime's processes and cgroups, the orchestrator's records.

Handle data (JSON): pid + start_time identify the QEMU process across pid reuse and restarts;
`vm` (the workspace), `artefacts` (the artefact directory this VM booted from: a rebuild of the
artefacts never strands it), `accel`, `netns`/`slot`, `ram`/`ram_shared`, `memory_mb`, `cpus`,
`envd_port`; `paused` (the device/migration stream) and `paused_ram` while paused.

Guest RAM is a `memory-backend-file` (share=on) on tmpfs, so a snapshot is: stop, migrate the
device state only (`x-ignore-shared`), copy the RAM file and the disk overlay, cont. A copy
restored from it maps that RAM file copy-on-write (share=off) and needs no RAM copy at all.
QEMU 7.2 discards free-reported pages of a file-backed RAM block by punching holes *in the
file*, also for private mappings, which would zero pages of the snapshot under every other
copy: so copies map a copy of the snapshot's RAM on a ramfs (no hole punching there: the
discard fails harmlessly), made once per snapshot image and unlinked as soon as the restores
using it have mapped it. Pause saves the RAM and the devices into the workspace and ends the
QEMU process, so a paused sandbox holds no memory.

Creates restore a boot snapshot of their shape (see `_boot_image`) unless
`runtime.qemu_boot_snapshot` is off; `_boot` is the cold path.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aenv.config import Config
from aenv.errors import AenvError, ErrorCode
from aenv.runtime import etc_files, pybundle
from aenv.runtime.base import ReadyShape, ResourceUsage, RuntimeHandle, SandboxSpec
from aenv.runtime.container import linux
from aenv.runtime.container.network import NetworkPool
from aenv.runtime.envd_init import init_body, post_init
from aenv.runtime.process import CLK_TCK, LiveProcess, kill_and_wait
from aenv.runtime.qemu import artefacts as artefacts_mod
from aenv.runtime.qemu import boot, images
from aenv.runtime.qemu.network import GUEST_ADDRESS, VmNetworks, open_netns
from aenv.runtime.qemu.qmp import Qmp

log = logging.getLogger(__name__)
IMAGE_FORMAT = 1  # of a snapshot directory (vm.json)
PAUSED_DISK = "disk.qcow2"  # in <vm>/paused/: the disk overlay as the pause left it
# QEMU 7.2 caps migration at 32 MiB/s by default: far too slow for a local file.
_MIGRATE_BANDWIDTH = 64 * 2**30


@dataclass
class _Live(LiveProcess):
    """The QEMU process (`cpu_used` in clock ticks) and the host's connections to it."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one QMP/ctl user at a time
    # Host ends of connections into the guest. A killed VM sends no FIN or RST, so destroy
    # and pause shut these down: streams through the proxy end at once instead of hanging.
    sockets: weakref.WeakSet[socket.socket] = field(default_factory=weakref.WeakSet)
    ctl: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    running_at: float = 0.0  # time.monotonic() when its vCPUs started (boot, or restore's `cont`)


def _close_ctl(live: _Live | None) -> None:
    if live is not None and live.ctl is not None:
        live.ctl[1].close()
        live.ctl = None


@dataclass
class _RamCopy:
    path: Path
    users: int = 0


class QemuDriver:
    """The `qemu` runtime driver. One per server process."""

    name = "qemu"

    def __init__(self, config: Config, *, vm_dir: Path = artefacts_mod.VM_DIR,
                 disk_cache: Path | None = None, create_timeout: float = 180.0,
                 network: NetworkPool | None = None, build_artefacts: bool = True) -> None:
        self.config = config
        self.vm_dir = vm_dir
        self.build_artefacts = build_artefacts
        self.state_dir = config.home / "runtime" / "qemu"
        # Per home (several servers may share a host), stable across server restarts.
        home_key = hashlib.sha256(str(config.home.resolve()).encode()).hexdigest()[:12]
        self.ram_dir = Path("/dev/shm/aenv-vm") / home_key
        # Outside the home: a mount there would keep the home's filesystem busy.
        self.ramfs_dir = Path("/run/aenv/vmram") / home_key
        self.root_images = images.RootImages(disk_cache or config.home / "cache",
                                             config.sandbox.disk_size_mb)
        pool = network or NetworkPool(config.network.bridge, config.network.subnet,
                                      min(config.runtime.warm_pool, 4))
        self.networks = VmNetworks(pool)
        self.create_timeout = create_timeout
        self.artefacts: artefacts_mod.Artefacts | None = None
        self.accel = ""  # chosen by start()
        self.accel_reason = ""
        self._live: dict[str, _Live] = {}
        self._ram_copies: dict[str, _RamCopy] = {}
        self._ram_lock = asyncio.Lock()
        self._host_netns = -1
        self.last_timings: dict[str, float] = {}
        # Creates restore a per-shape boot snapshot instead of booting (runtime.qemu_boot_snapshot).
        self.boot_snapshots = config.runtime.qemu_boot_snapshot
        self._boot_locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # VMs being started at once (boot, resume, restore): a burst (fork x16) on a few
        # cores otherwise starves every QEMU's monitor and every guest at the same time.
        self._starting = asyncio.Semaphore(max(2, 2 * (os.cpu_count() or 1)))

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        boot.qemu_binary()  # fails early with "not installed: run make install"
        kernels = artefacts_mod.kernel_dirs(self.vm_dir)
        if self.build_artefacts and kernels:
            # As the container driver refreshes its bundle: VMs run the current envd code.
            # A second or two when nothing changed (hashing); a new directory when it did.
            await asyncio.to_thread(pybundle.build, pybundle.BUNDLE_DIR)
            await asyncio.to_thread(artefacts_mod.build, kernels[-1], self.vm_dir)
        found = artefacts_mod.current(self.vm_dir)
        if found is None:
            raise AenvError(ErrorCode.UNAVAILABLE,
                            f"no VM artefacts in {self.vm_dir}: run `make install` "
                            "(scripts/install-vm.sh)")
        self.artefacts = found
        self.state_dir.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self._drop_stale_boot_images, found)
        self.ram_dir.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self._mount_ramfs)
        self.accel, self.accel_reason = await boot.choose_accel(
            self.config.runtime.qemu_accel, found, boot.PROBE_CACHE)
        self._host_netns = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)

    def _drop_stale_boot_images(self, current: artefacts_mod.Artefacts) -> None:
        """Boot snapshots of older artefacts are never used again (the key names the
        artefacts); VMs made from them depend on nothing in them. Blocking."""
        boot_dir = self.state_dir / "boot"
        if not boot_dir.is_dir():
            return
        for entry in boot_dir.iterdir():
            try:
                meta = json.loads((entry / "vm.json").read_text())
                stale = meta.get("artefacts") != str(current.root)
            except (OSError, ValueError):
                stale = True  # half made (a crash while capturing)
            if stale:
                shutil.rmtree(entry, ignore_errors=True)
        # VMs a dead server was capturing: their QEMU (if still there) goes too.
        leftovers = self.state_dir / "boot-vms"
        for pidfile in leftovers.glob("*/qemu.pid"):
            pid = boot.read_pid(pidfile)
            with contextlib.suppress(OSError):
                if pid and str(pidfile.parent).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(leftovers, ignore_errors=True)

    def _ramfs_mounted(self) -> bool:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
        return any(m.split()[1:3] == [str(self.ramfs_dir), "ramfs"] for m in mounts)

    def _mount_ramfs(self) -> None:
        self.ramfs_dir.mkdir(parents=True, exist_ok=True)
        if not self._ramfs_mounted():
            linux.mount("aenv-vmram", str(self.ramfs_dir), "ramfs", linux.MS_NOSUID
                        | linux.MS_NODEV | linux.MS_NOEXEC, "mode=0700")
        # Left by a server that died: VMs using them have them mapped already.
        for stale in self.ramfs_dir.iterdir():
            images.remove(stale)

    def _unmount_ramfs(self) -> None:
        # Lazily: VMs keep their mappings of (unlinked) files on it after the detach.
        if self._ramfs_mounted():
            with contextlib.suppress(OSError):
                linux.umount2(str(self.ramfs_dir), linux.MNT_DETACH)
        with contextlib.suppress(OSError):
            self.ramfs_dir.rmdir()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for entry in self._ram_copies.values():
            images.remove(entry.path)  # VMs keep their mappings of them
        self._ram_copies.clear()
        await asyncio.to_thread(self._unmount_ramfs)
        with contextlib.suppress(OSError):
            self.ram_dir.rmdir()  # when no VM of this home runs any more
        await self.networks.close()
        for live in self._live.values():
            _close_ctl(live)
            live.close_netns()
        self._live.clear()
        if self._host_netns >= 0:
            os.close(self._host_netns)
            self._host_netns = -1

    def _artefacts_of(self, data: dict[str, Any]) -> artefacts_mod.Artefacts:
        path = Path(str(data.get("artefacts") or ""))
        if not (path / artefacts_mod.MANIFEST).is_file():
            raise AenvError(ErrorCode.UNAVAILABLE, f"VM artefacts {path} are gone")
        return artefacts_mod.Artefacts(path)

    # -- sandboxes --------------------------------------------------------------------------
    def _check_spec(self, spec: SandboxSpec) -> None:
        if self.artefacts is None:
            raise AenvError(ErrorCode.UNAVAILABLE, "qemu driver not started")
        if not spec.lower_layers:
            raise AenvError(ErrorCode.INVALID_ARGUMENT, "no root filesystem layers")
        for layer in spec.lower_layers:
            if not layer.is_dir():
                raise AenvError(ErrorCode.INVALID_ARGUMENT, f"layer {layer} does not exist")
        if spec.memory_mb < 128:
            raise AenvError(ErrorCode.INVALID_ARGUMENT,
                            "a VM needs at least 128 MiB of memory (its own kernel)")
        if len(str(spec.workspace / "qmp.sock")) > 100:
            raise AenvError(ErrorCode.INVALID_ARGUMENT,
                            f"workspace path too long for unix sockets: {spec.workspace}")

    def _check_new(self, spec: SandboxSpec) -> None:
        """Before anything is made: a failed create cleans up by workspace and id."""
        if spec.sandbox_id in self._live or (spec.workspace / "disk.qcow2").exists():
            raise AenvError(ErrorCode.CONFLICT, f"sandbox {spec.sandbox_id} already exists")

    def _base_data(self, spec: SandboxSpec, artefacts: artefacts_mod.Artefacts
                   ) -> dict[str, Any]:
        return {"vm": str(spec.workspace), "workspace": str(spec.workspace),
                "artefacts": str(artefacts.root), "accel": self.accel,
                "envd_port": spec.envd_port, "memory_mb": spec.memory_mb,
                "cpus": max(1, spec.cpu_count), "network": True,
                "internet": spec.allow_internet_access,
                "pid": None, "start_time": None, "netns": None, "slot": None,
                "ram": None, "ram_shared": True, "paused": None}

    def _new_ram_path(self, sid: str) -> Path:
        self.ram_dir.mkdir(parents=True, exist_ok=True)  # close() removes it when empty
        return self.ram_dir / f"{sid}-{secrets.token_hex(4)}.ram"

    async def create(self, spec: SandboxSpec) -> RuntimeHandle:
        self._check_spec(spec)
        self._check_new(spec)
        if self.boot_snapshots:
            try:
                images_dir, token = await self._boot_image(spec)
            except AenvError as exc:
                log.warning("qemu: no boot snapshot for %s, booting: %s", spec.sandbox_id,
                            exc.message)
            else:
                t0 = time.monotonic()
                handle = await self.restore(spec, images_dir, token, own_ram=True)
                self.last_timings = {**self.last_timings, "boot_snapshot": 1.0,
                                     "total": time.monotonic() - t0}
                return handle
        return await self._boot(spec)

    async def _boot(self, spec: SandboxSpec) -> RuntimeHandle:
        """A cold boot: kernel, initramfs, guest init, envd."""
        assert self.artefacts is not None
        sid = spec.sandbox_id
        t0 = time.monotonic()
        data = self._base_data(spec, self.artefacts)
        try:
            spec.workspace.mkdir(parents=True, exist_ok=True)
            base = await self.root_images.get(spec.lower_layers)
            t_image = time.monotonic() - t0
            await images.create_overlay(base, boot.VmPaths(spec.workspace).disk)
            data["ram"] = str(self._new_ram_path(sid))
            async with self._starting:
                await self._launch(sid, data, incoming=None)
                t_launch = time.monotonic() - t0
                await self._configure(sid, data, spec)
                await self._wait_envd(sid, data, time.monotonic() + self.create_timeout)
        except BaseException:
            await self._cleanup(sid, data, remove_workspace=True)
            raise
        self.last_timings = {"image": t_image, "launch": t_launch,
                             "total": time.monotonic() - t0}
        return RuntimeHandle(self.name, sid, data)

    async def _launch(self, sid: str, data: dict[str, Any], incoming: Path | None,
                      *, ignore_shared: bool = False) -> None:
        """Start QEMU for `data` in a new network namespace. With `incoming`, QEMU loads that
        migration stream and stays paused (the caller `cont`s)."""
        net = await self.networks.acquire(sid, bool(data.get("internet")))
        data.update(net.to_data())
        paths = boot.VmPaths(Path(data["vm"]))
        for stale in (paths.qmp, paths.ctl, paths.pidfile):
            images.remove(stale)
        cfg = boot.VmConfig(artefacts=self._artefacts_of(data), accel=str(data["accel"]),
                            cpus=int(data["cpus"]), memory_mb=int(data["memory_mb"]),
                            paths=paths, ram_path=Path(data["ram"]),
                            ram_shared=bool(data["ram_shared"]), network=True,
                            extra=(["-S", "-incoming", "defer"] if incoming else []))
        await boot.spawn(boot.qemu_argv(cfg), net.netns, paths.root / "qemu.log")
        pid = boot.read_pid(paths.pidfile)
        start_time = linux.proc_start_time(pid) if pid else None
        if pid is None or start_time is None:
            raise AenvError(ErrorCode.INTERNAL, f"sandbox {sid}: qemu exited at start: "
                            f"{_tail(paths.console)}")
        data.update(pid=pid, start_time=start_time)
        live = _Live(pid, start_time, cpu_used=0, cpu_at=time.monotonic(),
                     running_at=time.monotonic())
        self._live[sid] = live
        if incoming is not None:
            async with Qmp(paths.qmp) as qmp:
                await qmp.execute("migrate-set-capabilities", capabilities=[
                    {"capability": "x-ignore-shared", "state": ignore_shared}])
                await qmp.execute("migrate-incoming", uri=f"exec:cat '{incoming}'")
                deadline = time.monotonic() + 120
                while True:
                    status = await qmp.execute("query-status")
                    if status.get("status") != "inmigrate":
                        break
                    if time.monotonic() > deadline:
                        raise AenvError(ErrorCode.TIMEOUT, f"sandbox {sid}: restore timed out")
                    await asyncio.sleep(0.005)
                mig = await qmp.execute("query-migrate")
                if mig.get("status") == "failed":
                    raise AenvError(ErrorCode.INTERNAL, f"sandbox {sid}: restore failed: "
                                    f"{mig.get('error-desc')} {_tail(paths.root / 'qemu.log')}")
                await qmp.execute("cont")
                live.running_at = time.monotonic()

    async def _ctl_conn(self, sid: str, data: dict[str, Any]
                        ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The connection to the guest's control port, kept open while the VM runs: with a
        host connected, the guest blocks in read() instead of polling for one."""
        live = self._live.get(sid)
        if live is not None and live.ctl is not None and not live.ctl[1].is_closing():
            return live.ctl
        path = boot.VmPaths(Path(data["vm"])).ctl
        try:
            conn = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), 10)
        except (OSError, TimeoutError) as exc:
            raise AenvError(ErrorCode.UNAVAILABLE, f"sandbox {sid}: control port: {exc!r}"
                            ) from None
        if live is not None:
            live.ctl = conn
        return conn

    async def _ctl(self, sid: str, data: dict[str, Any], msg: dict[str, Any],
                   timeout: float) -> None:
        """One request over the guest's control port; waits for its reply."""
        msg = {"id": secrets.randbelow(2**31), **msg}
        reader, writer = await self._ctl_conn(sid, data)
        ok = False
        try:
            writer.write(json.dumps(msg).encode() + b"\n")
            await writer.drain()
            deadline = time.monotonic() + timeout
            while True:
                remaining = deadline - time.monotonic()
                try:
                    line = await asyncio.wait_for(reader.readline(), max(remaining, 0.01))
                except TimeoutError:
                    raise AenvError(ErrorCode.TIMEOUT,
                                    f"sandbox {sid}: guest did not answer {msg['op']} in "
                                    f"{timeout:.0f} s; console: {_tail(Path(data['vm']) / 'console.log')}"
                                    ) from None
                if not line:
                    self._check_alive(sid, data)
                    raise AenvError(ErrorCode.UNAVAILABLE, f"sandbox {sid}: control port closed")
                with contextlib.suppress(ValueError):
                    reply = json.loads(line)
                    if reply.get("id") == msg["id"]:
                        ok = True
                        if not reply.get("ok"):
                            raise AenvError(ErrorCode.INTERNAL,
                                            f"sandbox {sid}: guest {msg['op']}: {reply.get('error')}")
                        return
        finally:
            if not ok:  # out of step with the guest: start afresh next time
                _close_ctl(self._live.get(sid))
                writer.close()

    def _identity(self, sid: str) -> dict[str, Any]:
        return {"hostname": sid, "hosts": etc_files.hosts(sid, GUEST_ADDRESS), "time": time.time(),
                "entropy": secrets.token_hex(64)}

    async def _configure(self, sid: str, data: dict[str, Any], spec: SandboxSpec) -> None:
        """The boot configuration, over the control port (the guest waits for it)."""
        msg = {"op": "config", **self._identity(sid),
               "resolv_conf": etc_files.host_resolv_conf() if spec.allow_internet_access else None,
               "envd": {"port": spec.envd_port, "access_token": spec.envd_access_token,
                        "env_vars": dict(spec.env_vars), "default_user": spec.default_user,
                        "default_workdir": spec.default_workdir}}
        await self._ctl(sid, data, msg, self.create_timeout)

    async def _wait_envd(self, sid: str, data: dict[str, Any], deadline: float) -> None:
        handle = RuntimeHandle(self.name, sid, data)
        while True:
            try:
                sock = await self.connect(handle, int(data["envd_port"]), timeout=2)
            except AenvError as exc:
                self._check_alive(sid, data)
                if time.monotonic() > deadline:
                    raise AenvError(ErrorCode.TIMEOUT,
                                    f"sandbox {sid}: envd not ready in time: {exc.message}"
                                    ) from None
                await asyncio.sleep(0.02)
                continue
            sock.close()
            return

    def _check_alive(self, sid: str, data: dict[str, Any]) -> None:
        pid, start = data.get("pid"), data.get("start_time")
        if not pid or linux.proc_start_time(int(pid)) != start:
            raise AenvError(ErrorCode.UNAVAILABLE,
                            f"sandbox {sid}: qemu exited: "
                            f"{_tail(Path(data['vm']) / 'console.log')}"
                            f"{_tail(Path(data['vm']) / 'qemu.log')}")

    def _live_of(self, handle: RuntimeHandle) -> _Live:
        live = self._live.get(handle.sandbox_id)
        if live is None:
            pid, start = handle.data.get("pid"), handle.data.get("start_time")
            if not pid or start is None:
                raise AenvError(ErrorCode.UNAVAILABLE, f"sandbox {handle.sandbox_id} is not running")
            live = _Live(int(pid), int(start))
            self._live[handle.sandbox_id] = live
        return live

    def _running(self, handle: RuntimeHandle) -> _Live:
        """The VM's record, or UNAVAILABLE when its QEMU process is gone."""
        live = self._live_of(handle)
        if not live.alive():
            raise AenvError(ErrorCode.UNAVAILABLE, f"sandbox {handle.sandbox_id} is not running")
        return live

    def exit_reason(self, handle: RuntimeHandle) -> str | None:
        """`LivenessDriver`: whether the VM's QEMU process runs (pid and start time)."""
        if self._live_of(handle).alive():
            return None
        return "the sandbox's virtual machine (its QEMU process) exited or was killed"

    async def attach(self, handle: RuntimeHandle) -> bool:
        try:
            live = self._live_of(handle)
        except AenvError:
            return False
        if not live.alive():
            return False
        await self.networks.claim(handle.data)
        with contextlib.suppress(AenvError):
            await self._ctl_conn(handle.sandbox_id, handle.data)  # the guest stops polling
        return True

    async def connect(self, handle: RuntimeHandle, port: int, timeout: float = 10.0
                      ) -> socket.socket:
        live = self._live_of(handle)
        if live.netns_fd is None:
            fd = open_netns(str(handle.data.get("netns")))
            if not live.alive():
                os.close(fd)
                raise AenvError(ErrorCode.UNAVAILABLE, f"sandbox {handle.sandbox_id} is not running")
            live.netns_fd = fd
        sock = await live.connect(handle.sandbox_id, self._host_netns, GUEST_ADDRESS, port,
                                  timeout)
        live.sockets.add(sock)
        return sock

    async def stats(self, handle: RuntimeHandle) -> ResourceUsage:
        """CPU: the QEMU process (all vCPU threads; under TCG this includes translation).
        Memory: the QEMU process' proportional set size (guest RAM actually backed on the
        host, shared pages split between the VMs sharing them, plus QEMU's own)."""
        live = self._live_of(handle)
        if not live.alive():
            raise AenvError(ErrorCode.NOT_FOUND, f"sandbox {handle.sandbox_id} is not running")
        ticks = _cpu_ticks(live.pid)
        mem = _smaps_rollup(live.pid)
        cpu_pct = live.cpu_percent(ticks, CLK_TCK)
        disk = boot.VmPaths(Path(handle.data["vm"])).disk
        used = await asyncio.to_thread(_allocated, disk)
        return ResourceUsage(cpu_used_pct=round(cpu_pct, 2), mem_used_bytes=mem.get("Pss", 0),
                             mem_total_bytes=int(handle.data["memory_mb"]) * 2**20,
                             mem_cache_bytes=0, disk_used_bytes=used,
                             disk_total_bytes=self.config.sandbox.disk_size_mb * 2**20)

    async def destroy(self, handle: RuntimeHandle) -> None:
        await self._cleanup(handle.sandbox_id, dict(handle.data), remove_workspace=True)

    async def _cleanup(self, sid: str, data: dict[str, Any], *, remove_workspace: bool) -> None:
        live = self._live.pop(sid, None)
        if live is not None:
            live.close_netns()
        pid, start = data.get("pid"), data.get("start_time")
        _close_ctl(live)
        if live is not None:
            for sock in list(live.sockets):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        if pid:
            await kill_and_wait(int(pid), start, "qemu")
        await self.networks.release(data)
        ram = data.get("ram")
        if ram and str(ram).startswith(str(self.ram_dir)):
            images.remove(Path(ram))
        if remove_workspace and data.get("vm"):
            await asyncio.to_thread(shutil.rmtree, str(data["vm"]), True)

    # -- pause / resume ---------------------------------------------------------------------
    async def _migrate(self, qmp: Qmp, target: Path, ignore_shared: bool) -> None:
        await qmp.execute("migrate-set-capabilities", capabilities=[
            {"capability": "x-ignore-shared", "state": ignore_shared}])
        await qmp.execute("migrate-set-parameters", **{"max-bandwidth": _MIGRATE_BANDWIDTH,
                                                        "downtime-limit": 2000})
        await qmp.execute("migrate", uri=f"exec:cat > '{target}'")
        deadline = time.monotonic() + 300
        while True:
            info = await qmp.execute("query-migrate")
            status = info.get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise AenvError(ErrorCode.INTERNAL, f"qemu migration {status}: "
                                f"{info.get('error-desc', '')}")
            if time.monotonic() > deadline:
                with contextlib.suppress(AenvError):
                    await qmp.execute("migrate_cancel")
                raise AenvError(ErrorCode.TIMEOUT, "qemu migration timed out")
            await asyncio.sleep(0.002)

    async def pause(self, handle: RuntimeHandle) -> RuntimeHandle:
        """Stop the VM, save its state into <vm>/paused/, end QEMU: the sandbox then holds no
        memory and no CPU; its disk overlay stays in place. Shared RAM (a file on tmpfs)
        is copied to disk as is (sparse) next to a device-only stream, which resumes faster
        than parsing RAM out of a stream; private RAM (a copy of a snapshot) goes into the
        stream."""
        sid = handle.sandbox_id
        data = dict(handle.data)
        live = self._running(handle)
        vm = Path(data["vm"])
        paused = vm / "paused"
        paused.mkdir(exist_ok=True)
        stamp = time.time_ns()
        stream, ram_copy = paused / f"state-{stamp}", paused / f"ram-{stamp}"
        shared = bool(data.get("ram_shared"))
        t0 = time.monotonic()
        async with live.lock, Qmp(boot.VmPaths(vm).qmp) as qmp:
            await qmp.execute("stop")
            t_stop = time.monotonic()
            try:
                await self._migrate(qmp, stream, ignore_shared=shared)
                if shared:
                    await images.copy_sparse(Path(data["ram"]), ram_copy)
            except BaseException:
                with contextlib.suppress(AenvError):
                    await qmp.execute("cont")
                images.remove(stream)
                images.remove(ram_copy)
                raise
            t_saved = time.monotonic()
            with contextlib.suppress(AenvError):
                await qmp.execute("quit")
        # The disk as the pause left it, under a second name beside the saved state: the
        # paused state is then one directory (see paused_state()). No copy: a hard link.
        saved_disk = paused / PAUSED_DISK
        with contextlib.suppress(FileNotFoundError):
            saved_disk.unlink()
        os.link(boot.VmPaths(vm).disk, saved_disk)
        await self._cleanup(sid, data, remove_workspace=False)
        data.update(pid=None, start_time=None, netns=None, slot=None, ram=None,
                    paused=str(stream), paused_ram=str(ram_copy) if shared else None)
        size = stream.stat().st_size + (ram_copy.stat().st_blocks * 512 if shared else 0)
        self.last_timings = {"stop": t_stop - t0, "save": t_saved - t_stop,
                             "total": time.monotonic() - t0, "image_bytes": float(size)}
        return RuntimeHandle(self.name, sid, data)

    async def resume(self, handle: RuntimeHandle, spec: SandboxSpec) -> RuntimeHandle:
        sid = handle.sandbox_id
        data = dict(handle.data)
        stream = Path(str(data.get("paused") or ""))
        if not data.get("paused") or not stream.is_file():
            raise AenvError(ErrorCode.NOT_FOUND, f"sandbox {sid}: no paused image to resume from")
        saved_ram = Path(data["paused_ram"]) if data.get("paused_ram") else None
        t0 = time.monotonic()
        data.update(ram=str(self._new_ram_path(sid)), ram_shared=True,
                    internet=spec.allow_internet_access)
        try:
            disk = boot.VmPaths(Path(data["vm"])).disk
            if not disk.exists():  # a node that lost the workspace: back from the saved state
                saved_disk = stream.parent / PAUSED_DISK
                if not saved_disk.exists():
                    raise AenvError(ErrorCode.NOT_FOUND, f"sandbox {sid}: its disk is gone")
                await asyncio.to_thread(os.link, saved_disk, disk)
            # The overlay names its base by path; on another node (or after the disk cache was
            # cleared) that base is (re)built from the template's layers.
            await images.point_overlay_at(disk, await self.root_images.get(spec.lower_layers))
            if saved_ram is not None:
                await images.copy_sparse(saved_ram, Path(data["ram"]))
            async with self._starting:
                await self._launch(sid, data, incoming=stream,
                                   ignore_shared=saved_ram is not None)
                t_loaded = time.monotonic()
                await self._ctl(sid, data, {"op": "identity", **self._identity(sid)}, 60)
                await self._wait_envd(sid, data, time.monotonic() + 60)
        except BaseException:
            # Still paused: the saved state and the disk are intact; a later resume retries.
            await self._cleanup(sid, data, remove_workspace=False)
            raise
        data.update(paused=None, paused_ram=None)
        await asyncio.to_thread(shutil.rmtree, stream.parent, True)
        self.last_timings = {"load": t_loaded - t0, "total": time.monotonic() - t0}
        return RuntimeHandle(self.name, sid, data)

    def paused_state(self, handle: RuntimeHandle) -> dict[str, Path]:
        """The directory a pause saved everything into: device state, RAM, and the disk
        overlay (a hard link to it, so the disk is copied to the repository with the rest)."""
        if not handle.data.get("paused"):
            raise AenvError(ErrorCode.CONFLICT, f"sandbox {handle.sandbox_id} is not paused")
        stream = Path(handle.data["paused"])  # <vm>/paused/state-<ns>: unique to this pause
        return {f"pause-{stream.name.removeprefix('state-')}": stream.parent}

    async def prepare_paused_state(self, handle: RuntimeHandle) -> None:
        await asyncio.to_thread(Path(handle.data["vm"]).mkdir, parents=True, exist_ok=True)

    # -- snapshot / restore -----------------------------------------------------------------
    async def snapshot(self, handle: RuntimeHandle, images_dir: Path) -> dict[str, float]:
        """Capture a running VM into `images_dir` (vm.json, state, ram, disk.qcow2) while it
        is stopped; it continues afterwards. Returns timings."""
        data = dict(handle.data)
        live = self._running(handle)
        vm = Path(data["vm"])
        images_dir.mkdir(parents=True, exist_ok=True)
        shared = bool(data.get("ram_shared"))
        t0 = time.monotonic()
        async with live.lock, Qmp(boot.VmPaths(vm).qmp) as qmp:
            await qmp.execute("stop")  # drains and flushes the disks too
            t_stop = time.monotonic()
            try:
                # Shared RAM: its file is copied as is and the stream holds the devices only
                # (x-ignore-shared). Private RAM (a copy of a snapshot, mapped copy-on-write)
                # is not "shared" to QEMU: it goes into the stream.
                await self._migrate(qmp, images_dir / "state", ignore_shared=shared)
                t_state = time.monotonic()
                copies = [images.copy_sparse(boot.VmPaths(vm).disk,
                                             images_dir / "disk.qcow2")]
                if shared:
                    copies.append(images.copy_sparse(Path(data["ram"]), images_dir / "ram"))
                await asyncio.gather(*copies)
            finally:
                with contextlib.suppress(AenvError):
                    await qmp.execute("cont")
                with contextlib.suppress(AenvError):
                    await qmp.execute("migrate-set-capabilities", capabilities=[
                        {"capability": "x-ignore-shared", "state": False}])
            t_cont = time.monotonic()
        meta = {"format": IMAGE_FORMAT, "artefacts": data["artefacts"], "accel": data["accel"],
                "memory_mb": data["memory_mb"], "cpus": data["cpus"], "ram": shared,
                "envd_port": data["envd_port"]}
        (images_dir / "vm.json").write_text(json.dumps(meta))
        size = sum(p.stat().st_blocks * 512 for p in images_dir.iterdir())
        return {"frozen_s": t_cont - t_stop, "state_s": t_state - t_stop,
                "total_s": time.monotonic() - t0, "image_bytes": float(size)}

    # -- boot snapshots ---------------------------------------------------------------------
    def _boot_key(self, spec: SandboxSpec) -> str:
        assert self.artefacts is not None
        layers = "\n".join(str(p.resolve()) for p in spec.lower_layers)
        text = (f"{IMAGE_FORMAT}:{self.artefacts.version}:{self.accel}:{spec.memory_mb}:"
                f"{max(1, spec.cpu_count)}:{spec.envd_port}:{layers}")
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    async def _boot_image(self, spec: SandboxSpec) -> tuple[Path, str]:
        """The boot snapshot of `spec`'s shape (layers, memory, vCPUs, envd port): a VM booted
        once to a ready envd and captured, so that creates restore it (about a second under
        TCG) instead of booting (about ten). Made on first use, kept in <state>/boot/."""
        key = self._boot_key(spec)
        final = self.state_dir / "boot" / key
        if (final / "token").is_file():
            return final, (final / "token").read_text()
        async with self._boot_locks.setdefault(key, asyncio.Lock()):
            if (final / "token").is_file():
                return final, (final / "token").read_text()
            token = secrets.token_urlsafe(24)
            sid = f"boot{key}"
            boot_spec = SandboxSpec(
                sandbox_id=sid, lower_layers=spec.lower_layers,
                workspace=self.state_dir / "boot-vms" / sid, cpu_count=spec.cpu_count,
                memory_mb=spec.memory_mb, pids_max=spec.pids_max, envd_access_token=token,
                default_user=spec.default_user, allow_internet_access=False,
                envd_port=spec.envd_port)
            shutil.rmtree(boot_spec.workspace, ignore_errors=True)
            stage = final.with_name(f".{key}-{secrets.token_hex(4)}")
            handle = await self._boot(boot_spec)
            try:
                await self.snapshot(handle, stage)
                fd = os.open(stage / "token", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(token)
                shutil.rmtree(final, ignore_errors=True)
                os.rename(stage, final)
            finally:
                await self.destroy(handle)
                shutil.rmtree(stage, ignore_errors=True)
            return final, token

    def set_ready_shapes(self, shapes: list[ReadyShape]) -> None:
        """The orchestrator's default template shape(s): their boot snapshots are made in
        the background now, so that even the first create restores one."""
        if not self.boot_snapshots:
            return
        for shape in shapes:
            spec = SandboxSpec(sandbox_id="warm", lower_layers=shape.lower_layers,
                               workspace=self.state_dir, cpu_count=shape.cpu_count,
                               memory_mb=shape.memory_mb, pids_max=shape.pids_max,
                               default_user=shape.default_user, envd_port=shape.envd_port)
            task = asyncio.get_running_loop().create_task(self._warm(spec))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _warm(self, spec: SandboxSpec) -> None:
        try:
            await self._boot_image(spec)
        except AenvError as exc:
            log.warning("qemu: making the boot snapshot failed: %s", exc.message)

    async def _ram_copy(self, images_dir: Path) -> Path:
        """The ramfs copy of a snapshot's RAM, shared by concurrent restores of it."""
        key = str(images_dir.resolve())
        async with self._ram_lock:
            entry = self._ram_copies.get(key)
            if entry is None:
                path = self.ramfs_dir / f"{secrets.token_hex(8)}.ram"
                await images.copy_sparse(images_dir / "ram", path)
                entry = self._ram_copies[key] = _RamCopy(path)
            entry.users += 1
            return entry.path

    async def _ram_done(self, images_dir: Path) -> None:
        key = str(images_dir.resolve())
        async with self._ram_lock:
            entry = self._ram_copies.get(key)
            if entry is None:
                return
            entry.users -= 1
            if entry.users <= 0:
                # The VMs keep their mappings; the name goes, the pages stay while mapped.
                images.remove(entry.path)
                del self._ram_copies[key]

    async def restore(self, spec: SandboxSpec, images_dir: Path, image_token: str | None,
                      *, own_ram: bool = False) -> RuntimeHandle:
        """A new VM `spec.sandbox_id` from a snapshot: its own disk overlay (a copy of the
        snapshot's), network namespace, hostname, entropy and envd token. Its RAM maps the
        snapshot's copy-on-write; with `own_ram` (creates from a boot snapshot) it is a
        private copy instead, shared with QEMU like a booted VM's, so that snapshots of it
        (forks) can again be mapped copy-on-write."""
        self._check_spec(spec)
        sid = spec.sandbox_id
        try:
            meta = json.loads((images_dir / "vm.json").read_text())
        except (OSError, ValueError) as exc:
            raise AenvError(ErrorCode.NOT_FOUND, f"not a VM snapshot: {images_dir}: {exc}") from None
        if meta.get("format") != IMAGE_FORMAT:
            raise AenvError(ErrorCode.NOT_SUPPORTED, f"VM snapshot format {meta.get('format')}")
        self._check_new(spec)
        t0 = time.monotonic()
        artefacts = artefacts_mod.Artefacts(Path(meta["artefacts"]))
        data = self._base_data(spec, artefacts)
        # The snapshot's machine, not the spec's: RAM size and vCPUs must match the stream.
        data.update(memory_mb=meta["memory_mb"], cpus=meta["cpus"], accel=meta["accel"])
        ram_copy = False
        try:
            spec.workspace.mkdir(parents=True, exist_ok=True)
            disk = boot.VmPaths(spec.workspace).disk
            base, _ = await asyncio.gather(self.root_images.get(spec.lower_layers),
                                           images.copy_sparse(images_dir / "disk.qcow2", disk))
            # The overlay names its backing file by path: point it at this node's base image.
            await images.point_overlay_at(disk, base)
            if meta.get("ram") and own_ram:
                data["ram"] = str(self._new_ram_path(sid))
                await images.copy_sparse(images_dir / "ram", Path(data["ram"]))
            elif meta.get("ram"):
                data["ram"] = str(await self._ram_copy(images_dir))
                data["ram_shared"] = False
                ram_copy = True
            else:
                data["ram"] = str(self._new_ram_path(sid))
            t_prep = time.monotonic()
            handle = RuntimeHandle(self.name, sid, data)
            body = init_body(spec)
            async with self._starting:
                try:
                    await self._launch(sid, data, incoming=images_dir / "state",
                                       ignore_shared=bool(meta.get("ram")))
                finally:
                    if ram_copy:
                        await self._ram_done(images_dir)
                t_loaded = time.monotonic()
                resolv = etc_files.host_resolv_conf() if spec.allow_internet_access else None
                await self._ctl(sid, data, {"op": "identity", **self._identity(sid),
                                            "resolv_conf": resolv}, 60)
                await self._init_envd(handle, image_token or "", body)
        except BaseException:
            await self._cleanup(sid, data, remove_workspace=True)
            raise
        self.last_timings = {"prepare": t_prep - t0, "load": t_loaded - t_prep,
                             "total": time.monotonic() - t0}
        return handle

    async def _init_envd(self, handle: RuntimeHandle, token: str, body: dict[str, Any]
                         ) -> None:
        """`POST /init` to the guest's envd, authenticated with its current `token`."""
        sock = await self.connect(handle, int(handle.data["envd_port"]))
        await post_init(sock, token, body, timeout=20)

    def running_since(self, handle: RuntimeHandle) -> float:
        """time.monotonic() when the VM's vCPUs started (after a boot, or a restore's load):
        the guest runs from then on, before it has taken its new identity and envd answers."""
        return self._live_of(handle).running_at

    # -- memory -----------------------------------------------------------------------------
    async def memory(self, handle: RuntimeHandle) -> dict[str, int]:
        """Host memory of the VM's QEMU process (smaps_rollup, bytes): Rss, Pss, ..."""
        live = self._live_of(handle)
        if not live.alive():
            raise AenvError(ErrorCode.NOT_FOUND, f"sandbox {handle.sandbox_id} is not running")
        return _smaps_rollup(live.pid)


# -- helpers ---------------------------------------------------------------------------------
def _tail(path: Path, n: int = 600) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _cpu_ticks(pid: int) -> int:
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return 0
    fields = raw[raw.rindex(b")") + 2:].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, all threads


def _smaps_rollup(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return out
    for line in text.splitlines()[1:]:
        key, _, rest = line.partition(":")
        words = rest.split()
        if words and words[0].isdigit():
            out[key] = int(words[0]) * 1024
    return out


def _allocated(path: Path) -> int:
    try:
        return path.stat().st_blocks * 512
    except OSError:
        return 0


def accel_of(handle: RuntimeHandle) -> str | None:
    """The accelerator a VM runs with (kvm or tcg), from its handle."""
    value = handle.data.get("accel")
    return str(value) if value else None

