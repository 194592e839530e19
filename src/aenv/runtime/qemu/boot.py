"""QEMU and kernel command lines, and the choice of accelerator.

Owns: the argv of every QEMU process the driver starts, the guest kernel command line, and the
accelerator probe's cache file (/run/aenv/qemu-accel.json).
Must not touch: running VMs (it only builds argument lists and runs the probe VM).

Accelerator: `runtime.qemu_accel = "auto"` boots the guest kernel once with KVM and a short
timeout; if the guest's init does not report in time (nested or paravirtualised KVM where a
stock kernel hangs, or `-cpu host` aborting on unknown MSRs), TCG (software emulation) is used.
The outcome is cached per QEMU binary, artefacts and /dev/kvm, so the probe runs once per host
boot.

Why these machine options: `microvm` (no PCI, no firmware, virtio-mmio) boots in about a
second even under TCG. Its kernel needs `tsc_early_khz=` (otherwise about one boot in ten
hangs calibrating the TSC under TCG); `pit=off,pic=off` and `acpi=off` break Debian's kernel,
and ACPI is also how virtio-mmio devices are found (no virtio_mmio.device= support built in).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from aenv.errors import AenvError, ErrorCode
from aenv.runtime import process
from aenv.runtime.qemu.artefacts import Artefacts
from aenv.runtime.qemu.network import GUEST_ADDRESS, GUEST_MAC, HOST_SIDE, PREFIX, TAP

QEMU = "qemu-system-x86_64"
ACCELS = ("auto", "kvm", "tcg")
PROBE_MARK = b"AENV-PROBE-OK"
# Per host and boot (tmpfs): every server on the host shares one probe.
PROBE_CACHE = Path("/run/aenv/qemu-accel.json")


def qemu_binary() -> str:
    path = shutil.which(QEMU)
    if path is None:
        raise AenvError(ErrorCode.UNAVAILABLE, f"{QEMU} not installed: run `make install`")
    return path


def tsc_khz() -> int:
    """The host TSC frequency in kHz, from /proc/cpuinfo (`cpu MHz`)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    return 0


def kernel_cmdline(*, probe: bool = False, network: bool = True) -> str:
    parts = ["console=ttyS0", "panic=-1", "quiet", "loglevel=3", "random.trust_cpu=on",
             "i8042.noaux", "i8042.nokbd", "cryptomgr.notests", "nomodeset",
             "tsc=reliable", "nowatchdog"]
    khz = tsc_khz()
    if khz:
        parts.append(f"tsc_early_khz={khz}")
    if probe:
        parts.append("aenv.probe=1")
    elif network:
        parts += [f"aenv.ip={GUEST_ADDRESS}/{PREFIX}", f"aenv.gw={HOST_SIDE}"]
    return " ".join(parts)


@dataclass
class VmPaths:
    """Files of one QEMU process, all inside the sandbox's workspace (or a probe dir)."""

    root: Path

    @property
    def qmp(self) -> Path:
        return self.root / "qmp.sock"

    @property
    def ctl(self) -> Path:
        return self.root / "ctl.sock"

    @property
    def pidfile(self) -> Path:
        return self.root / "qemu.pid"

    @property
    def console(self) -> Path:
        return self.root / "console.log"

    @property
    def disk(self) -> Path:
        return self.root / "disk.qcow2"


@dataclass
class VmConfig:
    artefacts: Artefacts
    accel: str  # kvm | tcg
    cpus: int
    memory_mb: int
    paths: VmPaths
    ram_path: Path | None  # memory-backend-file; None: anonymous RAM (the probe)
    ram_shared: bool = True  # share=off maps the file copy-on-write (fork children)
    network: bool = True
    incoming: Path | None = None  # a migration stream to start from (paused, `cont` later)
    extra: list[str] = field(default_factory=list)


# QEMU's own seccomp filter (`-sandbox`): a denylist (mount, reboot, kexec, swap, syslog,
# module and obsolete syscalls; with resourcecontrol=deny scheduler and priority changes).
# Not elevateprivileges=deny: it refuses setsid, which -daemonize needs; not spawn=deny: the
# daemonizing fork and the `exec:cat` migration streams of pause and snapshot need fork+exec.
SANDBOX = "on,obsolete=deny,resourcecontrol=deny"


def qemu_argv(cfg: VmConfig, probe: bool = False) -> list[str]:
    a = cfg.artefacts
    argv = [qemu_binary(), "-M", "microvm,rtc=on,x-option-roms=off",
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-smp", str(cfg.cpus)]
    if cfg.accel == "kvm":
        # Not `-cpu host`: it aborts on MSRs a nested/paravirtualised KVM does not offer.
        argv += ["-accel", "kvm"]
    else:
        # Multi-threaded TCG: one host thread per vCPU.
        argv += ["-accel", "tcg,thread=multi", "-cpu", "max"]
    if cfg.ram_path is not None:
        argv += ["-m", f"{cfg.memory_mb}M",
                 "-object", (f"memory-backend-file,id=ram,size={cfg.memory_mb}M,"
                             f"mem-path={cfg.ram_path},share={'on' if cfg.ram_shared else 'off'}"
                             ",prealloc=off"),
                 "-machine", "memory-backend=ram"]
    else:
        argv += ["-m", f"{cfg.memory_mb}M"]
    argv += ["-kernel", str(a.kernel), "-initrd", str(a.initrd),
             "-append", kernel_cmdline(probe=probe, network=cfg.network),
             "-serial", f"file:{cfg.paths.console}"]
    if not probe:
        argv += [
            "-drive", (f"id=root,file={cfg.paths.disk},format=qcow2,if=none,discard=unmap,"
                       "cache=writeback"),
            "-device", "virtio-blk-device,drive=root",
            "-drive", f"id=tools,file={a.tools},format=raw,readonly=on,if=none",
            "-device", "virtio-blk-device,drive=tools",
            "-device", "virtio-serial-device",
            "-chardev", f"socket,id=ctl,path={cfg.paths.ctl},server=on,wait=off",
            "-device", "virtserialport,chardev=ctl,name=aenv.ctl",
            # Free-page reporting: pages the guest frees go back to the host (madvise /
            # hole punching in the RAM file) without any balloon inflation by us.
            "-device", "virtio-balloon-device,free-page-reporting=on",
            "-device", "virtio-rng-device",
        ]
        if cfg.network:
            argv += ["-netdev", f"tap,id=net0,ifname={TAP},script=no,downscript=no",
                     "-device", f"virtio-net-device,netdev=net0,mac={GUEST_MAC}"]
    argv += ["-qmp", f"unix:{cfg.paths.qmp},server=on,wait=off",
             "-pidfile", str(cfg.paths.pidfile), "-daemonize"]
    argv += ["-sandbox", SANDBOX]
    if cfg.incoming is not None:
        # QEMU 7.2 has no file: migration URI; exec:cat streams it. The path is ours
        # (workspace or snapshot directory), quoted for the shell QEMU runs.
        argv += ["-incoming", f"exec:cat '{cfg.incoming}'"]
    return argv + cfg.extra


async def spawn(argv: list[str], netns: Path | None, log: Path) -> None:
    """Start a daemonizing QEMU (in `netns` if given) and wait until it has daemonized: by
    then its monitor and control sockets exist. It runs in its own session, so it survives
    the server (a restarted server re-attaches through the pidfile and QMP socket)."""
    if netns is not None:
        argv = ["nsenter", f"--net={netns}", "--", *argv]
    with open(log, "ab") as out:  # noqa: ASYNC230 (a local file, opened once)
        try:
            rc = (await process.run(argv, log=out, new_session=True, cwd="/")).returncode
        except FileNotFoundError:
            raise AenvError(ErrorCode.UNAVAILABLE, f"{argv[0]} not installed: run `make install`"
                            ) from None
    if rc != 0:
        tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
        raise AenvError(ErrorCode.INTERNAL, f"qemu failed to start (exit {rc}): {tail}")


def read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


# -- accelerator probe ----------------------------------------------------------------------
def _probe_key(artefacts: Artefacts) -> str:
    qemu = qemu_binary()
    st = os.stat(qemu)
    kvm = os.path.exists("/dev/kvm")
    return f"{qemu}:{st.st_size}:{st.st_mtime_ns}:{artefacts.version}:kvm={kvm}"


async def probe_kvm(artefacts: Artefacts, timeout: float) -> tuple[bool, str]:
    """Boot the guest kernel once under KVM; True if its init reports within `timeout`."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "no /dev/kvm"
    work = Path(tempfile.mkdtemp(prefix="aenv-kvm-probe-"))
    paths = VmPaths(work)
    cfg = VmConfig(artefacts=artefacts, accel="kvm", cpus=1, memory_mb=256, paths=paths,
                   ram_path=None, network=False)
    argv = qemu_argv(cfg, probe=True)
    argv = [x for x in argv if x != "-daemonize"]
    proc: asyncio.subprocess.Process | None = None
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if paths.console.exists() and PROBE_MARK in paths.console.read_bytes():
                return True, "guest booted under KVM"
            if proc.returncode is not None:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 0.1)
        if proc.returncode is not None and proc.returncode != 0:
            err = b""
            if proc.stderr is not None:
                err = await proc.stderr.read()
            return False, f"qemu -accel kvm exited {proc.returncode}: {err.decode()[-300:]}"
        return False, f"guest did not boot under KVM within {timeout:.0f} s"
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        shutil.rmtree(work, ignore_errors=True)


async def choose_accel(setting: str, artefacts: Artefacts, cache: Path,
                       timeout: float = 10.0) -> tuple[str, str]:
    """(accelerator, why). `setting` is runtime.qemu_accel."""
    if setting not in ACCELS:
        raise AenvError(ErrorCode.INVALID_ARGUMENT,
                        f"runtime.qemu_accel must be one of {', '.join(ACCELS)}, got {setting!r}")
    if setting != "auto":
        return setting, "configured"
    key = _probe_key(artefacts)
    with contextlib.suppress(OSError, ValueError, KeyError):
        saved = json.loads(cache.read_text())
        if saved["key"] == key:
            return str(saved["accel"]), f"cached probe: {saved['why']}"
    ok, why = await probe_kvm(artefacts, timeout)
    accel = "kvm" if ok else "tcg"
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, "accel": accel, "why": why}))
    os.replace(tmp, cache)
    return accel, why
