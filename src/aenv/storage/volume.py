"""A btrfs filesystem in a sparse file, loop-mounted: where sandbox workspaces, sealed layers
and snapshots live on hosts whose own filesystem cannot seal a writable layer in O(1) (ext4).

On btrfs every sandbox's writable layer is a subvolume: a snapshot or a fork seals it with a
read-only btrfs snapshot (no data or metadata copied, whatever its size), and its disk size is
a quota (simple quotas, runtime/container/driver.py). `attach_storage()` (the server, at
start; `storage.volume = "auto"`) keeps one such volume per home: made once, mounted
`nosuid,nodev` at `$home/volume` (so nothing a sandbox leaves in its layers is a setuid
program or a device node on the host), re-mounted after a reboot, reused after a restart or
a `kill -9` of the server, and `$home/{layers,sandboxes,snapshots,runtime,cache,volumes}` are
symlinks into it (`volumes` too). The database and secrets stay on the home's own filesystem: a full volume
fails writes in sandboxes, never the server's. It stays mounted when the server stops
(sandboxes outlive their server); `detach_storage()` unmounts it. `mount_btrfs_volume()` is
the tests' throwaway home.

Owns: the loop mounts it makes, the volume's image file, the symlinks into it. Must not touch:
anything inside the mounted filesystem (its subdirectories belong to their modules).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from aenv.errors import AenvError, ErrorCode, invalid
from aenv.runtime.container import linux

log = logging.getLogger(__name__)

DEFAULT_SIZE = 64 * 2**30  # sparse: only what is written takes host disk
VOLUME_DIR = "volume"  # $home/volume: the mount point
# What goes on the volume: everything a seal, a fork or a snapshot renames or snapshots
# between (a snapshot image moves from snapshots/ into cache/snapshots/).
STORAGE_DIRS = ("layers", "sandboxes", "snapshots", "runtime", "cache", "volumes")
MOUNT_OPTIONS = "loop,nosuid,nodev,noatime"


def btrfs_available() -> bool:
    return shutil.which("mkfs.btrfs") is not None and Path("/dev/loop-control").exists()


def mount_btrfs_volume(mountpoint: Path, size_bytes: int = DEFAULT_SIZE) -> None:
    """Make a fresh btrfs filesystem in a sparse file and mount it on `mountpoint` (an
    existing, empty directory). The file is unlinked once mounted, so unmounting frees it."""
    fd, image = tempfile.mkstemp(prefix="aenv-volume-", suffix=".img", dir="/var/tmp")
    try:
        os.ftruncate(fd, size_bytes)
        os.close(fd)
        for cmd in (["mkfs.btrfs", "-q", "-f", image],
                    ["mount", "-o", MOUNT_OPTIONS, image, str(mountpoint)]):
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise AenvError(ErrorCode.UNAVAILABLE,
                                f"{' '.join(cmd[:2])}: {proc.stderr.strip() or proc.stdout}")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(image)


def unmount_volume(mountpoint: Path) -> None:
    """Lazily unmount `mountpoint` if something is mounted there (the loop device and its
    deleted file go away with the last user)."""
    if os.path.ismount(mountpoint):
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, check=False)


@dataclass(frozen=True)
class ManagedVolume:
    image: Path
    mountpoint: Path


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise AenvError(ErrorCode.UNAVAILABLE,
                        f"storage volume: {' '.join(cmd)}: {proc.stderr.strip() or proc.stdout}")


def _make_image(image: Path, size_bytes: int) -> None:
    """A fresh btrfs filesystem in a sparse file: made under a temporary name and renamed,
    so a crash half-way never leaves an image that looks usable."""
    image.parent.mkdir(parents=True, exist_ok=True)
    tmp = image.with_name(image.name + ".new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size_bytes)
    finally:
        os.close(fd)
    try:
        _run(["mkfs.btrfs", "-q", "-f", str(tmp)])
        os.replace(tmp, image)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _has_sandboxes(home: Path) -> bool:
    """Workspaces already on the home's own filesystem (of an install from before the volume):
    they stay there, with their running overlays and paused images."""
    for path in (home / "sandboxes", home / "runtime" / "container" / "pool"):
        if path.is_dir() and not path.is_symlink() and any(path.iterdir()):
            return True
    return False


def _link_into(home: Path, mountpoint: Path) -> None:
    """$home/<dir> -> volume/<dir> for each storage dir; the content of a real directory of
    that name (layers, snapshots of an older install) is moved onto the volume first."""
    for name in STORAGE_DIRS:
        link, target = home / name, mountpoint / name
        target.mkdir(mode=0o700, exist_ok=True)
        relative = Path(VOLUME_DIR) / name
        if link.is_symlink():
            if Path(os.readlink(link)) == relative:
                continue
            link.unlink()
        elif link.is_dir():
            for entry in link.iterdir():
                if not (target / entry.name).exists() and not (target / entry.name).is_symlink():
                    shutil.move(entry, target / entry.name)  # a copy: another filesystem
            shutil.rmtree(link)
        link.symlink_to(relative)


def _direct_io(mountpoint: Path) -> None:
    """The loop device reads and writes its image with O_DIRECT: otherwise every block a
    sandbox writes is cached twice, by btrfs and again as the image file's pages on the host.
    Best effort (a host filesystem without O_DIRECT keeps buffered I/O)."""
    dev = subprocess.run(["findmnt", "-n", "-o", "SOURCE", str(mountpoint)],
                         capture_output=True, text=True, check=False).stdout.strip()
    if dev.startswith("/dev/loop"):
        proc = subprocess.run(["losetup", "--direct-io=on", dev], capture_output=True,
                              text=True, check=False)
        if proc.returncode != 0:
            log.warning("storage volume: %s stays on buffered I/O: %s", dev,
                        proc.stderr.strip())


def attach_storage(home: Path, mode: str, size_gb: int = 0, image: str = "") -> ManagedVolume | None:
    """Make sure the home's sandbox storage is on a btrfs volume when `mode` is "auto" and the
    home's filesystem is not btrfs: create the volume once, mount it if it is not (a reboot),
    reuse it if it is (a restart). Returns None where the home's own filesystem is used.
    Blocking; idempotent."""
    if mode not in ("auto", "off"):
        raise invalid(f"config storage.volume: {mode!r} is neither 'auto' nor 'off'")
    mountpoint = home / VOLUME_DIR
    image_path = Path(image) if image else home / "volume.img"
    if mode == "off":
        return None
    if os.path.ismount(mountpoint):
        if not linux.on_btrfs(str(mountpoint)):
            raise AenvError(ErrorCode.UNAVAILABLE,
                            f"storage volume: {mountpoint} is mounted but is not btrfs")
        _link_into(home, mountpoint)
        return ManagedVolume(image_path, mountpoint)
    if linux.on_btrfs(str(home)):
        return None  # O(1) snapshots and quotas on the home's own filesystem
    if _has_sandboxes(home):
        log.warning("storage.volume=auto: %s holds sandboxes made on its own filesystem; "
                    "they stay there (snapshots copy writable layers, disk sizes are not "
                    "enforced) until none is left", home)
        return None
    if not btrfs_available():
        log.warning("storage.volume=auto: no mkfs.btrfs or /dev/loop-control; sandbox storage "
                    "stays on %s", home)
        return None
    if not image_path.exists():
        size = size_gb * 2**30
        if size <= 0:
            image_path.parent.mkdir(parents=True, exist_ok=True)
            st = os.statvfs(image_path.parent)
            size = st.f_bavail * st.f_frsize * 3 // 4
        _make_image(image_path, size)
        log.info("storage volume: made %s (%d GiB, sparse)", image_path, size >> 30)
    mountpoint.mkdir(mode=0o700, exist_ok=True)
    _run(["mount", "-o", MOUNT_OPTIONS, str(image_path), str(mountpoint)])
    _direct_io(mountpoint)
    mountpoint.chmod(0o700)
    _link_into(home, mountpoint)
    log.info("storage volume: %s mounted at %s", image_path, mountpoint)
    return ManagedVolume(image_path, mountpoint)


def detach_storage(home: Path) -> None:
    """Unmount the home's managed volume, if mounted (its loop device goes with the last
    user: `mount -o loop` sets autoclear). Sandboxes using it must be gone."""
    unmount_volume(home / VOLUME_DIR)
