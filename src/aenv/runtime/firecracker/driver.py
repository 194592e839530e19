"""`FirecrackerDriver`: every sandbox is a Firecracker microVM, driven through its API socket.

Needs a KVM host with hardware virtualisation, a `firecracker` binary (>= v1.14; not packaged
in Debian) and a guest kernel + root filesystem image (`runtime.firecracker_*`). `start()`
runs `probe.probe()` (including a real test boot) and refuses, with the reason, when any of
that is missing: on the machines aenv is developed on it always refuses (no binary, and KVM is
PVM, where stock kernels hang), so this driver has only been exercised against a fake
Firecracker API server (tests/unit/test_firecracker_api.py).

Per sandbox: one Firecracker process (own session, cwd = `spec.workspace`), its own network
namespace with TAP `fc0` (`network.py`), and in the workspace: `rootfs.ext4` (a reflink/copy of
the base image, given to Firecracker by *relative* path so snapshots carry no host path),
`api.sock`, `serial.log` (console), `firecracker.log`, `metrics.json`, `diff-base.json`.

Guest contract (what the kernel + rootfs must do): bring up eth0 from `aenv.ip=`/`aenv.gw=`
on the kernel command line (as the VM initramfs of scripts/install-vm.sh does), and start
envd, with no access token, on port `aenv.envd_port=`; `aenv.hostname=` is the first hostname.
The driver then `POST /init`s envd with the real token before anything else can run.

Lifecycle, all through the API (`api.py` builds every body):
- create: PUT /logger, /metrics, /machine-config (track_dirty_pages), /boot-source,
  /drives/rootfs (+ /drives/tools), /network-interfaces/eth0, /balloon (stats, free page
  reporting), PUT /actions InstanceStart; wait for envd; POST /init.
- pause: PATCH /vm Paused, PUT /snapshot/create into `<workspace>/pause-<ns>/`, kill the
  process, release the network. resume: a new process, PUT /logger, /metrics, PUT
  /snapshot/load (File backend, track_dirty_pages, resume_vm), envd answers, clock resynced.
- snapshot: PATCH /vm Paused, disk cloned into `images` while paused, PUT /snapshot/create,
  PATCH /vm Resumed. restore (also each child of a fork, which the orchestrator builds as one
  snapshot + N restores): a disk clone per child, the memory file *shared* (hard link or the
  image's own file: Firecracker maps it MAP_PRIVATE, so children share its pages
  copy-on-write), PUT /snapshot/load, then envd: POST /init with the image's token, and a
  command that sets the hostname, /etc/hosts, the clock and reseeds the guest's RNG.
- Diff snapshots: dirty pages are tracked from boot and after every load. A VM never
  snapshotted since boot takes a Diff snapshot, which is then already a complete (sparse)
  memory file; otherwise a Diff snapshot is merged over the memory file it diverged from
  (`diff-base.json`, checked by inode, size and mtime), and a Full snapshot is taken when that
  file is gone.

Handle data (JSON): pid + start_time (the Firecracker process across pid reuse), api_socket,
workspace, netns + slot, envd_port, memory_mb, cpu_count, images (while paused).

Owns: its Firecracker processes, workspaces, the network namespaces `network.py` makes.
Must not touch: the configured kernel/rootfs/tools files (read-only sources), snapshot images
after `snapshot()` returns (they are the orchestrator's; the driver only reads them).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import platform
import re
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aenv.config import Config
from aenv.errors import AenvError, ErrorCode
from aenv.runtime.base import ResourceUsage, RuntimeHandle, SandboxSpec
from aenv.runtime.container.network import NetworkPool
from aenv.runtime.envd_init import init_body
from aenv.runtime.firecracker import api, disk, process
from aenv.runtime.firecracker import probe as probe_mod
from aenv.runtime.firecracker.network import (
    GATEWAY_ARG,
    GUEST_ADDRESS,
    GUEST_MAC,
    TAP,
    TapNetworks,
    VmNet,
    VmNetworks,
)
from aenv.runtime.process import CLK_TCK, uptime

ROOTFS = "rootfs.ext4"  # relative to the workspace (= Firecracker's cwd)
MEMORY = "memory"
VMSTATE = "vmstate"
IMAGE_META = "firecracker.json"
DIFF_BASE = "diff-base.json"
_HOSTNAME_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")

ProbeFn = Callable[[Config], Awaitable[probe_mod.Availability]]


def _default_probe(config: Config) -> Awaitable[probe_mod.Availability]:
    return probe_mod.probe(config, boot=True)


class FirecrackerDriver:
    name = "firecracker"

    def __init__(self, config: Config, networks: VmNetworks | None = None,
                 probe: ProbeFn = _default_probe) -> None:
        self.config = config
        self.rt = config.runtime
        self.networks: VmNetworks = networks or TapNetworks(NetworkPool(
            bridge=config.network.bridge, subnet=config.network.subnet, warm=0))
        self._probe = probe
        self.binary: str | None = None
        self.version: api.FirecrackerVersion | None = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}  # children of this server
        self._cpu: dict[str, tuple[int, float]] = {}  # sandbox -> (cpu ticks, at)
        self.last_timings: dict[str, float] = {}

    # ------------------------------------------------------------------ setup
    async def start(self) -> None:
        found = await self._probe(self.config)
        if not found.ok or found.binary is None or found.version is None:
            raise AenvError(ErrorCode.UNAVAILABLE,
                            f"the firecracker runtime cannot run on this host: {found.reason}")
        self.binary, self.version = found.binary, found.version
        await self.networks.start()

    async def close(self) -> None:
        """Live microVMs keep running; only children that already exited are reaped."""
        for proc in self._procs.values():
            proc.poll()
        await self.networks.close()

    def _ready(self) -> tuple[str, api.FirecrackerVersion]:
        if self.binary is None or self.version is None:
            raise AenvError(ErrorCode.UNAVAILABLE, "the firecracker driver is not started")
        return self.binary, self.version

    # ------------------------------------------------------------------ API bodies
    def boot_args(self, spec: SandboxSpec) -> str:
        return (f"console=ttyS0 reboot=k panic=1 pci=off aenv.ip={GUEST_ADDRESS}/30 "
                f"{GATEWAY_ARG} aenv.envd_port={spec.envd_port} aenv.hostname={spec.sandbox_id}")

    def log_calls(self, workspace: Path) -> list[api.ApiCall]:
        """Logger and metrics: the only things allowed before a /snapshot/load."""
        return [api.put_logger(api.Logger(log_path=str(workspace / "firecracker.log"))),
                api.put_metrics(api.Metrics(metrics_path=str(workspace / "metrics.json")))]

    def boot_calls(self, spec: SandboxSpec) -> list[api.ApiCall]:
        """Everything between a fresh process and a running guest, in order."""
        rt = self.rt
        calls = self.log_calls(spec.workspace)
        calls.append(api.put_machine_config(api.MachineConfig(
            vcpu_count=spec.cpu_count, mem_size_mib=spec.memory_mb, smt=False,
            track_dirty_pages=True)))
        calls.append(api.put_boot_source(api.BootSource(
            kernel_image_path=rt.firecracker_kernel, boot_args=self.boot_args(spec),
            initrd_path=rt.firecracker_initrd or None)))
        calls.append(api.put_drive(api.Drive("rootfs", ROOTFS, is_root_device=True,
                                             is_read_only=False, cache_type="Unsafe",
                                             io_engine="Sync")))
        if rt.firecracker_tools:
            calls.append(api.put_drive(api.Drive("tools", rt.firecracker_tools,
                                                 is_root_device=False, is_read_only=True)))
        calls.append(api.put_network_interface(api.NetworkInterface(
            iface_id="eth0", host_dev_name=TAP, guest_mac=GUEST_MAC)))
        calls.append(api.put_balloon(api.Balloon(
            amount_mib=0, deflate_on_oom=True, stats_polling_interval_s=1,
            free_page_reporting=True)))
        calls.append(api.instance_start())
        return calls

    def load_call(self, images: Path, memory: Path) -> api.ApiCall:
        _, version = self._ready()
        realtime = version.has_clock_realtime and platform.machine() == "x86_64"
        return api.snapshot_load(api.SnapshotLoad(
            snapshot_path=str(images / VMSTATE),
            mem_backend=api.MemoryBackend(backend_path=str(memory), backend_type="File"),
            track_dirty_pages=True, resume_vm=True, clock_realtime=True if realtime else None))

    # ------------------------------------------------------------------ processes
    def _spawn(self, sandbox_id: str, data: dict[str, Any], net: VmNet) -> None:
        binary, _ = self._ready()
        ws = Path(data["workspace"])
        proc = process.spawn(binary, ws, Path(data["api_socket"]), sandbox_id, net.netns,
                             ws / "serial.log")
        self._procs[sandbox_id] = proc
        data.update(pid=proc.pid, start_time=process.start_time(proc.pid))

    def _alive(self, data: dict[str, Any]) -> bool:
        pid = data.get("pid")
        return pid is not None and process.alive(int(pid), data.get("start_time"))

    def _api(self, data: dict[str, Any]) -> api.FirecrackerApi:
        return api.FirecrackerApi(str(data["api_socket"]))

    async def _run_calls(self, sandbox_id: str, data: dict[str, Any],
                         calls: list[api.ApiCall]) -> None:
        """Wait for a fresh process's API, then make `calls` in order."""
        proc = self._procs.get(sandbox_id)
        async with self._api(data) as fc:
            await fc.wait_ready(10, alive=(lambda: proc.poll() is None) if proc else None)
            for call in calls:
                try:
                    await fc.call(call)
                except AenvError as exc:
                    tail = process.tail(Path(data["workspace"]) / "firecracker.log")
                    raise AenvError(exc.code, f"{exc.message}{' | ' + tail if tail else ''}"
                                    ) from None

    def _new_data(self, spec: SandboxSpec) -> dict[str, Any]:
        sock = spec.workspace / "api.sock"
        if len(str(sock).encode()) > 107:
            raise AenvError(ErrorCode.INVALID_ARGUMENT,
                            f"workspace path too long for a unix socket: {sock}")
        return {"pid": None, "start_time": None, "api_socket": str(sock),
                "workspace": str(spec.workspace), "netns": None, "slot": None,
                "envd_port": spec.envd_port, "memory_mb": spec.memory_mb,
                "cpu_count": spec.cpu_count, "images": None}

    @staticmethod
    def _net(data: dict[str, Any]) -> VmNet:
        return VmNet(data.get("netns"), data.get("slot"))

    # ------------------------------------------------------------------ lifecycle
    async def create(self, spec: SandboxSpec) -> RuntimeHandle:
        self._ready()
        t0 = time.monotonic()
        base = Path(self.rt.firecracker_rootfs)
        if not base.is_file():
            raise AenvError(ErrorCode.UNAVAILABLE, f"no guest root filesystem at {base} "
                            "(runtime.firecracker_rootfs)")
        data = self._new_data(spec)
        handle = RuntimeHandle(self.name, spec.sandbox_id, data)
        try:
            spec.workspace.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(disk.clone_file, base, spec.workspace / ROOTFS)
            t_disk = time.monotonic() - t0
            net = await self.networks.acquire(spec.sandbox_id, spec.allow_internet_access)
            data.update(net.to_data())
            self._spawn(spec.sandbox_id, data, net)
            await self._run_calls(spec.sandbox_id, data, self.boot_calls(spec))
            _write_diff_base(spec.workspace, "boot")
            await self._wait_envd(handle)
            await self._init_envd(handle, "", init_body(spec))
        except BaseException:
            await self._cleanup(spec.sandbox_id, data)
            raise
        self.last_timings = {"disk": t_disk, "total": time.monotonic() - t0}
        return handle

    def exit_reason(self, handle: RuntimeHandle) -> str | None:
        """`LivenessDriver`: whether the VM's Firecracker process runs."""
        if self._alive(handle.data):
            return None
        return "the sandbox's virtual machine (its Firecracker process) exited or was killed"

    async def attach(self, handle: RuntimeHandle) -> bool:
        if not self._alive(handle.data):
            return False
        self.networks.claim(self._net(handle.data))
        return True

    async def connect(self, handle: RuntimeHandle, port: int) -> socket.socket:
        data = handle.data
        try:
            return await self.networks.connect(self._net(data), port, 10)
        except (OSError, TimeoutError) as exc:
            if not self._alive(data):
                raise AenvError(ErrorCode.UNAVAILABLE,
                                f"sandbox {handle.sandbox_id} is not running") from None
            raise AenvError(ErrorCode.PORT_CLOSED,
                            f"nothing listens on port {port} in sandbox {handle.sandbox_id}: "
                            f"{exc}") from None

    async def stats(self, handle: RuntimeHandle) -> ResourceUsage:
        sid, data = handle.sandbox_id, handle.data
        if not self._alive(data):
            raise AenvError(ErrorCode.NOT_FOUND, f"sandbox {sid} is not running")
        pid = int(data["pid"])
        ticks, rss = _proc_usage(pid)
        now = time.monotonic()
        prev = self._cpu.get(sid)
        if prev is None:
            elapsed = max(uptime() - int(data["start_time"] or 0) / CLK_TCK, 1e-3)
            cpu = ticks / CLK_TCK / elapsed * 100.0
        else:
            cpu = max(ticks - prev[0], 0) / CLK_TCK / max(now - prev[1], 1e-6) * 100.0
        self._cpu[sid] = (ticks, now)
        total = int(data["memory_mb"]) << 20
        used, cache = rss, 0
        with contextlib.suppress(AenvError, ValueError, TypeError, KeyError):
            async with self._api(data) as fc:
                st = await fc.call(api.balloon_statistics())
            if st.get("total_memory"):
                total = int(st["total_memory"])
                used = total - int(st.get("available_memory") or st.get("free_memory") or 0)
                cache = int(st.get("disk_caches") or 0)
        try:
            st_disk = os.stat(Path(data["workspace"]) / ROOTFS)
            disk_used, disk_total = st_disk.st_blocks * 512, st_disk.st_size
        except OSError:
            disk_used, disk_total = 0, self.config.sandbox.disk_size_mb << 20
        return ResourceUsage(cpu_used_pct=round(cpu, 2), mem_used_bytes=used,
                             mem_total_bytes=total, mem_cache_bytes=cache,
                             disk_used_bytes=disk_used, disk_total_bytes=disk_total)

    async def destroy(self, handle: RuntimeHandle) -> None:
        await self._cleanup(handle.sandbox_id, handle.data)

    async def _cleanup(self, sandbox_id: str, data: dict[str, Any]) -> None:
        await self._stop_process(sandbox_id, data)
        await self.networks.release(self._net(data))
        workspace = data.get("workspace")
        if workspace:
            await asyncio.to_thread(shutil.rmtree, workspace, True)

    async def _stop_process(self, sandbox_id: str, data: dict[str, Any]) -> None:
        proc = self._procs.pop(sandbox_id, None)
        self._cpu.pop(sandbox_id, None)
        pid = data.get("pid")
        if pid:
            await process.kill_and_wait(int(pid), data.get("start_time"), proc)

    # ------------------------------------------------------------------ snapshots
    async def _snapshot_into(self, fc: api.FirecrackerApi, workspace: Path, dest: Path
                             ) -> str:
        """Create a snapshot of the paused VM into dest/{vmstate,memory}; the kind taken."""
        base = _read_diff_base(workspace)
        memory, vmstate = dest / MEMORY, str(dest / VMSTATE)
        if base == "boot":  # dirty pages since boot: a complete sparse memory file
            await fc.call(api.snapshot_create(api.SnapshotCreate(vmstate, str(memory), "Diff")))
            return "diff-of-boot"
        if isinstance(base, Path):
            diff = dest / "memory.diff"
            await fc.call(api.snapshot_create(api.SnapshotCreate(vmstate, str(diff), "Diff")))
            try:
                await asyncio.to_thread(disk.merge_diff, base, diff, memory)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    diff.unlink()
            return "diff-merged"
        await fc.call(api.snapshot_create(api.SnapshotCreate(vmstate, str(memory), "Full")))
        return "full"

    async def pause(self, handle: RuntimeHandle) -> RuntimeHandle:
        """Snapshot the VM into its workspace and stop its process: CPU and memory go back to
        the host; the disk and the snapshot stay. The network namespace goes too."""
        sid, data = handle.sandbox_id, dict(handle.data)
        if not self._alive(data):
            raise AenvError(ErrorCode.UNAVAILABLE, f"sandbox {sid} is not running")
        t0 = time.monotonic()
        ws = Path(data["workspace"])
        dest = ws / f"pause-{time.time_ns()}"
        dest.mkdir()
        try:
            async with self._api(data) as fc:
                await fc.call(api.pause_vm())
                try:
                    kind = await self._snapshot_into(fc, ws, dest)
                except BaseException:
                    with contextlib.suppress(AenvError):
                        await fc.call(api.resume_vm())
                    raise
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, dest, True)
            raise
        t_snap = time.monotonic() - t0
        await self._stop_process(sid, data)
        await self.networks.release(self._net(data))
        _write_diff_base(ws, None)
        # Earlier pause directories: the process that mapped them is gone (copies map the
        # orchestrator's snapshot images, never these).
        for old in ws.glob("pause-*"):
            if old != dest:
                await asyncio.to_thread(shutil.rmtree, old, True)
        data.update(pid=None, start_time=None, netns=None, slot=None, images=str(dest))
        self.last_timings = {"snapshot": t_snap, "total": time.monotonic() - t0,
                             "diff": 1.0 if kind != "full" else 0.0}
        return RuntimeHandle(self.name, sid, data)

    async def resume(self, handle: RuntimeHandle, spec: SandboxSpec) -> RuntimeHandle:
        sid, data = handle.sandbox_id, dict(handle.data)
        images = Path(data["images"]) if data.get("images") else None
        if images is None or not (images / VMSTATE).is_file():
            raise AenvError(ErrorCode.NOT_FOUND, f"sandbox {sid}: no paused image to resume from")
        t0 = time.monotonic()
        ws = Path(data["workspace"])
        net = await self.networks.acquire(sid, spec.allow_internet_access)
        data.update(net.to_data())
        try:
            self._spawn(sid, data, net)
            await self._run_calls(sid, data, [*self.log_calls(ws),
                                              self.load_call(images, images / MEMORY)])
            _write_diff_base(ws, images / MEMORY)
            live = RuntimeHandle(self.name, sid, data)
            await self._wait_envd(live)
            await self._guest_sync(live, spec.envd_access_token, hostname=None)
        except BaseException:
            await self._stop_process(sid, data)
            await self.networks.release(net)
            raise
        data["images"] = None  # the pause directory stays: it is the VM's memory file now
        self.last_timings = {"total": time.monotonic() - t0}
        return RuntimeHandle(self.name, sid, data)

    async def snapshot(self, handle: RuntimeHandle, images: Path) -> dict[str, float]:
        """Capture the running VM into `images` (vmstate, memory, a clone of its disk made
        while paused); it runs on afterwards."""
        sid, data = handle.sandbox_id, handle.data
        if not self._alive(data):
            raise AenvError(ErrorCode.UNAVAILABLE, f"sandbox {sid} is not running")
        ws = Path(data["workspace"])
        images.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        async with self._api(data) as fc:
            await fc.call(api.pause_vm())
            try:
                await asyncio.to_thread(disk.clone_file, ws / ROOTFS, images / ROOTFS)
                kind = await self._snapshot_into(fc, ws, images)
            finally:
                await fc.call(api.resume_vm())
        frozen = time.monotonic() - t0
        _write_diff_base(ws, images / MEMORY)  # dirty pages are counted from here on
        _, version = self._ready()
        (images / IMAGE_META).write_text(json.dumps({
            "format": 1, "firecracker": str(version), "memory_mb": data["memory_mb"],
            "cpu_count": data["cpu_count"], "memory": kind}))
        size = sum(p.stat().st_blocks * 512 for p in images.iterdir() if p.is_file())
        return {"frozen_s": frozen, "total_s": time.monotonic() - t0,
                "image_bytes": float(size)}

    async def restore(self, spec: SandboxSpec, images: Path, image_token: str | None
                      ) -> RuntimeHandle:
        """A new VM from `images` with `spec`'s identity: its own disk clone, network
        namespace and envd token; the memory file is shared with every other copy."""
        self._ready()
        sid = spec.sandbox_id
        for name in (VMSTATE, MEMORY, ROOTFS):
            if not (images / name).is_file():
                raise AenvError(ErrorCode.NOT_FOUND, f"snapshot image {images}: no {name}")
        t0 = time.monotonic()
        data = self._new_data(spec)
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # the snapshot's shape
            meta = json.loads((images / IMAGE_META).read_text())
            data.update(memory_mb=int(meta["memory_mb"]), cpu_count=int(meta["cpu_count"]))
        handle = RuntimeHandle(self.name, sid, data)
        try:
            spec.workspace.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(disk.clone_file, images / ROOTFS, spec.workspace / ROOTFS)
            memory = spec.workspace / "base.mem"
            try:
                os.link(images / MEMORY, memory)
            except OSError:
                memory = images / MEMORY  # another filesystem: map the image's file itself
            net = await self.networks.acquire(sid, spec.allow_internet_access)
            data.update(net.to_data())
            self._spawn(sid, data, net)
            await self._run_calls(sid, data, [*self.log_calls(spec.workspace),
                                              self.load_call(images, memory)])
            _write_diff_base(spec.workspace, memory)
            await self._wait_envd(handle)
            await self._init_envd(handle, image_token or "", init_body(spec))
            await self._guest_sync(handle, spec.envd_access_token, hostname=sid)
        except BaseException:
            await self._cleanup(sid, data)
            raise
        self.last_timings = {"total": time.monotonic() - t0}
        return handle

    # ------------------------------------------------------------------ envd
    async def _envd(self, handle: RuntimeHandle, method: str, path: str, body: bytes = b"",
                    headers: dict[str, str] | None = None, timeout: float = 10
                    ) -> tuple[int, bytes]:
        """One HTTP/1.1 request to envd in the guest; (status, raw body)."""
        sock = await self.connect(handle, int(handle.data["envd_port"]))
        loop = asyncio.get_running_loop()
        try:
            head = [f"{method} {path} HTTP/1.1", "Host: envd", "Connection: close",
                    f"Content-Length: {len(body)}"]
            head += [f"{k}: {v}" for k, v in (headers or {}).items()]
            await loop.sock_sendall(sock, ("\r\n".join(head) + "\r\n\r\n").encode() + body)
            reply = b""
            async with asyncio.timeout(timeout):
                while chunk := await loop.sock_recv(sock, 65536):
                    reply += chunk
        except TimeoutError:
            raise AenvError(ErrorCode.TIMEOUT, f"envd {method} {path} timed out") from None
        finally:
            sock.close()
        head_blob, _, rest = reply.partition(b"\r\n\r\n")
        parts = head_blob.split(b"\r\n", 1)[0].split()
        if len(parts) < 2 or not parts[1].isdigit():
            raise AenvError(ErrorCode.INTERNAL, f"envd {path} answered {reply[:100]!r}")
        if b"transfer-encoding: chunked" in head_blob.lower():
            rest = _dechunk(rest)
        return int(parts[1]), rest

    async def _wait_envd(self, handle: RuntimeHandle) -> None:
        """Until envd in the guest answers GET /health (boot or load to userspace)."""
        deadline = time.monotonic() + self.rt.firecracker_boot_timeout_s
        delay = 0.005
        while True:
            try:
                status, _ = await self._envd(handle, "GET", "/health", timeout=2)
                if status < 300:
                    return
            except AenvError:
                pass
            if not self._alive(handle.data):
                tail = process.tail(Path(handle.data["workspace"]) / "serial.log")
                raise AenvError(ErrorCode.INTERNAL,
                                f"microVM {handle.sandbox_id} exited: {tail or 'no console'}")
            if time.monotonic() > deadline:
                tail = process.tail(Path(handle.data["workspace"]) / "serial.log", 300)
                raise AenvError(ErrorCode.TIMEOUT,
                                f"envd in microVM {handle.sandbox_id} did not answer within "
                                f"{self.rt.firecracker_boot_timeout_s} s (console: {tail})")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    async def _init_envd(self, handle: RuntimeHandle, token: str, body: dict[str, Any]
                         ) -> None:
        raw = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if token:
            headers["X-Access-Token"] = token
        status, reply = await self._envd(handle, "POST", "/init", raw, headers)
        if status != 204:
            raise AenvError(ErrorCode.INTERNAL, f"envd /init answered {status}: {reply[:200]!r}")

    async def _guest_sync(self, handle: RuntimeHandle, token: str | None,
                          hostname: str | None) -> None:
        """Through envd, as root: the wall clock (stale after a load), fresh entropy for the
        guest's RNG (copies must not share its state), and for a copy its hostname."""
        if hostname is not None and not _HOSTNAME_RE.fullmatch(hostname):
            raise AenvError(ErrorCode.INVALID_ARGUMENT, f"bad hostname {hostname!r}")
        script = f'date -u -s "@{int(time.time())}" >/dev/null 2>&1 || true\n'
        script += f"printf '%s' '{secrets.token_hex(64)}' > /dev/urandom\n"
        if hostname is not None:
            script += (f"hostname {hostname}\necho {hostname} > /etc/hostname\n"
                       "printf '127.0.0.1\\tlocalhost\\n::1\\tlocalhost ip6-localhost "
                       f"ip6-loopback\\n{GUEST_ADDRESS}\\t{hostname}\\n' > /etc/hosts\n")
        message = json.dumps({"process": {"cmd": "/bin/sh", "args": ["-c", script]},
                              "stdin": False}).encode()
        frame = bytes([0]) + len(message).to_bytes(4, "big") + message
        headers = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
                   "Authorization": "Basic " + base64.b64encode(b"root:").decode(),
                   "Connect-Timeout-Ms": "10000"}
        if token:
            headers["X-Access-Token"] = token
        status, body = await self._envd(handle, "POST", "/process.Process/Start", frame,
                                        headers, timeout=15)
        code = _exit_code(body) if status == 200 else None
        if code != 0:
            raise AenvError(ErrorCode.INTERNAL, f"setting up the guest of {handle.sandbox_id} "
                            f"failed (HTTP {status}, exit {code}): {body[:200]!r}")


# ---------------------------------------------------------------------- helpers
def _write_diff_base(workspace: Path, base: Path | str | None) -> None:
    """Record what the VM's dirty-page log is relative to: "boot", a memory file (with its
    identity, so a file replaced at the same path is not mistaken for it) or nothing."""
    path = workspace / DIFF_BASE
    if base is None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    record: dict[str, Any] = {"base": str(base)}
    if isinstance(base, Path):
        st = base.stat()
        record.update(dev=st.st_dev, ino=st.st_ino, size=st.st_size, mtime_ns=st.st_mtime_ns)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _read_diff_base(workspace: Path) -> Path | str | None:
    try:
        record = json.loads((workspace / DIFF_BASE).read_text())
    except (OSError, ValueError):
        return None
    if record.get("base") == "boot":
        return "boot"
    base = Path(record.get("base", ""))
    try:
        st = base.stat()
    except OSError:
        return None
    same = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == (
        record.get("dev"), record.get("ino"), record.get("size"), record.get("mtime_ns"))
    return base if same else None


def _proc_usage(pid: int) -> tuple[int, int]:
    """(utime + stime in clock ticks, resident bytes) of a process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])
        with open(f"/proc/{pid}/statm", "rb") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        raise AenvError(ErrorCode.NOT_FOUND, f"process {pid} is gone") from None
    return ticks, rss


def _dechunk(raw: bytes) -> bytes:
    out = b""
    while raw:
        size_line, _, raw = raw.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            break
        if size == 0:
            break
        out += raw[:size]
        raw = raw[size + 2:]
    return out


def _exit_code(stream: bytes) -> int | None:
    """The exit code in a Connect stream of process events, None if it has none."""
    code = None
    while len(stream) >= 5:
        length = int.from_bytes(stream[1:5], "big")
        try:
            msg = json.loads(stream[5:5 + length])
        except ValueError:
            return None
        stream = stream[5 + length:]
        if isinstance(msg, dict) and "error" in msg:
            return None
        end = msg.get("event", {}).get("end") if isinstance(msg, dict) else None
        if isinstance(end, dict):
            code = int(end.get("exitCode", 0))
    return code
