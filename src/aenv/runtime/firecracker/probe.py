"""Can this host run Firecracker microVMs? An honest answer, with the reason when not.

Checks, in order, stopping at the first failure: a `firecracker` binary (configured, or on
PATH), its version (>= v1.14), /dev/kvm usable (KVM_GET_API_VERSION and KVM_CREATE_VM), the
guest kernel and root filesystem files, and finally a real test boot: a 1-vCPU microVM of the
configured kernel (root disk read-only) must reach userspace ("Run /..." or "Freeing unused
kernel" on its serial console) within the timeout. KVM_CREATE_VM alone proves little: on a
PVM host (the `kvm_pvm` module: KVM without VT-x/AMD-V, as on the machines aenv is developed
on) it succeeds, yet a stock guest kernel hangs early in boot.

Owns: a temporary directory and a Firecracker process during the test boot, both removed.
Must not touch: the configured kernel and rootfs (the probe's root disk is read-only).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from aenv.config import Config
from aenv.errors import AenvError, ErrorCode
from aenv.runtime.firecracker import api, process

KVM_GET_API_VERSION = 0xAE00
KVM_CREATE_VM = 0xAE01
RELEASES = "https://github.com/firecracker-microvm/firecracker/releases"
BOOT_MARKERS = (b"Run /", b"Freeing unused kernel")
PROBE_BOOT_ARGS = "console=ttyS0 reboot=k panic=1 pci=off"


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str  # why not (or what was checked, when ok)
    binary: str | None = None
    version: api.FirecrackerVersion | None = None


def find_binary(configured: str) -> str | None:
    if configured:
        path = Path(configured)
        return str(path) if path.is_file() and os.access(path, os.X_OK) else None
    return shutil.which("firecracker")


def binary_version(binary: str) -> api.FirecrackerVersion:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10,
                             check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AenvError(ErrorCode.UNAVAILABLE, f"{binary} --version failed: {exc}") from None
    return api.FirecrackerVersion.parse(out.stdout + out.stderr)


def is_pvm_host() -> bool:
    """KVM provided by the PVM module (no hardware virtualisation visible)."""
    return Path("/sys/module/kvm_pvm").exists()


def check_kvm(device: str = "/dev/kvm") -> str | None:
    """None if KVM can create a VM, else why not."""
    try:
        fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return f"{device} cannot be opened ({exc.strerror}): KVM is not available on this host"
    try:
        version = fcntl.ioctl(fd, KVM_GET_API_VERSION, 0)
        if version != 12:
            return f"{device} speaks KVM API {version}, not 12"
        vm = fcntl.ioctl(fd, KVM_CREATE_VM, 0)
        os.close(vm)
    except OSError as exc:
        return f"KVM_CREATE_VM on {device} failed ({exc.strerror})"
    finally:
        os.close(fd)
    return None


def not_installed(configured: str) -> str:
    where = f"no executable at {configured}" if configured else "no `firecracker` on PATH"
    return (f"firecracker is not installed ({where}; it is not packaged in Debian: download a "
            f"release from {RELEASES} and set runtime.firecracker_binary)")


async def test_boot(binary: str, kernel: Path, rootfs: Path, timeout: float,
                    initrd: Path | None = None) -> str | None:
    """Boot the kernel once; None if it reached userspace within `timeout` s, else why not."""
    tmp = Path(tempfile.mkdtemp(prefix="aenv-fc-probe-"))
    serial = tmp / "serial.log"
    proc = process.spawn(binary, tmp, tmp / "api.sock", "aenv-probe", None, serial)
    try:
        async with api.FirecrackerApi(str(tmp / "api.sock")) as fc:
            await fc.wait_ready(5, alive=lambda: proc.poll() is None)
            await fc.call(api.put_logger(api.Logger(str(tmp / "firecracker.log"))))
            await fc.call(api.put_machine_config(api.MachineConfig(vcpu_count=1,
                                                                   mem_size_mib=128)))
            await fc.call(api.put_boot_source(api.BootSource(
                str(kernel), PROBE_BOOT_ARGS, str(initrd) if initrd else None)))
            await fc.call(api.put_drive(api.Drive("rootfs", str(rootfs), is_root_device=True,
                                                  is_read_only=True)))
            await fc.call(api.instance_start())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen = serial.read_bytes() if serial.exists() else b""
            if any(marker in seen for marker in BOOT_MARKERS):
                return None
            if proc.poll() is not None:
                return (f"the test boot of {kernel} ended before reaching userspace: "
                        f"{process.tail(serial) or 'no console output'}")
            await asyncio.sleep(0.1)
        why = (f"the test boot of {kernel} did not reach userspace within {timeout:.0f} s "
               f"(console: {process.tail(serial, 200) or 'nothing'})")
        if is_pvm_host():
            why += ("; KVM on this host is PVM (kvm_pvm, no VT-x/AMD-V), where stock guest "
                    "kernels hang: run aenv's Firecracker driver on a host with hardware KVM")
        return why
    except AenvError as exc:
        return f"the test boot failed: {exc.message} ({process.tail(serial)})"
    finally:
        with contextlib.suppress(AenvError):
            await process.kill_and_wait(proc.pid, None, proc)
        shutil.rmtree(tmp, ignore_errors=True)


async def probe(config: Config, boot: bool = True) -> Availability:
    """Whether the Firecracker driver can run here. `boot=False` skips the test boot."""
    rt = config.runtime
    binary = find_binary(rt.firecracker_binary)
    if binary is None:
        return Availability(False, not_installed(rt.firecracker_binary))
    try:
        version = await asyncio.to_thread(binary_version, binary)
    except AenvError as exc:
        return Availability(False, exc.message, binary)
    if not version.supported:
        return Availability(False, f"{binary} is Firecracker {version}; aenv needs v1.14 or "
                            f"newer ({RELEASES})", binary, version)
    kvm = check_kvm()
    if kvm is not None:
        return Availability(False, kvm, binary, version)
    for what, path, key in (("guest kernel", rt.firecracker_kernel, "firecracker_kernel"),
                            ("guest root filesystem", rt.firecracker_rootfs,
                             "firecracker_rootfs"),
                            ("initramfs", rt.firecracker_initrd, "firecracker_initrd"),
                            ("tools disk", rt.firecracker_tools, "firecracker_tools")):
        if path and not Path(path).is_file():
            return Availability(False, f"no {what} at {path} (set runtime.{key}; see "
                                f"docs/operations.md, Firecracker)", binary, version)
    if boot:
        why = await test_boot(binary, Path(rt.firecracker_kernel), Path(rt.firecracker_rootfs),
                              float(rt.firecracker_probe_timeout_s),
                              Path(rt.firecracker_initrd) if rt.firecracker_initrd else None)
        if why is not None:
            return Availability(False, why, binary, version)
    return Availability(True, f"Firecracker {version} at {binary}, KVM usable, test boot of "
                        f"{rt.firecracker_kernel} reached userspace", binary, version)


def firecracker_available(config: Config | None = None, boot: bool = True) -> tuple[bool, str]:
    """(usable, reason) for tests' skip conditions and the CLI. Runs its own event loop:
    from async code, await `probe()` instead."""
    result = asyncio.run(probe(config or _default_config(), boot=boot))
    return result.ok, result.reason


def _default_config() -> Config:
    from aenv.config import load_config

    return load_config()
