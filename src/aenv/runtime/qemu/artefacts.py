"""Guest artefacts of the qemu runtime: kernel, initramfs and the shared tools image.

Owns: /opt/aenv/vm/qemu/<content hash>/ (`vmlinuz`, `initrd`, `tools.img`, `ARTEFACTS.json`) and the
symlink /opt/aenv/vm/qemu/current pointing at the newest build. A build that changes anything lands
in a new directory, so VMs started from an older one (their handle records its path) keep
working; nothing here ever rewrites a finished directory.
Must not touch: the Python bundle it copies from (/opt/aenv/runtime/py311), the unpacked
kernel package (/opt/aenv/vm/qemu/kernel/<pkg>/, made by scripts/install-vm.sh), the host's /boot.

Why an initramfs: Debian's kernels have every virtio driver as a module and microvm has no PCI,
so a tiny busybox initramfs loads virtio_mmio/blk/net/console/balloon/rng, mounts the root
disk and the tools disk, configures eth0 and switch_root()s into the template's root with
`guest.py` (on the bundled Python from the tools image) as PID 1.

Usage (root, from scripts/install-vm.sh):
    python -m aenv.runtime.qemu.artefacts build --kernel-dir DIR [--dest /opt/aenv/vm/qemu]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from aenv.runtime import pybundle

VM_DIR = Path("/opt/aenv/vm/qemu")
CURRENT = "current"
MANIFEST = "ARTEFACTS.json"
FORMAT = 1  # bump when the layout of an artefact directory changes
BUSYBOX = Path("/bin/busybox")  # busybox-static: the initramfs has no libc
# Where the tools image is mounted inside the guest, and the bundle inside it.
GUEST_TOOLS = "/opt/aenv/vm-tools"
GUEST_PY = f"{GUEST_TOOLS}/py311"
TOOLS_LABEL = "aenv-tools"
ROOT_LABEL = "aenv-root"
# Load order respects the modules' dependencies (no depmod/modprobe in the initramfs).
MODULES = ("virtio_ring", "virtio", "virtio_mmio", "virtio_blk", "failover", "net_failover",
           "virtio_net", "virtio_console", "virtio_balloon", "virtio-rng")

# Stage 1, PID 1 of the initramfs. Parameters come from the kernel command line (aenv.*);
# secrets never do (/proc/cmdline is world-readable in the guest): guest.py reads those
# from the host over the virtio-serial control port.
INIT_SCRIPT = r"""#!/bin/sh
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
read up _ < /proc/uptime; echo "aenv-init: stage 1 at ${up}s"
for m in @MODULES@; do
  insmod /lib/modules/$m.ko 2>/dev/null || echo "aenv-init: insmod $m failed"
done
ip= ; gw=
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    aenv.probe=1) echo "AENV-PROBE-OK"; poweroff -f; sleep 10 ;;
    aenv.ip=*) ip="${arg#aenv.ip=}" ;;
    aenv.gw=*) gw="${arg#aenv.gw=}" ;;
  esac
done
# virtio-blk probes are synchronous with insmod, but be patient with slow (TCG) guests.
n=0
while :; do
  root=$(findfs LABEL=@ROOT@ 2>/dev/null) && tools=$(findfs LABEL=@TOOLS@ 2>/dev/null) && break
  n=$((n+1)); if [ $n -gt 1000 ]; then echo "aenv-init: disks not found"; poweroff -f; fi
  sleep 0.01
done
mkdir -p /newroot
# noinit_itable: the image's inode tables are initialised at mkfs time; never zero them
# again in every VM's copy-on-write overlay.
mount -t ext4 -o rw,noatime,noinit_itable "$root" /newroot || { echo "aenv-init: root mount failed"; poweroff -f; }
mkdir -p /newroot@GUEST_TOOLS@
mount -t ext4 -o ro,noload "$tools" /newroot@GUEST_TOOLS@ || { echo "aenv-init: tools mount failed"; poweroff -f; }
ip link set lo up
if [ -n "$ip" ]; then
  ip link set eth0 up && ip addr add "$ip" dev eth0
  [ -n "$gw" ] && ip route add default via "$gw"
fi
read up _ < /proc/uptime; echo "aenv-init: switch_root at ${up}s"
for d in dev proc sys; do mkdir -p /newroot/$d; mount --move /$d /newroot/$d; done
export LC_ALL=C
exec switch_root /newroot @GUEST_PY@/lib/ld-linux-x86-64.so.2 --library-path @GUEST_PY@/lib \
  @GUEST_PY@/bin/python3.11 -I -S @GUEST_TOOLS@/guest.py
"""


@dataclass(frozen=True)
class Artefacts:
    """One finished artefact directory."""

    root: Path

    @property
    def kernel(self) -> Path:
        return self.root / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.root / "initrd"

    @property
    def tools(self) -> Path:
        return self.root / "tools.img"

    @property
    def version(self) -> str:
        return self.root.name

    def manifest(self) -> dict[str, object]:
        data: dict[str, object] = json.loads((self.root / MANIFEST).read_text())
        return data


def current(vm_dir: Path = VM_DIR) -> Artefacts | None:
    """The newest complete build, or None if `make install` has not made one."""
    link = vm_dir / CURRENT
    try:
        root = link.resolve(strict=True)
    except (FileNotFoundError, RuntimeError):
        return None
    found = Artefacts(root)
    if not (root / MANIFEST).is_file():
        return None
    return found


def kernel_dirs(vm_dir: Path = VM_DIR) -> list[Path]:
    """Unpacked kernel packages (scripts/install-vm.sh), newest name last."""
    base = vm_dir / "kernel"
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if (p / ".complete").exists())


def init_script() -> str:
    out = INIT_SCRIPT.replace("@MODULES@", " ".join(MODULES))
    for key, value in (("@ROOT@", ROOT_LABEL), ("@TOOLS@", TOOLS_LABEL),
                       ("@GUEST_TOOLS@", GUEST_TOOLS), ("@GUEST_PY@", GUEST_PY)):
        out = out.replace(key, value)
    return out


# -- cpio (newc), written by hand: no cpio binary needed, and device nodes need no root ----
def _cpio_entry(name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0),
                ino: int = 0) -> bytes:
    namez = name.encode() + b"\0"
    fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(namez), 0)
    head = b"070701" + b"".join(b"%08X" % f for f in fields)
    out = head + namez
    out += b"\0" * (-len(out) % 4)
    out += data
    out += b"\0" * (-len(out) % 4)
    return out


def build_initramfs(modules_dir: Path, busybox: Path = BUSYBOX) -> bytes:
    """An uncompressed newc archive (the kernel unpacks that fastest)."""
    parts: list[bytes] = []
    ino = 1

    def add(name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> None:
        nonlocal ino
        parts.append(_cpio_entry(name, mode, data, rdev, ino))
        ino += 1

    for d in ("bin", "dev", "proc", "sys", "newroot", "lib", "lib/modules"):
        add(d, 0o040755)
    add("dev/console", 0o020600, rdev=(5, 1))
    add("dev/null", 0o020666, rdev=(1, 3))
    add("bin/busybox", 0o100755, busybox.read_bytes())
    applets = ("sh", "mount", "insmod", "cat", "echo", "findfs", "mkdir", "ip", "sleep",
               "poweroff", "switch_root")
    for applet in applets:
        add(f"bin/{applet}", 0o120777, b"busybox")  # symlink: the target is the data
    for mod in MODULES:
        found = list(modules_dir.rglob(f"{mod}.ko"))
        if not found:
            raise SystemExit(f"artefacts: kernel module {mod}.ko not found under {modules_dir}")
        add(f"lib/modules/{mod}.ko", 0o100644, found[0].read_bytes())
    add("init", 0o100755, init_script().encode())
    parts.append(_cpio_entry("TRAILER!!!", 0))
    return b"".join(parts)


def _hash_tree(root: Path, digest: hashlib._Hash) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            digest.update(str(path.relative_to(root)).encode() + b"\0")
            digest.update(path.read_bytes())


def _mkfs_ext4(source: Path, image: Path, label: str, size_mb: int, journal: bool) -> None:
    image.unlink(missing_ok=True)
    with open(image, "wb") as f:
        f.truncate(size_mb * 2**20)  # sparse
    argv = ["mkfs.ext4", "-q", "-F", "-L", label, "-d", str(source), "-b", "4096",
            "-E", "lazy_itable_init=0,lazy_journal_init=0,root_owner=0:0", "-m", "0"]
    if not journal:
        argv += ["-O", "^has_journal"]
    proc = subprocess.run([*argv, str(image)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"artefacts: mkfs.ext4 {image} failed: {proc.stderr.strip()}")


def _du_mb(root: Path) -> int:
    total = 0
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total // 2**20 + 1


def build(kernel_dir: Path, dest: Path = VM_DIR, bundle: Path = pybundle.BUNDLE_DIR) -> Artefacts:
    """Build (or find) the artefact directory for this kernel, bundle and guest code."""
    if not pybundle.loader_path(bundle).exists():
        pybundle.build(bundle)
    vmlinuz = sorted((kernel_dir / "boot").glob("vmlinuz-*"))
    if not vmlinuz:
        raise SystemExit(f"artefacts: no vmlinuz-* under {kernel_dir}/boot")
    modules_dir = next((kernel_dir / "lib" / "modules").iterdir())
    guest_src = Path(__file__).with_name("guest.py")
    initrd = build_initramfs(modules_dir)
    digest = hashlib.sha256(f"aenv-vm-format-{FORMAT}".encode())
    digest.update(vmlinuz[-1].read_bytes())
    digest.update(initrd)
    digest.update(guest_src.read_bytes())
    _hash_tree(bundle, digest)
    version = digest.hexdigest()[:16]
    final = dest / version
    dest.mkdir(parents=True, exist_ok=True)
    if not (final / MANIFEST).is_file():
        stage = Path(tempfile.mkdtemp(prefix=".build-", dir=dest))
        try:
            shutil.copyfile(vmlinuz[-1], stage / "vmlinuz")
            (stage / "initrd").write_bytes(initrd)
            tree = stage / "tools-tree"
            shutil.copytree(bundle, tree / "py311", symlinks=True)
            shutil.copyfile(guest_src, tree / "guest.py")
            _mkfs_ext4(tree, stage / "tools.img", TOOLS_LABEL,
                       size_mb=int(_du_mb(tree) * 1.3) + 16, journal=False)
            shutil.rmtree(tree)
            manifest = {"format": FORMAT, "version": version,
                        "kernel": vmlinuz[-1].name.removeprefix("vmlinuz-"),
                        "kernel_package": kernel_dir.name, "modules": list(MODULES)}
            (stage / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            for path in stage.iterdir():
                path.chmod(0o644)
            stage.chmod(0o755)
            try:
                os.rename(stage, final)
            except OSError:
                if not (final / MANIFEST).is_file():
                    raise
                shutil.rmtree(stage)  # another process built the same version meanwhile
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
    tmp_link = dest / f".{CURRENT}.{os.getpid()}.tmp"
    tmp_link.unlink(missing_ok=True)
    tmp_link.symlink_to(version)
    os.replace(tmp_link, dest / CURRENT)  # atomic switch; older directories stay
    return Artefacts(final)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aenv.runtime.qemu.artefacts")
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the guest artefacts (idempotent)")
    b.add_argument("--kernel-dir", type=Path, required=True,
                   help="an unpacked linux-image-*.deb (has boot/ and lib/modules/)")
    b.add_argument("--dest", type=Path, default=VM_DIR)
    b.add_argument("--bundle", type=Path, default=pybundle.BUNDLE_DIR)
    args = parser.parse_args(argv)
    found = build(args.kernel_dir, args.dest, args.bundle)
    print(f"vm artefacts: {found.root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
